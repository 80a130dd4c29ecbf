"""Fast held-out evaluation: the embedded engine's continuous batching against transformers ``generate``.

Greedy equality is checked token for token, on a redrawn tiny model
(:func:`rollout_server.testing.make_random_model`: long non-repeating greedy continuations
with clear top-1 margins), against a reference that recomputes the whole sequence at every
step without a KV cache. Why this is robust: the backends batch and pad differently, so their
fp32 logits differ by rounding (~1e-6); token identity only breaks when the two best logits
are that close, which the redrawn model's margins rule out (the plain tiny random model has
near-flat logits, where a tie could break either way). Stop conditions are exercised by
declaring, through the generation config, a token the model actually emits as an EOS token.
"""

from __future__ import annotations

import pytest

from asyncrl.core.config import DataConfig
from asyncrl.evaluation.cli import main
from asyncrl.evaluation.evaluate import EvalError, _generate_engine, _generate_hf, _stop_token_ids, evaluate_problems
from asyncrl.tasks.tasks import load_task, render_prompt


@pytest.fixture(scope="module")
def sharp(tiny_model_dir, tmp_path_factory):
    """(model, tokenizer, model dir) of the tiny model with its matrices redrawn at std 0.2."""
    import torch

    from asyncrl.models import load_causal_lm, load_tokenizer
    from rollout_server.testing import make_random_model

    torch.set_num_threads(1)
    path = make_random_model(tiny_model_dir, tmp_path_factory.mktemp("sharp") / "model", seed=3)
    return load_causal_lm(path), load_tokenizer(path), path


@pytest.fixture(scope="module")
def problems():
    return load_task(DataConfig()).heldout(9)


def _prompts(tok, problems):
    return [render_prompt(tok, p.text, "Be brief.", "")[1] for p in problems]


def _expected(ref: list[int], stop: list[int]) -> tuple[list[int], bool]:
    """The reference continuation cut after its first stop token: ``(ids, truncated)``."""
    cut_at = next((i + 1 for i, t in enumerate(ref) if t in stop), None)
    return ref[: cut_at or len(ref)], cut_at is None


def test_greedy_tokens_identical_across_backends_and_reference(sharp, problems):
    from rollout_server.testing import greedy_reference

    model, tok, _ = sharp
    prompts = _prompts(tok, problems)
    stop = _stop_token_ids(model, tok)
    kw = dict(temperature=0.0, max_new_tokens=10, stop_ids=stop, seed=0)
    hf = _generate_hf(model, prompts, pad_id=stop[0], batch_size=4, **kw)  # left-padded, 3 batches
    engine = _generate_engine(model, tok, prompts, batch_size=4, **kw)  # slots refilled as rows finish
    for p, h, e in zip(prompts, hf, engine):
        want = _expected(greedy_reference(model, p, 10)[0], stop)
        assert h == want and e == want
    assert sum(len(ids) for ids, _ in engine) >= 5 * len(prompts)  # real continuations, not one token
    # and through the public function: identical responses and scores
    a: list = []
    b: list = []
    ra = evaluate_problems(model, tok, problems, system_prompt="Be brief.", temperature=0.0, max_new_tokens=10,
                           batch_size=4, samples=a, backend="hf")
    rb = evaluate_problems(model, tok, problems, system_prompt="Be brief.", temperature=0.0, max_new_tokens=10,
                           batch_size=2, samples=b)
    assert rb.backend == "engine" and ra.backend == "hf"
    assert a == b and (ra.correct, ra.format_compliance, ra.truncated) == (rb.correct, rb.format_compliance, rb.truncated)


def test_both_backends_stop_at_eos_tokens_from_the_generation_config(sharp, problems):
    """A token the model emits, declared EOS: both backends end there (token kept, not truncated)."""
    from rollout_server.testing import greedy_reference

    model, tok, _ = sharp
    prompts = _prompts(tok, problems)
    refs = [greedy_reference(model, p, 10)[0] for p in prompts]
    eos = refs[0][3]  # the 4th greedy token of problem 0
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [eos]
    try:
        stop = _stop_token_ids(model, tok)
        assert eos in stop and tok.eos_token_id in stop
        kw = dict(temperature=0.0, max_new_tokens=10, stop_ids=stop, seed=0)
        hf = _generate_hf(model, prompts, pad_id=tok.eos_token_id, batch_size=5, **kw)
        engine = _generate_engine(model, tok, prompts, batch_size=3, **kw)
        ended = 0
        for ref, h, e in zip(refs, hf, engine):
            want = _expected(ref, stop)
            assert h == want and e == want
            ended += not want[1]
        assert engine[0] == (refs[0][: refs[0].index(eos) + 1], False) and ended >= 1
        samples: list = []
        r = evaluate_problems(model, tok, problems, system_prompt="Be brief.", temperature=0.0, max_new_tokens=10,
                              samples=samples)
        assert r.truncated == len(problems) - ended and samples[0]["tokens"] == len(engine[0][0])
    finally:
        model.generation_config.eos_token_id = saved


def test_engine_sampling_is_reproducible_for_any_batch_size(sharp, problems):
    model, tok, _ = sharp
    runs = []
    for batch_size, seed in ((2, 5), (7, 5), (7, 6)):
        out: list = []
        r = evaluate_problems(model, tok, problems, system_prompt=None, temperature=1.0, max_new_tokens=8,
                              batch_size=batch_size, seed=seed, samples=out)
        assert r.mode == "sampled" and r.n == len(problems)
        runs.append([s["response"] for s in out])
    assert runs[0] == runs[1]  # per-problem seeds: batching does not change the draws
    assert runs[0] != runs[2]  # another seed does
    greedy: list = []
    evaluate_problems(model, tok, problems, system_prompt=None, temperature=0.0, max_new_tokens=8, samples=greedy)
    assert runs[0] != [s["response"] for s in greedy]  # T = 1 really samples


def test_server_backend_matches_the_in_process_engine(sharp, problems, tmp_path):
    """A real embedded server process over HTTP: the same greedy responses as in-process."""
    from rollout_server.testing import start_embedded_server

    model, tok, path = sharp
    srv = start_embedded_server(path, log_path=tmp_path / "server.log")
    try:
        local: list = []
        remote: list = []
        evaluate_problems(model, tok, problems, system_prompt="Be brief.", temperature=0.0, max_new_tokens=10,
                          samples=local)
        r = evaluate_problems(None, tok, problems, system_prompt="Be brief.", temperature=0.0, max_new_tokens=10,
                              batch_size=4, samples=remote, backend="server", server_url=srv.url)
        assert r.backend == "server" and remote == local
    finally:
        srv.stop()
    with pytest.raises(EvalError, match="failed"):  # the server is gone: a clear error, not a hang
        evaluate_problems(None, tok, problems[:2], system_prompt=None, temperature=0.0, max_new_tokens=4,
                          backend="server", server_url=srv.url)


def test_bad_arguments_are_refused(sharp, problems):
    model, tok, _ = sharp
    kw = dict(system_prompt=None, temperature=0.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="unknown evaluation backend 'vllm'"):
        evaluate_problems(model, tok, problems, backend="vllm", **kw)
    with pytest.raises(ValueError, match="server_url is required"):
        evaluate_problems(model, tok, problems, backend="server", **kw)
    with pytest.raises(ValueError, match="server_url is required"):
        evaluate_problems(model, tok, problems, server_url="http://127.0.0.1:1", **kw)
    with pytest.raises(ValueError, match="batch_size >= 1"):
        evaluate_problems(model, tok, problems, batch_size=0, **kw)


@pytest.mark.parametrize("argv, message", [
    (["--backend", "vllm"], "invalid choice"),
    (["--backend", "hf", "--server_url", "http://127.0.0.1:1"], "excludes --backend"),
    (["--server_url", "127.0.0.1:30000"], "must be an http(s) URL"),
])
def test_cli_refuses_bad_backend_flags(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_hf_and_engine_report_the_same_greedy_accuracy(sharp, capsys):
    import json

    _, _, path = sharp
    results = {}
    for backend in ("hf", "engine"):
        argv = ["--model", str(path), "--num_problems", "6", "--modes", "greedy", "--max_new_tokens", "6",
                "--threads", "1", "--json", "--backend", backend]
        assert main(argv) == 0
        (r,) = json.loads(capsys.readouterr().out)
        assert r["backend"] == backend and r["n"] == 6
        results[backend] = {k: r[k] for k in ("correct", "format_compliance", "mean_response_tokens", "truncated")}
    assert results["hf"] == results["engine"]


# ---- the trainer's step timers leave out the time it is stopped for evaluation ---------------


def test_run_clock_pause_intervals(tmp_path):
    from asyncrl.metrics.tracking import RunClock

    writer = RunClock.start(tmp_path)
    reader = RunClock(tmp_path)  # another process's view, through clock.json
    assert reader.paused_between(0.0, 1e9) == 0.0
    writer.add_pause(2.0, 100.0, 102.0)
    writer.add_pause(3.0, 110.0, 113.0)
    assert reader.paused_seconds == pytest.approx(5.0)
    assert reader.paused_between(101.0, 111.0) == pytest.approx(2.0)  # 1 s of each pause
    assert reader.paused_between(90.0, 120.0) == pytest.approx(5.0)
    assert reader.paused_between(103.0, 109.0) == 0.0
    writer.add_pause(1.0)  # a total without an interval (older callers) still shifts the wall clock
    assert reader.paused_seconds == pytest.approx(6.0) and reader.paused_between(90.0, 120.0) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="both"):
        writer.add_pause(1.0, 5.0)
    with pytest.raises(ValueError, match="before it starts"):
        writer.add_pause(1.0, 5.0, 4.0)
    for i in range(RunClock.MAX_INTERVALS + 5):
        writer.add_pause(0.0, 200.0 + i, 200.0 + i)
    assert len(RunClock(tmp_path)._intervals) == RunClock.MAX_INTERVALS


PHASE_CHILD = """
import json, sys, time
from asyncrl.metrics.tracking import RunClock
from trainer.loop import PhaseTimer

timer = PhaseTimer(None, RunClock(sys.argv[1]))
with timer.phase("optim_step"):
    print("in phase", flush=True)
    sys.stdin.readline()  # waits (wall time that is not CPU time) until the test writes a line
print(json.dumps({"seconds": timer.seconds["optim_step"], "stopped": timer.stopped_seconds}), flush=True)
"""


def test_phase_timer_subtracts_a_real_sigstop(tmp_path):
    """SIGSTOP/SIGCONT of a real process, the pause recorded as the controller records it."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from asyncrl.controller.controller import resume_roles
    from asyncrl.metrics.tracking import RunClock

    clock = RunClock.start(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", PHASE_CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "in phase"
        t0 = time.monotonic()
        time.sleep(0.5)  # 0.5 s of real phase time
        start = time.monotonic()
        child.send_signal(signal.SIGSTOP)
        time.sleep(2.0)  # stopped: not phase time
        paused = resume_roles(None, clock, start)  # records the interval, then (here by hand) SIGCONT
        child.send_signal(signal.SIGCONT)
        time.sleep(0.5)  # 0.5 s more of real phase time
        child.stdin.write("go\n")
        child.stdin.flush()
        r = json.loads(child.stdout.readline())
        total = time.monotonic() - t0
    finally:
        child.kill()
        child.wait()
    assert paused == pytest.approx(2.0, abs=0.2) and r["stopped"] == pytest.approx(paused, abs=1e-6)
    assert 0.9 <= r["seconds"] <= total - paused + 0.2  # about 1 s of the ~3 s the phase spanned
