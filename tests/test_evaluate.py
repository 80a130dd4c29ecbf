"""Held-out evaluation: Wilson intervals, batched generation with the tiny model, the `asyncrl eval` CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.core.config import ArithmeticConfig, DataConfig
from asyncrl.evaluation.cli import main
from asyncrl.evaluation.evaluate import evaluate, evaluate_problems, wilson_interval
from asyncrl.tasks.base import Problem
from asyncrl.tasks.tasks import load_task


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(10, 10)
    assert lo == pytest.approx(0.7225, abs=1e-4) and hi == pytest.approx(1.0)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(120, 400)
    assert lo < 0.3 < hi and hi - lo < 0.1


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    import torch

    from asyncrl.models import load_causal_lm, load_tokenizer

    torch.set_num_threads(1)
    return load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_evaluate_problems_greedy_and_sampled(tiny):
    model, tok = tiny
    problems = load_task(DataConfig()).heldout(6)
    samples: list = []
    greedy = evaluate_problems(model, tok, problems, system_prompt="Be brief.", temperature=0.0,
                               max_new_tokens=6, batch_size=4, samples=samples)
    assert greedy.mode == "greedy" and greedy.n == 6 and len(samples) == 6
    assert 0 <= greedy.correct <= 6 and greedy.accuracy == greedy.correct / 6
    assert greedy.accuracy_ci_low <= greedy.accuracy <= greedy.accuracy_ci_high
    assert greedy.format_ci_low <= greedy.format_compliance <= greedy.format_ci_high
    assert 0 < greedy.mean_response_tokens <= 6 and 0 <= greedy.truncated <= 6
    assert [s["problem"] for s in samples] == [p.text for p in problems]
    assert all(s["tokens"] <= 6 for s in samples)
    # Greedy is deterministic; so is sampling for a fixed seed and batch size.
    again: list = []
    evaluate_problems(model, tok, problems, system_prompt="Be brief.", temperature=0.0,
                      max_new_tokens=6, batch_size=4, samples=again)
    assert [s["response"] for s in again] == [s["response"] for s in samples]
    s1: list = []
    s2: list = []
    for out in (s1, s2):
        r = evaluate_problems(model, tok, problems, system_prompt=None, temperature=1.0, max_new_tokens=6,
                              batch_size=3, seed=7, samples=out)
    assert r.mode == "sampled" and r.temperature == 1.0
    assert [s["response"] for s in s1] == [s["response"] for s in s2]


def test_scoring_counts_correct_answers(tiny):
    """Golds set to what the model answered: the counts match check_answer on the same responses."""
    from asyncrl.tasks.rewards import check_answer

    model, tok = tiny
    base = load_task(DataConfig()).heldout(8)
    first: list = []
    evaluate_problems(model, tok, base, system_prompt=None, temperature=0.0, max_new_tokens=8, samples=first)
    golds = [s["extracted"] or "31337" for s in first]
    out: list = []
    r = evaluate_problems(model, tok, [Problem(p.text, g, {}) for p, g in zip(base, golds)], system_prompt=None,
                          temperature=0.0, max_new_tokens=8, samples=out)
    assert [s["response"] for s in out] == [s["response"] for s in first]
    assert r.correct == sum(check_answer(s["response"], g).correct for s, g in zip(out, golds))
    assert r.correct == sum(s["correct"] for s in out)
    assert r.format_compliance == sum(s["format_ok"] for s in out) / 8


def test_response_prefix_is_prompted_and_checked(tiny):
    """With a prefill, the prompt ends with it and the answer is checked on prefix + generation."""
    from asyncrl.tasks.rewards import check_answer

    model, tok = tiny
    problems = load_task(DataConfig()).heldout(4)
    out: list = []
    evaluate_problems(model, tok, problems, system_prompt=None, temperature=0.0, max_new_tokens=5,
                      response_prefix="Answer: {expression} =", samples=out)
    for p, s in zip(problems, out):
        assert s["response"].startswith(f"Answer: {p.metadata['expression']} =")
        assert s["correct"] == check_answer(s["response"], p.gold).correct
    # The generation is conditioned on the prefill: it differs from the unprefixed run's.
    plain: list = []
    evaluate_problems(model, tok, problems, system_prompt=None, temperature=0.0, max_new_tokens=5, samples=plain)
    assert [s["response"] for s in plain] != [s["response"] for s in out]


def test_evaluate_problems_rejects_bad_arguments(tiny):
    model, tok = tiny
    p = load_task(DataConfig()).heldout(1)
    for kwargs in ({"temperature": -1.0, "max_new_tokens": 4}, {"temperature": 0.0, "max_new_tokens": 0}):
        with pytest.raises(ValueError):
            evaluate_problems(model, tok, p, system_prompt=None, **kwargs)
    with pytest.raises(ValueError):
        evaluate_problems(model, tok, [], system_prompt=None, temperature=0.0, max_new_tokens=4)


def test_evaluate_from_a_model_directory(tiny_model_dir):
    results = evaluate(tiny_model_dir, DataConfig(), num_problems=4, temperatures=(0.0, 1.0),
                       max_new_tokens=4, batch_size=4, threads=1)
    assert [r.mode for r in results] == ["greedy", "sampled"]
    assert all(r.n == 4 and r.model == str(tiny_model_dir) for r in results)


def test_cli_json_and_samples(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "samples.jsonl"
    rc = main(["--model", str(tiny_model_dir), "--task", "arithmetic", "--num_problems", "3",
               "--max_new_tokens", "4", "--threads", "1", "--json", "--samples_out", str(out),
               "--data.arithmetic.digits", "3"])
    assert rc == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in results] == ["greedy", "sampled"]
    assert all(r["n"] == 3 and r["max_new_tokens"] == 4 for r in results)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and {"problem", "gold", "response", "correct", "format_ok"} <= set(rows[0])
    held = load_task(DataConfig(arithmetic=ArithmeticConfig(digits=3))).heldout(3)
    assert [r["problem"] for r in rows[:3]] == [p.text for p in held]


def test_cli_text_output_greedy_only(tiny_model_dir, capsys):
    rc = main(["--model", str(tiny_model_dir), "--num_problems", "2", "--modes", "greedy",
               "--max_new_tokens", "3", "--threads", "1"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "greedy" in text and "sampled" not in text and "n=2" in text and "format compliance" in text


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["--modes", "fast"], 2, "--modes"),
        (["--temperature", "0"], 2, "--temperature must be > 0"),
        (["--num_problems", "0"], 2, ">= 1"),
        (["--max_new_tokens", "0"], 2, "--max_new_tokens"),
        (["--task", "chess"], 2, "invalid choice"),
        (["--no_such_field", "1"], 2, "unknown flag"),
        (["--model", "/nonexistent/model/dir", "--num_problems", "1"], 1, "does not exist"),
        (["--model", "no-such-model-name", "--num_problems", "1"], 1, "no model"),
    ],
)
def test_cli_errors(argv, code, message, capsys):
    assert main(argv) == code
    assert message in capsys.readouterr().err


def test_cli_too_many_problems_for_the_task(tiny_model_dir, capsys):
    rc = main(["--model", str(tiny_model_dir), "--num_problems", "50", "--data.arithmetic.digits", "1",
               "--data.arithmetic.operators", "+", "--data.arithmetic.n_terms", "2"])
    assert rc == 1
    assert "distinct held-out problems" in capsys.readouterr().err


def test_cli_help_through_the_console_script():
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "eval", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--num_problems" in out.stdout and "Wilson" in out.stdout


@pytest.mark.slow
def test_smollm2_base_model_eval_small():
    """SmolLM2-135M-Instruct (prepared from the shipped GGUF) answers some easy held-out problems."""
    from asyncrl.models import prepare_model

    prepare_model("smollm2-135m-instruct")
    data = DataConfig(arithmetic=ArithmeticConfig(digits=1, operators="+", n_terms=4))
    samples: list = []
    (r,) = evaluate("smollm2-135m-instruct", data, num_problems=16, temperatures=(0.0,), max_new_tokens=48,
                    batch_size=16, samples=samples)
    assert r.n == 16 and len(samples) == 16
    assert r.mean_response_tokens > 2  # a real model says something
    assert any(s["extracted"] is not None for s in samples)


def test_evaluation_renders_the_few_shot_turns_as_training_does(tiny, monkeypatch):
    """The held-out evaluation generates from the prompt training renders (data.few_shot included)."""
    import asyncrl.evaluation.evaluate as ev
    from asyncrl.core.config import FewShotExample
    from asyncrl.tasks.tasks import render_prompt

    model, tok = tiny
    shots = [FewShotExample(user="Add these numbers step by step: 1, 2", assistant="1 + 2 = 3\nAnswer: 3")]
    seen = []

    def record(model, tokenizer, prompts, **kw):
        seen.extend(prompts)
        return [([], False)] * len(prompts)

    monkeypatch.setattr(ev, "_generate_engine", record)
    problems = load_task(DataConfig(task="chain")).heldout(3)
    evaluate_problems(model, tok, problems, system_prompt="Be brief.", temperature=0.0, max_new_tokens=4,
                      few_shot=shots)
    assert seen == [render_prompt(tok, p.text, "Be brief.", "", shots)[1] for p in problems]
    assert all(seen[i] != render_prompt(tok, p.text, "Be brief.", "")[1] for i, p in enumerate(problems))
