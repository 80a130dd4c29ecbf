"""The long-tailed ``chain`` task: determinism, hash-disjoint splits, the heavy tail of its step
counts, worked answers consistent with the gold, config validation, and its config file."""

from __future__ import annotations

import random
import re
import statistics
from pathlib import Path

import pytest
from pydantic import ValidationError

from asyncrl.core.config import ChainConfig, DataConfig, load_config
from asyncrl.tasks.rewards import check_answer
from asyncrl.tasks.base import is_heldout, problem_hash
from asyncrl.tasks.chain_reward import (CHAIN_PARTIAL_WEIGHT, chain_correct_steps, chain_partial_reward,
                                        chain_partial_matched_reward, chain_step_lines)
from asyncrl.tasks.generated import ChainTask, chain_solution, chain_steps
from asyncrl.tasks.tasks import TaskError, load_task, render_response_prefix

REPO = Path(__file__).resolve().parents[1]
LONGTAIL = REPO / "configs" / "smollm2_longtail.yaml"


def _chain(seed=0, num_train=500, heldout_percent=50, **kw):
    return ChainTask(ChainConfig(**kw), num_train, seed, heldout_percent)


def _percentile(values, q):
    """The q-th percentile (0-100), nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


def test_chain_is_deterministic_and_seeded():
    a, b, c = _chain(seed=3), _chain(seed=3), _chain(seed=4)
    first = [a.train_problem(i) for i in range(100)]
    assert first == [b.train_problem(i) for i in range(100)]
    assert [p.text for p in first] != [c.train_problem(i).text for i in range(100)]
    assert a.train_problem(37) == first[37]  # random access = sequential access
    assert a.heldout(50) == b.heldout(50) == c.heldout(50)  # held out: seed-independent
    with pytest.raises(IndexError):
        a.train_problem(500)


def test_chain_splits_are_disjoint_by_hash():
    train = set()
    for seed in (0, 1):
        task = _chain(seed=seed, num_train=2000)
        for i in range(2000):
            p = task.train_problem(i)
            assert p.metadata["split"] == "train"
            assert p.metadata["problem_hash"] == problem_hash(p.metadata["numbers_text"])
            assert not is_heldout(p.metadata["problem_hash"], 50)
            train.add(p.metadata["problem_hash"])
    held = _chain().heldout(400)
    hashes = {p.metadata["problem_hash"] for p in held}
    assert len(hashes) == 400  # distinct
    assert all(is_heldout(h, 50) and p.metadata["split"] == "heldout" for h, p in zip(hashes, held))
    assert not train & hashes
    assert [p.metadata["index"] for p in held] == list(range(400))


def test_step_counts_follow_the_truncated_pareto_law():
    cfg = ChainConfig()  # min_steps 2, tail_index 1.2, max_steps 48
    rng = random.Random(0)
    steps = [chain_steps(rng, cfg) for _ in range(40_000)]
    assert min(steps) == cfg.min_steps and max(steps) == cfg.max_steps
    n = len(steps)
    for s in (3, 4, 8, 16, 32):
        expected = (cfg.min_steps / s) ** cfg.tail_index
        observed = sum(x >= s for x in steps) / n
        # 5 binomial standard deviations
        assert abs(observed - expected) < 5 * (expected * (1 - expected) / n) ** 0.5 + 1e-3, s
    at_cap = sum(x == cfg.max_steps for x in steps) / n
    assert abs(at_cap - (cfg.min_steps / cfg.max_steps) ** cfg.tail_index) < 0.003


def test_heavy_tail_in_both_splits():
    """The 99th percentile of the step count is >= 10x its median, in the train and held-out splits
    (drawing the step count before the split keeps the law in both)."""
    task = _chain(num_train=20_000, max_steps=40)
    train = [task.train_problem(i).metadata["steps"] for i in range(20_000)]
    held = [p.metadata["steps"] for p in task.heldout(400)]
    for steps in (train, held):
        med = statistics.median(steps)
        assert med == 3
        assert _percentile(steps, 99) >= 10 * med
    # The same in worked-answer characters (the response length a correct answer needs).
    lengths = [len(chain_solution(p.metadata["numbers"])) for p in task.heldout(400)]
    assert _percentile(lengths, 99) >= 10 * statistics.median(lengths)


def test_worked_answer_and_gold_agree():
    task = _chain(digits=2, num_train=300)
    problems = [task.train_problem(i) for i in range(300)] + task.heldout(100)
    for p in problems:
        nums = p.metadata["numbers"]
        assert len(nums) == p.metadata["steps"] + 1 and all(1 <= x <= 99 for x in nums)
        assert p.gold == p.metadata["gold"] == str(sum(nums))
        assert p.text == "Add these numbers step by step: " + ", ".join(map(str, nums))
        solution = chain_solution(nums)
        lines = solution.split("\n")
        assert len(lines) == p.metadata["steps"] + 1 and lines[-1] == f"Answer: {p.gold}"
        total = nums[0]
        for line, x in zip(lines, nums[1:]):
            a, b, c = map(int, re.fullmatch(r"(\d+) \+ (\d+) = (\d+)", line).groups())
            assert (a, b, c) == (total, x, total + x)
            total = c
        assert check_answer(solution, p.gold).correct
        # The prefill of configs/smollm2_longtail.yaml opens the first step.
        prefix = render_response_prefix("{first_step} =", p.metadata)
        assert solution.startswith(prefix + " ")
    assert not check_answer(chain_solution([1, 2, 3]), "7").correct
    with pytest.raises(ValueError, match="at least two"):
        chain_solution([5])


def test_too_few_distinct_heldout_problems_is_a_clear_error():
    # min_steps 1 with one-digit numbers: 81 two-number problems, ~8 held out at 10%.
    task = _chain(heldout_percent=10, min_steps=1, max_steps=1)
    assert len(task.heldout(5)) == 5
    with pytest.raises(TaskError, match="heldout_percent"):
        task.heldout(40)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(min_steps=10, max_steps=5), "max_steps"),
        (dict(tail_index=0.2), "tail_index"),
        (dict(digits=0), "digits"),
        (dict(digits=5), "digits"),
        (dict(min_steps=0), "min_steps"),
        (dict(max_steps=500), "max_steps"),
        (dict(lenght=3), "lenght"),
    ],
)
def test_bad_chain_config_is_a_clear_error(kw, match):
    with pytest.raises(ValidationError, match=match):
        DataConfig(task="chain", chain=kw)


def test_chain_is_a_builtin_task_name():
    assert isinstance(load_task(DataConfig(task="chain", heldout_percent=50)), ChainTask)
    with pytest.raises(ValidationError, match="'chain'"):
        DataConfig(task="chian")


def test_longtail_config_loads_and_partial_rollout_has_work():
    cfg = load_config(["--config", str(LONGTAIL)], environ={})
    assert cfg.data.task == "chain" and cfg.model.path == "smollm2-135m-instruct"
    assert cfg.trainer.loss.importance_weight_mode == "mask" and cfg.trainer.optimizer.lr == 1e-5
    r = cfg.rollout
    assert r.max_response_len >= 512
    assert r.partial_percent < 1
    # The budget lies well under the tail. SmolLM2's tokenizer writes every digit as a token, so a
    # step line "a + b = c\n" of one-digit numbers (running sums < 1000) is 8 to 12 tokens and the
    # answer line at most 6: the longest held-out answers need >= 4 budgets and fit the cap.
    task = load_task(cfg.data)
    held = task.heldout(cfg.data.num_heldout_prompts)
    longest = max(p.metadata["steps"] for p in held)
    assert cfg.data.chain.digits == 1 and longest == cfg.data.chain.max_steps
    assert longest * 8 >= 4 * r.max_budget
    assert longest * 12 + 6 <= r.max_response_len
    assert cfg.monitoring.eval_num_problems <= cfg.data.num_heldout_prompts


# ------------------------------------------------------------------ data.reward: chain_partial
def test_correct_steps_count_the_leading_right_sums():
    nums = [3, 5, 2, 7, 4]
    assert chain_correct_steps(chain_solution(nums), nums) == 4
    assert chain_correct_steps("3 + 5 = 8\n8 + 2 = 10\n10 + 7 = 18\n18 + 4 = 22\nAnswer: 22", nums) == 2  # 3rd sum wrong
    assert chain_correct_steps("3 + 5 = 8\n8 + 7 = 15\nAnswer: 15", nums) == 1  # skipped a number
    assert chain_correct_steps("3 + 5 = 8\n8 + 2 = 10\nAnswer: 10", nums) == 2  # stopped early (2-step shape)
    assert chain_correct_steps("I think it is 21.", nums) == 0
    assert chain_correct_steps("3+5=8, 8+2=10", nums) == 2  # spacing and separators do not matter
    # more right lines than steps count once each; a 13-digit number is no step and costs no big int
    assert chain_correct_steps(chain_solution(nums) + "\n21 + 1 = 22", nums) == 4
    assert chain_correct_steps("3 + 5 = 8\n8 + 2 = " + "1" * 5000, nums) == 1


def test_chain_partial_reward_ranks_right_answers_first_then_more_right_steps():
    nums = [3, 5, 2, 7, 4, 1, 6, 2, 9, 8, 5]  # 10 steps
    meta = {"numbers": nums, "gold": str(sum(nums))}
    assert chain_partial_reward("p", chain_solution(nums), meta) == 1.0
    two = "3 + 5 = 8\n8 + 2 = 10\nAnswer: 10"
    five = "3 + 5 = 8\n8 + 2 = 10\n10 + 7 = 17\n17 + 4 = 21\n21 + 1 = 22\nAnswer: 22"
    all_steps_wrong_answer = chain_solution(nums).rsplit("Answer:", 1)[0] + "Answer: 1"
    assert chain_partial_reward("p", two, meta) == pytest.approx(CHAIN_PARTIAL_WEIGHT * 2 / 11)
    assert chain_partial_reward("p", five, meta) == pytest.approx(CHAIN_PARTIAL_WEIGHT * 5 / 11)
    # every step right but the answer line wrong: still strictly below 0.5 (the buffer's easy threshold)
    assert chain_partial_reward("p", all_steps_wrong_answer, meta) == pytest.approx(CHAIN_PARTIAL_WEIGHT * 10 / 11)
    assert chain_partial_reward("p", all_steps_wrong_answer, meta) < 0.5
    assert chain_partial_reward("p", "no idea", meta) == 0.0
    # the 2-step shape that the outcome reward taught (docs/tasks.md) now differs from 5 right steps:
    # a group of a long problem has reward variance
    assert chain_partial_reward("p", two, meta) < chain_partial_reward("p", five, meta)


@pytest.mark.parametrize("fn", [chain_partial_reward, chain_partial_matched_reward])
@pytest.mark.parametrize("meta", [{"gold": "3"}, {"numbers": [3], "gold": "3"}, {"numbers": [1, 2]},
                                  {"numbers": ["1", "2"], "gold": "3"}])
def test_chain_partial_reward_outside_the_chain_task_is_a_clear_error(meta, fn):
    name = "chain_partial_matched" if fn is chain_partial_matched_reward else "chain_partial"
    with pytest.raises(ValueError, match=f"data.reward={name} needs .*use it with data.task: chain"):
        fn("p", "1 + 2 = 3\nAnswer: 3", meta)


def test_chain_partial_matched_scales_partial_credit_by_the_length_match():
    """The two shapes section O's runs learned under chain_partial earn less under the matched
    reward: adding on past the last number (seed 2: "5, 7, 2" answered 18) and stopping after two
    additions on a long problem (seed 1); a wrong answer of the right length keeps its full credit."""
    nums = [5, 7, 2]
    meta = {"numbers": nums, "gold": "14"}
    overshoot = "5 + 7 = 12\n12 + 2 = 14\n14 + 2 = 16\n16 + 2 = 18\nAnswer: 18"
    assert chain_step_lines(overshoot) == 4 and chain_correct_steps(overshoot, nums) == 2
    assert chain_partial_reward("p", overshoot, meta) == pytest.approx(CHAIN_PARTIAL_WEIGHT * 2 / 3)  # the loophole
    assert chain_partial_matched_reward("p", overshoot, meta) == pytest.approx(CHAIN_PARTIAL_WEIGHT * 2 / 3 * 2 / 4)
    longer = overshoot.replace("\nAnswer: 18", "\n18 + 2 = 20\n20 + 2 = 22\nAnswer: 22")
    assert chain_partial_matched_reward("p", longer, meta) < chain_partial_matched_reward("p", overshoot, meta)
    assert chain_partial_matched_reward("p", "5 + 7 = 12\n12 + 2 = 14\nAnswer: 14", meta) == 1.0
    one_wrong = "5 + 7 = 12\n12 + 2 = 15\nAnswer: 15"  # right length, second sum wrong: full credit for 1 step
    assert chain_partial_matched_reward("p", one_wrong, meta) == pytest.approx(CHAIN_PARTIAL_WEIGHT * 1 / 3)
    # a right final answer is 1.0 whatever the lines, as under chain_partial and math_verify
    assert chain_partial_matched_reward("p", "Answer: 14", meta) == 1.0
    assert chain_partial_matched_reward("p", "no idea", meta) == 0.0
    long_nums = [3, 5, 2, 7, 4, 1, 6, 2, 9, 8, 5]  # 10 steps
    long_meta = {"numbers": long_nums, "gold": str(sum(long_nums))}
    two = "3 + 5 = 8\n8 + 2 = 10\nAnswer: 10"
    assert chain_partial_matched_reward("p", two, long_meta) == pytest.approx(CHAIN_PARTIAL_WEIGHT * 2 / 11 * 2 / 10)
    lines = chain_solution(long_nums).rsplit("Answer:", 1)[0].splitlines()
    five_then_wrong = "\n".join(lines[:5] + [f"1 + {n} = {1 + n}" for n in long_nums[6:]]) + "\nAnswer: 1"
    assert chain_step_lines(five_then_wrong) == 10
    full = chain_partial_matched_reward("p", five_then_wrong, long_meta)
    assert full == pytest.approx(CHAIN_PARTIAL_WEIGHT * 5 / 11) and full < 0.5
    # within a long problem's group the ranking is: right answer, then right steps at the right length
    assert 1.0 > full > chain_partial_matched_reward("p", two, long_meta) > 0.0


def test_chain_partial_through_the_scorer_fails_only_its_sample():
    """The run's path: data.reward: chain_partial loads by name; the prefill is part of the response;
    correctness is reported beside the reward; a sample without chain metadata fails alone."""
    from asyncrl.tasks.rewards import RewardScorer

    scorer = RewardScorer("chain_partial")
    nums = [3, 5, 2, 7]
    meta = {"numbers": nums, "gold": "17", "response_prefix": "3 + 5 ="}
    right = scorer.score("p", " 8\n8 + 2 = 10\n10 + 7 = 17\nAnswer: 17", meta)
    assert (right.reward, right.correct, right.error) == (1.0, 1.0, None)
    part = scorer.score("p", " 8\n8 + 2 = 10\nAnswer: 10", meta)
    assert part.reward == pytest.approx(CHAIN_PARTIAL_WEIGHT * 2 / 4) and part.correct == 0.0
    bad = scorer.score("p", "8", {"gold": "8"})
    assert bad.failed and "data.task: chain" in bad.error
    assert scorer.score("p", " 8\n8 + 2 = 10\n10 + 7 = 17\nAnswer: 17", meta).reward == 1.0  # unaffected
    # the long-tail config ships the matched variant (docs/tasks.md: the outcome reward taught 2-step
    # answers only; plain chain_partial paid a shortcut and adding on, docs/results.md sections O and P)
    assert load_config(["--config", str(LONGTAIL)], environ={}).data.reward == "chain_partial_matched"
    # the matched variant loads by name too, through the same path
    matched = RewardScorer("chain_partial_matched")
    assert matched.score("p", " 8\n8 + 2 = 10\n10 + 7 = 17\nAnswer: 17", meta).reward == 1.0
    assert matched.score("p", " 8\n8 + 2 = 10\nAnswer: 10", meta).reward == \
        pytest.approx(CHAIN_PARTIAL_WEIGHT * 2 / 4 * 2 / 3)  # 2 lines for 3 steps
    assert matched.score("p", " 8\n8 + 2 = 10\n10 + 7 = 18\nAnswer: 18", meta).reward == \
        pytest.approx(CHAIN_PARTIAL_WEIGHT * 2 / 4)
