"""The reward-model role (issue #16 item 3): ``asyncrl reward-model`` over real HTTP, its client, its scaling.

A tiny random ``LlamaForSequenceClassification`` (``tiny_reward_model_dir``) is served by the
real ``asyncrl reward-model`` process; its answers are compared with a direct forward pass of
the same model. The failure paths use real sockets: a port nobody listens on, a TCP server
that accepts and never answers, a server that is draining. The worker test runs a real
embedded rollout server, a real redis-server and the real rollout worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from asyncrl.core.config import ConfigError, load_config
from asyncrl.core.net import free_port
from asyncrl.reward_model import RewardModelClient, RewardModelError, scale_score
from asyncrl.tasks.rewards import RewardScorer
from asyncrl.core.types import PromptGroup, SampleStatus
from buffers import BufferSettings, ReplayBuffer

REPO = Path(__file__).resolve().parent.parent
KEY = "rm-test-key-0123456789"


# ------------------------------------------------------------------------------------------------
# the formula and the config


def test_scale_score_is_areal_clip_of_bias_then_scaling():
    # AReaL: CLIP((x - bias) * scaling, -max_reward_clip, max_reward_clip)
    assert scale_score(3.0, scaling=2.0, bias=1.0, clip=20.0) == 4.0
    assert scale_score(-1.5, scaling=0.5, bias=0.5, clip=20.0) == -1.0
    assert scale_score(100.0, scaling=1.0, bias=0.0, clip=20.0) == 20.0
    assert scale_score(-100.0, scaling=3.0, bias=10.0, clip=5.0) == -5.0
    # bias before scaling, not after: (2 - 1) * 3 = 3, not 2 * 3 - 1 = 5
    assert scale_score(2.0, scaling=3.0, bias=1.0, clip=20.0) == 3.0
    with pytest.raises(ValueError, match="not finite"):
        scale_score(float("nan"))


def test_reward_model_config_defaults_bounds_and_rules():
    cfg = load_config([])
    rm = cfg.reward.model
    assert not rm.enabled and rm.combine == "replace" and rm.max_reward_clip == 20.0 and rm.output_scaling == 1.0
    cfg = load_config(["--reward.model.path", "/m", "--reward.model.host", "0.0.0.0", "--reward.model.port", "31000"])
    assert cfg.reward.model.enabled and cfg.reward.model.server_url == "http://127.0.0.1:31000"
    assert load_config(["--reward.model.url", "http://rm.svc:30500/"]).reward.model.server_url == "http://rm.svc:30500"
    for bad, field in ((["--reward.model.combine", "mul"], "combine"), (["--reward.model.output_scaling", "0"], "output_scaling"),
                       (["--reward.model.max_reward_clip", "-1"], "max_reward_clip"),
                       (["--reward.model.max_texts_per_request", "0"], "max_texts_per_request"),
                       (["--reward.model.url", "rm:30500"], "url"), (["--reward.model.api_key_required", "true"], "api_key")):
        with pytest.raises(ConfigError, match=field):
            load_config(bad)
    assert load_config(["--reward.model.api_key_required", "true", "--security.api_key", "k"]).reward.model.api_key_required


def test_score_request_schema_is_bounded():
    from pydantic import ValidationError

    from asyncrl.reward_model.server import score_request_model

    schema = score_request_model(max_texts=3, max_chars=5)
    assert schema.model_validate_json('{"texts": ["a", "bcdef"]}').texts == ["a", "bcdef"]
    for body in ('{"texts": []}', '{"texts": ["a", "b", "c", "d"]}', '{"texts": ["abcdef"]}', '{"texts": [1]}',
                 '{"texts": "abc"}', '{"texts": ["a"], "extra": 1}', '{}', '[]', 'not json'):
        with pytest.raises(ValidationError):
            schema.model_validate_json(body)


async def test_dynamic_batcher_gathers_requests_and_isolates_a_failing_text():
    """The batcher alone, with a plain scoring function (text length; raises on "bad"): concurrent
    requests share forward passes of at most max_batch_size texts; a batch holding a bad text is
    retried text by text, so only the bad text's request fails; wait_idle reports a drain that
    does not finish in time."""
    from asyncrl.reward_model.server import DynamicBatcher

    calls: list[list[str]] = []
    gate = threading.Event()
    gate.set()

    def score_batch(texts: list[str]) -> list[float]:
        gate.wait()
        calls.append(list(texts))
        if "bad" in texts:
            raise ValueError("cannot score 'bad'")
        return [float(len(t)) for t in texts]

    b = DynamicBatcher(score_batch, max_batch_size=4, batch_wait_seconds=0.2)
    b.start()
    try:
        got = await asyncio.gather(*(b.score(["x" * i]) for i in range(1, 7)))
        assert got == [[float(i)] for i in range(1, 7)]
        assert [len(c) for c in calls] == [4, 2], calls  # 6 concurrent texts: two passes, not six
        calls.clear()
        results = await asyncio.gather(b.score(["ok", "fine"]), b.score(["bad"]), b.score(["good"]), return_exceptions=True)
        assert results[0] == [2.0, 4.0] and results[2] == [4.0]
        assert isinstance(results[1], ValueError) and "bad" in str(results[1])
        assert calls[0] == ["ok", "fine", "bad", "good"] and sorted(map(tuple, calls[1:])) == [("bad",), ("fine",), ("good",), ("ok",)]
        gate.clear()  # a forward pass that hangs: the drain gives up after its timeout
        pending = asyncio.ensure_future(b.score(["slow"]))
        assert await b.wait_idle(0.5) is False and b.pending == 1
        gate.set()
        assert await pending == [4.0] and await b.wait_idle(1.0) is True and b.pending == 0
    finally:
        gate.set()
        await b.close()


# ------------------------------------------------------------------------------------------------
# the server process over real HTTP


class RMProcess:
    """A running ``asyncrl reward-model`` child process."""

    def __init__(self, model_dir: Path, log: Path, *flags: str, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env.pop("ASYNCRL_SECURITY__API_KEY", None)
        if api_key:
            env["ASYNCRL_SECURITY__API_KEY"] = api_key  # the secret travels in the environment, never argv
            flags = (*flags, "--reward.model.api_key_required", "true")
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "reward-model", "--reward.model.path", str(model_dir),
             "--reward.model.port", str(self.port), "--reward.model.threads", "1", *flags],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(time.monotonic() + 120)
        except BaseException:  # never leave the process behind a failed start
            self.proc.kill()
            self.proc.wait()
            raise

    def _wait_ready(self, deadline: float) -> None:
        while True:
            assert self.proc.poll() is None, f"reward-model exited {self.proc.returncode}:\n{self.log.read_text()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def rm_server(tiny_reward_model_dir, tmp_path_factory):
    """The reward model served with an API key, batches of up to 8 texts, 40 ms batching window, 48 tokens max."""
    srv = RMProcess(tiny_reward_model_dir, tmp_path_factory.mktemp("rm") / "rm.log", "--reward.model.max_batch_size", "8",
                    "--reward.model.batch_wait_ms", "40", "--reward.model.max_length", "48",
                    "--reward.model.max_texts_per_request", "16", "--reward.model.max_chars", "4000", api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def direct(tiny_reward_model_dir):
    """The reward model loaded in this process: ``direct(text, max_length)`` is one unbatched forward pass."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir, dtype=torch.float32).eval()

    def score(text: str, max_length: int = 48) -> float:
        ids = tok(text, add_special_tokens=False)["input_ids"][-max_length:]
        with torch.inference_mode():
            return float(model(input_ids=torch.tensor([ids])).logits[0, 0])

    return score


TEXTS = ["<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\nAnswer: 5",
         "a", "the quick brown fox " * 10,  # longer than max_length = 48 tokens: its last 48 are scored
         "Answer: 7", "12345 + 678 = 13023"]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{"))


def test_server_scores_batches_equal_to_a_direct_forward_pass(rm_server, direct):
    client = RewardModelClient(rm_server.url, api_key=KEY, timeout_seconds=30)
    try:
        scores = client.score_texts(TEXTS)
        assert len(scores) == len(TEXTS)
        for text, got in zip(TEXTS, scores):
            assert got == pytest.approx(direct(text), abs=1e-5), text[:30]
        assert len(set(round(s, 6) for s in scores)) == len(TEXTS), "a random model gives different texts different scores"
        # the same texts as concurrent one-text requests, gathered into shared forward passes
        batches_before = _metric(rm_server.url, "asyncrl_reward_model_batch_size_count")
        results: dict[int, float] = {}

        def one(i: int) -> None:
            results[i] = client.score_texts([TEXTS[i % len(TEXTS)]])[0]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(results) == list(range(10))
        for i, got in results.items():
            assert got == pytest.approx(scores[i % len(TEXTS)], abs=1e-5)
        batches = _metric(rm_server.url, "asyncrl_reward_model_batch_size_count") - batches_before
        assert batches < 10, f"10 concurrent requests ran in {batches} forward passes: nothing was batched"
        assert _metric(rm_server.url, 'asyncrl_reward_model_requests_total{result="ok"}') >= 11
    finally:
        client.close()


def test_server_checks_auth_and_bounds_and_one_bad_request_touches_no_other(rm_server):
    assert httpx.get(rm_server.url + "/health").json() == {"status": "ok"}  # open
    assert "asyncrl_reward_model_texts_total" in httpx.get(rm_server.url + "/metrics").text  # open
    r = httpx.post(rm_server.url + "/score", json={"texts": ["a"]})
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    r = httpx.post(rm_server.url + "/score", json={"texts": ["a"]}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    for body, needle in (({"texts": []}, "texts"), ({"texts": ["x"] * 17}, "16 texts"), ({"texts": ["x" * 4001]}, "4000"),
                         ({"texts": [3]}, "texts.0"), ({"text": ["a"]}, "text"), ([1, 2], "texts")):
        r = httpx.post(rm_server.url + "/score", json=body, headers=auth)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(rm_server.url + "/score", content=b"{not json", headers=auth)
    assert r.status_code == 400
    r = httpx.post(rm_server.url + "/score", content=b'{"texts": ["' + b"x" * 600_000 + b'"]}', headers=auth)
    assert r.status_code == 400 and "too large" in r.json()["error"]["message"]
    assert httpx.post(rm_server.url + "/score", json={"texts": ["a"]}, headers={"x-api-key": KEY}).status_code == 200
    assert _metric(rm_server.url, 'asyncrl_reward_model_requests_total{result="bad_request"}') >= 8
    assert _metric(rm_server.url, 'asyncrl_reward_model_requests_total{result="unauthorized"}') >= 2
    log = rm_server.log.read_text()
    assert KEY not in log and KEY not in " ".join(rm_server.proc.args)


def _cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def test_server_refuses_compressed_bodies_before_auth_and_never_inflates_them(rm_server):
    """The shared guards of asyncrl's servers (asyncrl.core.net, issue #31 items 2 and 3), as the
    rollout server and the sessions app have them (tests/test_probe_suite.py): a ``Content-Encoding``
    is a 415 naming it before auth and before the body is read, a deflate bomb (64 MB of zeros) costs
    the server no CPU after its answer (no lingering read, no inflation), a non-ASCII bearer is a
    400 naming the header. Before: a gzipped body with the key was inflated and scored (200), the
    bomb was inflated after its 401, and the bearer was a 500."""
    import gzip
    import zlib

    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(rm_server.url + "/score", content=gzip.compress(json.dumps({"texts": ["a"]}).encode()),
                   headers={**auth, "Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert r.status_code == 415 and "Content-Encoding" in r.json()["error"]["message"], r.text
    zeros = b"\0" * (64 << 20)
    probes = [(zlib.compress(zeros, 9), "deflate", {}), (gzip.compress(zeros, 9), "gzip", auth)]
    del zeros
    statuses = []
    for data, enc, headers in probes:
        cpu0 = _cpu_seconds(rm_server.proc.pid)
        try:
            r = httpx.post(rm_server.url + "/score", content=data, headers={**headers, "Content-Encoding": enc}, timeout=30)
            statuses.append(r.status_code)
            assert r.status_code == 415 and "Content-Encoding" in r.json()["error"]["message"], (enc, r.text)
        except httpx.TransportError:  # the server may close before the body is sent: refused all the same
            statuses.append(-1)
        time.sleep(0.2)  # a lingering inflation (the bug) would burn CPU after the answer
        cpu = _cpu_seconds(rm_server.proc.pid) - cpu0
        assert cpu < 0.15, f"{enc}: the reward-model server used {cpu:.2f} s of CPU on a refused compressed body"
    assert 415 in statuses, statuses
    for headers, name in (({"Authorization": b"Bearer \xff\xfe".decode("latin-1")}, "Authorization"),
                          ({"x-api-key": b"\xff".decode("latin-1")}, "x-api-key")):
        r = httpx.post(rm_server.url + "/score", content=b'{"texts": ["a"]}',
                       headers={"Content-Type": "application/json", **{k: v.encode("latin-1") for k, v in headers.items()}})
        assert r.status_code == 400 and name in r.json()["error"]["message"], r.text
    r = httpx.post(rm_server.url + "/score", json={"texts": ["a"]}, headers={**auth, "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text
    assert httpx.get(rm_server.url + "/health").status_code == 200


@pytest.mark.slow  # a second server process: ~25 s on 2 busy cores
def test_sigterm_drains_queued_requests_then_refuses_new_ones(tiny_reward_model_dir, tmp_path, direct):
    """Requests queued when SIGTERM arrives are scored and answered; one sent during the drain gets
    503 (a RewardModelError for the worker); the process exits 0 and says how many it answered."""
    srv = RMProcess(tiny_reward_model_dir, tmp_path / "rm.log", "--reward.model.batch_wait_ms", "800",
                    "--reward.model.max_batch_size", "64", "--reward.model.max_length", "48")
    client = RewardModelClient(srv.url, timeout_seconds=30)
    try:
        answers: dict[int, object] = {}

        def one(i: int) -> None:
            try:
                answers[i] = client.score_texts([TEXTS[i % len(TEXTS)]])[0]
            except RewardModelError as exc:
                answers[i] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while _metric(srv.url, "asyncrl_reward_model_queue_texts") < 6:  # all six wait in the 800 ms window
            assert time.monotonic() < deadline
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises(RewardModelError, match="HTTP 503: .*draining"):
            client.score_texts(["late"])
        for t in threads:
            t.join(30)
        assert srv.proc.wait(30) == 0
        for i in range(6):
            assert answers[i] == pytest.approx(direct(TEXTS[i % len(TEXTS)]), abs=1e-5), answers[i]
        assert "drained: 6 requests answered after the stop signal" in srv.log.read_text()
    finally:
        client.close()
        srv.stop()


def test_role_refuses_a_config_without_a_model_or_a_bad_label(tiny_reward_model_dir, tiny_model_dir):
    from asyncrl.reward_model.server import RewardModelOptions, RewardModelServer

    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "reward-model"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "reward.model.path is not set" in r.stderr
    with pytest.raises(ValueError, match=r"label_index=3 but the model has 1 output label"):
        RewardModelServer(RewardModelOptions(str(tiny_reward_model_dir), label_index=3)).load()
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device=cuda but no GPU is visible"):
            RewardModelServer(RewardModelOptions(str(tiny_reward_model_dir), device="cuda")).load()
    from asyncrl.reward_model.server import load_reward_model

    with pytest.raises(ValueError, match="cannot load it as a sequence-classification model"):
        load_reward_model(str(REPO / "configs"))  # no model there
    with pytest.raises(ValueError, match=r"no weights for \['score.weight'\]: it is not a trained"):
        load_reward_model(str(tiny_model_dir))  # a causal LM: its score head would be random


# ------------------------------------------------------------------------------------------------
# the scorer: combine modes and failures


META = {"task": "arithmetic", "gold": "5", "problem_hash": "0"}


def test_scorer_replace_and_add(rm_server, direct):
    prompt, response = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n", "Answer: 5"
    raw = direct(prompt + response)
    cfg = load_config(["--reward.model.url", rm_server.url, "--reward.model.output_scaling", "50",
                       "--reward.model.output_bias", "0.01", "--reward.model.max_reward_clip", "3",
                       "--reward.model.api_key_required", "true", "--security.api_key", KEY])
    replace = RewardScorer.from_config(cfg.data, cfg.reward, cfg.security.api_key)
    cfg.reward.model.combine = "add"
    add = RewardScorer.from_config(cfg.data, cfg.reward, cfg.security.api_key)
    try:
        term = max(-3.0, min(3.0, (raw - 0.01) * 50))
        r = replace.score(prompt, response, META)
        assert not r.failed and r.reward == pytest.approx(term, abs=1e-3) and r.correct is None and r.format == 1.0
        r = add.score(prompt, response, META)  # math_verify says correct (1.0) + the term
        assert not r.failed and r.correct == 1.0 and r.reward == pytest.approx(1.0 + term, abs=1e-3)
        r = add.score(prompt, "Answer: 6", META)
        assert r.correct == 0.0 and r.reward == pytest.approx(scale_score(direct(prompt + "Answer: 6"), 50, 0.01, 3), abs=1e-3)
    finally:
        replace.close()
        add.close()


@pytest.fixture
def silent_server():
    """A real TCP server that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    conns = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(sock.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    t.join()
    for c in conns:
        c.close()
    sock.close()


def test_reward_model_failures_fail_the_sample_with_their_own_error(rm_server, silent_server):
    unreachable = RewardScorer(reward_model=RewardModelClient(f"http://127.0.0.1:{free_port()}", timeout_seconds=5))
    r = unreachable.score("p", "Answer: 5", META)
    assert r.failed and r.reward == 0.0 and r.error.startswith("RewardModelError: ") and "unreachable" in r.error
    slow = RewardScorer(reward_model=RewardModelClient(silent_server, timeout_seconds=0.5))
    start = time.monotonic()
    r = slow.score("p", "Answer: 5", META)
    assert time.monotonic() - start < 5
    assert r.error.startswith("RewardModelError: ") and "reward.model.timeout_seconds=0.5" in r.error
    no_key = RewardScorer(reward_model=RewardModelClient(rm_server.url, timeout_seconds=5), combine="add")
    r = no_key.score("p", "Answer: 5", META)
    assert r.error.startswith("RewardModelError: ") and "HTTP 401" in r.error
    with pytest.raises(Exception, match="combine"):
        RewardScorer(combine="multiply")
    for s in (unreachable, slow, no_key):
        s.close()


async def test_buffer_counts_reward_model_failures_on_their_own(redis_url):
    settings = BufferSettings(rollout_batch_size=2, train_batch_groups=1, n_samples_per_prompt=2, max_budget=8,
                              max_response_len=16, max_staleness=1, lease_seconds=30.0)
    async with await ReplayBuffer.open(redis_url, "rmf", settings) as buf:
        await buf.feed([buf.make_group(g, [1, 2, 3], {}) for g in ("a", "b")], await buf.dataset_cursor())
        items = await buf.claim("w", 4)
        for it in items:
            await buf.end_segment(it, "stop", [11, 12], [-0.1, -0.2], [0, 0])
        for it, err in zip(items, ("RewardModelError: reward model at http://x unreachable", "RewardModelError: HTTP 503",
                                   "RewardTimeout: slow", "ValueError: nope")):
            await buf.score(it, error=err)
        counters = (await buf.stats())["counters"]
    assert counters["failed_samples"] == 4 and counters["failed_samples:reward_model"] == 2
    assert counters["failed_samples:reward_timeout"] == 1 and counters["failed_samples:reward_error"] == 1


# ------------------------------------------------------------------------------------------------
# the rollout worker scoring with the reward model


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from rollout_server.testing import make_random_model, start_embedded_server

    srv = start_embedded_server(make_random_model(tiny_model_dir, tmp_path_factory.mktemp("rmw") / "m", seed=5),
                                "--weight-version", "0")
    yield srv
    srv.stop()


async def _run_worker(buf, engine, scorer, tokenizer, until) -> tuple[object, dict]:
    from rollout_server.client import EngineClient
    from rollout_server.worker import RolloutWorker, WorkerOptions

    worker = RolloutWorker(buf, EngineClient(engine.url), scorer, tokenizer,
                           WorkerOptions("w-rm", temperature=1.0, max_inflight_requests=8, version_poll_seconds=0.1))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    start = time.monotonic()
    try:
        while True:
            st = await buf.stats()
            if until(st):
                break
            assert not task.done(), task.result()
            assert time.monotonic() - start < 60, st
            await asyncio.sleep(0.1)
    finally:
        stop.set()
    stats = await task
    await worker.client.close()
    return stats, st


@pytest.mark.integration
async def test_worker_scores_samples_with_the_reward_model(redis_url, engine, rm_server, tiny_model_dir, direct):
    """Samples generated by a real engine are scored by the reward-model process: each sample's
    reward is the scaled score of its decoded prompt + response, computed here independently."""
    from asyncrl.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    settings = BufferSettings(rollout_batch_size=2, train_batch_groups=2, n_samples_per_prompt=3, max_budget=12,
                              max_response_len=12, max_staleness=1, lease_seconds=10.0, flush_tokens=4)
    cfg = load_config(["--reward.model.url", rm_server.url, "--reward.model.output_scaling", "10",
                       "--reward.model.api_key_required", "true", "--security.api_key", KEY,
                       "--data.reward", "format"])
    scorer = RewardScorer.from_config(cfg.data, cfg.reward, cfg.security.api_key)
    async with await ReplayBuffer.open(redis_url, "rm-worker", settings) as buf:
        chat = tok.apply_chat_template([{"role": "user", "content": "two plus two"}], add_generation_prompt=True, tokenize=False)
        prompt = list(tok(chat, add_special_tokens=False)["input_ids"])
        await buf.feed([PromptGroup(g, prompt, {}, 3) for g in ("g1", "g2")], await buf.dataset_cursor())
        stats, st = await _run_worker(buf, engine, scorer, tok, lambda s: s["groups_by_state"].get("ready", 0) == 2)
        scorer.close()
        assert stats.reward_errors == 0 and "failed_samples" not in st["counters"]
        text_prompt = tok.decode(prompt, skip_special_tokens=False)
        for g in ("g1", "g2"):
            _, samples = await buf.get_group(g)
            assert [s.status for s in samples] == [SampleStatus.SCORED] * 3
            for s in samples:
                want = scale_score(direct(text_prompt + tok.decode(s.response_ids, skip_special_tokens=True)), 10.0, 0.0, 20.0)
                assert s.reward == pytest.approx(want, abs=1e-3)


@pytest.mark.integration
async def test_worker_fails_samples_when_the_reward_model_is_down(redis_url, engine, tiny_model_dir):
    from asyncrl.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    settings = BufferSettings(rollout_batch_size=1, train_batch_groups=1, n_samples_per_prompt=2, max_budget=6,
                              max_response_len=6, max_staleness=1, lease_seconds=10.0, flush_tokens=3)
    scorer = RewardScorer("format", reward_model=RewardModelClient(f"http://127.0.0.1:{free_port()}", timeout_seconds=2))
    async with await ReplayBuffer.open(redis_url, "rm-down", settings) as buf:
        await buf.feed([PromptGroup("g", list(tok("two plus two")["input_ids"]), {}, 2)], await buf.dataset_cursor())
        stats, st = await _run_worker(buf, engine, scorer, tok, lambda s: s["dropped_by_reason"].get("reward_error") == 1)
        scorer.close()
        assert st["counters"]["failed_samples:reward_model"] == 2 and stats.reward_errors == 2
        assert "failed_samples:reward_error" not in st["counters"]
        assert await buf.dropped_groups() == {"g": "reward_error"}  # < 2 samples scored: the group is dropped


# ------------------------------------------------------------------------------------------------
# asyncrl train: the role is launched and supervised when reward.model.path is set


def test_train_launches_the_reward_model_role_and_tells_every_role_its_port(tmp_path):
    from asyncrl.controller.resources import assign_resources
    from asyncrl.controller.roles import child_env, role_specs

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        cfg = load_config(["--reward.model.path", "/models/rm", "--reward.model.port", str(port), "--rollout.base_port", "0"])
        env = child_env(cfg, "redis://127.0.0.1:1/0", tmp_path)
        specs, _ = role_specs(cfg, tmp_path / "c.yaml", env, assign_resources(cfg, [0, 1]))
    finally:
        busy.close()
    by_name = {s.name: s for s in specs}
    rm = by_name["reward-model"]
    assert rm.argv[-3:] == ["reward-model", "--config", str(tmp_path / "c.yaml")]
    moved = rm.env["ASYNCRL_REWARD__MODEL__PORT"]
    assert int(moved) != port and by_name["rollout-0"].env["ASYNCRL_REWARD__MODEL__PORT"] == moved
    assert rm.restart and rm.fatal_exit_codes == (2,)
    assert rm.stop_order > by_name["rollout-0"].stop_order, "the reward model outlives the rollout servers' drain"
    assert rm.cores == by_name["rollout-0"].cores
    assert "reward-model" not in {s.name for s in role_specs(load_config([]), tmp_path / "c.yaml",
                                                             child_env(load_config([]), "redis://x:1/0", tmp_path),
                                                             assign_resources(load_config([]), [0, 1]))[0]}
    attached = load_config(["--reward.model.path", "/m", "--reward.model.url", "http://rm:30500"])
    names = {s.name for s in role_specs(attached, tmp_path / "c.yaml", child_env(attached, "redis://x:1/0", tmp_path),
                                        assign_resources(attached, [0, 1]))[0]}
    assert "reward-model" not in names


def test_main_configs_keep_rule_based_rewards():
    for name in ("tiny.yaml", "smollm2_arith.yaml", "smollm2_arith_ppo.yaml"):
        cfg = load_config(["--config", str(REPO / "configs" / name)])
        assert not cfg.reward.model.enabled, name


def test_json_answer_shape(rm_server):
    r = httpx.post(rm_server.url + "/score", json={"texts": ["a", "b"]}, headers={"Authorization": f"Bearer {KEY}"})
    body = json.loads(r.text)
    assert r.status_code == 200 and set(body) == {"scores", "model"} and len(body["scores"]) == 2


@pytest.mark.slow
@pytest.mark.integration
def test_asyncrl_train_with_the_reward_model(tmp_path, tiny_model_dir, tiny_reward_model_dir):
    """``asyncrl train`` on the tiny config with ``reward.model.path``: the controller launches and
    supervises the reward-model process, the rollout workers score with it (rewards are the model's
    scaled scores, not the rule reward's zeros), and the run stops it cleanly (drained, exit 0)."""
    from asyncrl.metrics.tracking import read_metrics

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "train", "--config", str(REPO / "configs" / "tiny.yaml"),
         "--output_dir", str(tmp_path), "--model_path", str(tiny_model_dir), "--total_steps", "2",
         "--rollout.base_port", str(free_port()), "--monitoring.progress", "false",
         "--reward.model.path", str(tiny_reward_model_dir), "--reward.model.port", "0",
         "--reward.model.output_scaling", "100", "--reward.model.max_reward_clip", "5"],
        env=env, capture_output=True, text=True, timeout=600)
    run_dir = tmp_path / "tiny"
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert proc.returncode == 0, proc.stderr[-3000:] + "\n".join(f"--- {k}\n{v[-2000:]}" for k, v in logs.items())
    rm_log = logs["reward-model.log"]
    assert "serving" in rm_log and "drained:" in rm_log, rm_log[-2000:]
    assert "waiting for the reward model" in logs["rollout-0.log"]
    rewards = [r["reward/mean"] for r in read_metrics(run_dir) if r["role"] == "trainer" and "reward/mean" in r]
    assert len(rewards) == 2 and any(abs(r) > 1e-3 for r in rewards), rewards  # the rule reward of a random model is 0
    assert json.loads((run_dir / "run_state.json").read_text())["status"] == "finished"
