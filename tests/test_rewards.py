"""Rewards: answer extraction on hand-written responses, format reward, user functions, failures, processing."""

from __future__ import annotations

import math
import threading

import pytest

import asyncrl.tasks.rewards as rewards
from asyncrl.core.config import DataConfig
from asyncrl.tasks.rewards import (
    RewardError,
    RewardScorer,
    VerifierStatusError,
    answer_region,
    check_answer,
    check_verifier_status,
    format_reward,
    load_reward_fn,
    math_verify_reward,
    process_reward,
    process_rewards,
)

META = {"task": "arithmetic", "gold": "-42", "problem_hash": "0"}


@pytest.mark.parametrize(
    "response, correct, format_ok",
    [
        ("Answer: -42", True, True),
        ("51 - 93 = -42\nAnswer: -42", True, True),
        ("**Answer:** -42", True, True),  # markdown
        ("answer: \\boxed{-42}.", True, True),  # lower case, LaTeX
        ("Answer: \u2212 42", True, True),  # typographic minus and a space
        ("Answer: $-42.0$", True, True),
        ("First 51 - 93 = -42. So the result is -42.", True, False),  # no marker: whole response
        ("Answer: -42\n\nCheck: 93 - 51 = 42, so 5 more", True, True),  # the Answer line wins
        ("Answer: -41", False, True),  # wrong
        ("Answer: 42", False, True),  # sign error
        ("I think 51 - 93 is -41.\nAnswer: -41", False, True),
        ("I do not know.", False, False),  # no answer
        ("", False, False),
        ("Answer: 51 - 93", False, False),  # restating the question is not an answer
        ("To compute this we take 51 - 93", False, False),  # truncated restatement
        ("Answer:\n-42", True, False),  # answer not on the Answer line: correct but not compliant
    ],
)
def test_check_answer_on_hand_written_responses(response, correct, format_ok):
    check = check_answer(response, "-42")
    assert (check.correct, check.format_ok) == (correct, format_ok), check
    assert math_verify_reward("p", response, META) == float(correct)
    assert format_reward("p", response, META) == float(format_ok)


def test_numbers_with_commas_fractions_and_decimals():
    assert check_answer("Answer: 1,234", "1234").correct
    assert check_answer("Answer: 1/2", "0.5").correct
    assert check_answer("Answer: \\frac{1}{2}", "1/2").correct
    assert not check_answer("Answer: 0.51", "0.5").correct
    assert check_answer("Answer: $\\frac{\\sqrt{2}}{2}$", "\\frac{\\sqrt{2}}{2}").correct  # bare LaTeX gold


def test_answer_region():
    assert answer_region("blah\nAnswer: 7 apples\nmore") == ("7 apples", True)
    assert answer_region("Answer: 3\nAnswer: 5") == ("5", True)
    assert answer_region("no marker 5") == ("no marker 5", False)
    assert answer_region("Answer:   \n") == ("Answer:   \n", False)
    long = "x" * 5000 + " 9"
    assert len(answer_region(long)[0]) == rewards.MAX_REGION_CHARS


def test_check_answer_off_the_main_thread_uses_the_helper_process():
    out = {}

    def work():
        out["ok"] = check_answer("Answer: -42", "-42")
        out["bad"] = check_answer("Answer: 51 - 93", "-42")

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert out["ok"] == check_answer("Answer: -42", "-42")
    assert out["bad"] == check_answer("Answer: 51 - 93", "-42")
    assert rewards._helper is not None and rewards._helper.proc.poll() is None


def test_hanging_verifier_off_the_main_thread_fails_the_sample(monkeypatch):
    monkeypatch.setattr(rewards, "HARD_TIMEOUT_SECONDS", 0.3)
    scorer = RewardScorer("math_verify")
    out = {}

    def work():
        # sqrt(2) vs 9^9^9 makes sympy evaluate a huge power: math-verify's own 2 s limit is beyond 0.3 s.
        out["slow"] = scorer.score("p", "Answer: 9^9^9", {"gold": "$\\sqrt{2}$"})
        monkeypatch.setattr(rewards, "HARD_TIMEOUT_SECONDS", 60.0)  # a fresh helper needs to start
        out["after"] = scorer.score("p", "Answer: 68", {"gold": "68"})

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert out["slow"].failed and "TimeoutError" in out["slow"].error
    assert not out["after"].failed and out["after"].reward == 1.0


def test_dead_helper_process_is_replaced():
    out = []

    def work():
        out.append(check_answer("Answer: 5", "5").correct)

    for _ in range(2):
        t = threading.Thread(target=work)
        t.start()
        t.join(60)
        rewards._helper.proc.kill()  # the helper dies between checks
        rewards._helper.proc.wait()
    assert out == [True, True]


def test_huge_powers_are_cheap_for_numeric_golds():
    import time

    start = time.perf_counter()
    check = check_answer("Answer: 9^9^9", "68")  # not a literal number: never handed to verify
    assert not check.correct and not check.format_ok
    assert time.perf_counter() - start < 1.0


def test_hanging_verifier_on_the_main_thread_is_bounded():
    import time

    start = time.perf_counter()
    check = check_answer("Answer: 9^9^9", "$\\sqrt{2}$")
    assert not check.correct
    assert time.perf_counter() - start < 3 * rewards.VERIFY_TIMEOUT_SECONDS + 2


# ------------------------------------------------------------------------------------------------
# scorer and user functions


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_user_rewards.py").write_text(
        "def length_bonus(prompt, response, metadata):\n"
        "    return len(response) / 10\n"
        "def boom(prompt, response, metadata):\n"
        "    raise KeyError('no such field')\n"
        "def returns_none(prompt, response, metadata):\n"
        "    return None\n"
        "def returns_nan(prompt, response, metadata):\n"
        "    return float('nan')\n"
        "def returns_bool(prompt, response, metadata):\n"
        "    return metadata['gold'] in response\n"
        "NOT_CALLABLE = 3\n"
    )
    (tmp_path / "broken_user_rewards.py").write_text("import definitely_not_a_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_user_rewards"


def test_builtin_scorer_reports_correctness_and_format_separately():
    s = RewardScorer("math_verify", format_reward_weight=0.5)
    r = s.score("p", "Answer: -42", META)
    assert (r.reward, r.correct, r.format, r.failed) == (1.5, 1.0, 1.0, False)
    r = s.score("p", "the result is -42", META)
    assert (r.reward, r.correct, r.format) == (1.0, 1.0, 0.0)
    r = s.score("p", "Answer: 7", META)
    assert (r.reward, r.correct, r.format) == (0.5, 0.0, 1.0)
    assert set(r.to_dict()) == {"reward", "correct", "format", "error", "elapsed_seconds"}
    f = RewardScorer("format")
    assert f.score("p", "Answer: 7", META).reward == 1.0


def test_response_prefix_is_part_of_the_checked_response(user_module):
    """The assistant prefill (``metadata["response_prefix"]``) is read as the start of the response."""
    meta = {**META, "response_prefix": "Answer:"}
    r = RewardScorer("math_verify").score("p", " -42", meta)
    assert (r.reward, r.correct, r.format) == (1.0, 1.0, 1.0)
    # Without the prefix the same generated text has no Answer: line.
    assert RewardScorer("math_verify").score("p", " -42", META).format == 0.0
    # User functions see the whole turn as well.
    r = RewardScorer(f"{user_module}:length_bonus").score("p", "12", {**META, "response_prefix": "9 + 3 ="})
    assert r.reward == pytest.approx(len("9 + 3 =12") / 10)


def test_user_function(user_module):
    s = RewardScorer(f"{user_module}:length_bonus", format_reward_weight=1.0)
    r = s.score("p", "Answer: 12345", META)
    assert r.reward == pytest.approx(1.3 + 1.0) and r.correct is None and r.format == 1.0
    b = RewardScorer(f"{user_module}:returns_bool").score("p", "x -42", META)
    assert b.reward == 1.0 and not b.failed


@pytest.mark.parametrize(
    "fn, match",
    [("boom", "KeyError: 'no such field'"), ("returns_none", "returned None"), ("returns_nan", "finite")],
)
def test_failing_user_function_marks_the_sample_failed(user_module, fn, match):
    r = RewardScorer(f"{user_module}:{fn}").score("p", "Answer: 1", META)
    assert r.failed and match in r.error and r.reward == 0.0


def test_missing_gold_fails_the_sample_not_the_run():
    r = RewardScorer("math_verify").score("p", "Answer: 1", {"task": "x"})
    assert r.failed and "gold" in r.error


@pytest.mark.parametrize(
    "spec, match",
    [
        ("nonsense", "module:function"),
        (":fn", "module:function"),
        ("mod:", "module:function"),
        ("no_such_module_abc:fn", "cannot import module"),
        ("broken_user_rewards:fn", "cannot import module.*definitely_not_a_module_xyz"),
        ("my_user_rewards:missing", "has no attribute"),
        ("my_user_rewards:NOT_CALLABLE", "not a callable"),
    ],
)
def test_reward_spec_errors(user_module, spec, match):
    with pytest.raises(RewardError, match=match):
        load_reward_fn(spec)
    with pytest.raises(RewardError):
        RewardScorer(spec)


def test_load_builtins_and_from_config():
    assert load_reward_fn("math_verify") is math_verify_reward
    assert load_reward_fn("format") is format_reward
    assert load_reward_fn("asyncrl.tasks.rewards:format_reward") is format_reward
    s = RewardScorer.from_config(DataConfig(reward="format", format_reward_weight=0.25))
    assert s.fn is format_reward and s.format_reward_weight == 0.25


# ------------------------------------------------------------------------------------------------
# processing


def test_process_reward_maths():
    assert process_reward(1.0, scale=2.0, bias=0.5, clip=10) == 1.0
    assert process_reward(0.0, scale=2.0, bias=0.5, clip=10) == -1.0
    assert process_reward(100.0, scale=1.0, bias=0.0, clip=5.0) == 5.0
    assert process_reward(-100.0, scale=1.0, bias=0.0, clip=5.0) == -5.0
    data = DataConfig(reward_scale=3.0, reward_bias=1.0, reward_clip=2.5)
    assert process_rewards([0.0, 1.0, 1.5, 2.0], data) == [-2.5, 0.0, 1.5, 2.5]
    assert process_rewards([0.3], DataConfig()) == [pytest.approx(0.3)]


def test_check_verifier_status():
    with pytest.raises(VerifierStatusError, match="every reward of the train batch .*32 samples"):
        check_verifier_status([0.0] * 32)
    check_verifier_status([0.0] * 31 + [1.0])
    check_verifier_status([])
    check_verifier_status([-1.0, 0.0])
    assert not math.isnan(process_reward(0.0))
