"""Tasks: arithmetic determinism and hash-disjoint splits, GSM8K/JSONL/parquet files, chat template, prompt stream."""

from __future__ import annotations

import json

import pytest

from asyncrl.core.config import ArithmeticConfig, DataConfig
from asyncrl.tasks.base import HELDOUT_PERCENT, is_heldout, problem_hash, problem_key
from asyncrl.tasks.generated import ArithmeticTask
from asyncrl.tasks.tasks import (
    FileTask,
    TaskError,
    TrainPromptStream,
    load_task,
    parse_gsm8k_answer,
    render_prompt,
)


def _arith(seed=0, num_train=500, **kw):
    return ArithmeticTask(ArithmeticConfig(**kw), num_train, seed)


# ------------------------------------------------------------------------------------------------
# arithmetic


def test_arithmetic_is_deterministic_and_seeded():
    a, b, c = _arith(seed=3), _arith(seed=3), _arith(seed=4)
    first = [a.train_problem(i) for i in range(50)]
    assert first == [b.train_problem(i) for i in range(50)]
    assert [p.text for p in first] != [c.train_problem(i).text for i in range(50)]
    # Random access gives the same problem as sequential access.
    assert a.train_problem(37) == first[37]


def test_arithmetic_gold_answers_and_knobs():
    task = _arith(digits=3, operators="+-*", n_terms=4)
    for i in range(200):
        p = task.train_problem(i)
        expr = p.metadata["expression"]
        tokens = expr.split()
        assert len(tokens) == 2 * 4 - 1
        nums, ops = [int(t) for t in tokens[::2]], tokens[1::2]
        assert all(0 <= n <= 999 for n in nums) and set(ops) <= set("+-*")
        # Independent evaluation with precedence: fold products first, then sums.
        terms, sign, prod = [], 1, nums[0]
        for op, n in zip(ops, nums[1:]):
            if op == "*":
                prod *= n
            else:
                terms.append(sign * prod)
                sign, prod = (1 if op == "+" else -1), n
        terms.append(sign * prod)
        assert p.gold == str(sum(terms)) == p.metadata["gold"]
        assert p.text == f"What is {expr}?"
        assert p.metadata["task"] == "arithmetic" and p.metadata["split"] == "train"


def test_problem_key_names_the_problem_wherever_it_recurs():
    """Selective rollout's history key: equal for the same problem text at any position, below 10**14."""
    assert problem_key("What is 3 + 4?") == problem_key("What is  3 +\n4?") == int(problem_hash("What is 3 + 4?")[:10], 16)
    assert problem_key("What is 3 + 4?") != problem_key("What is 4 + 3?")
    task = _arith(num_train=2000, digits=1, operators="+")  # ~90 distinct train problems at 2,000 positions
    by_text: dict[str, set[int]] = {}
    for i in range(2000):
        by_text.setdefault(task.train_problem(i).text, set()).add(problem_key(task.train_problem(i).text))
    assert len(by_text) < 100 and all(len(keys) == 1 for keys in by_text.values())
    keys = {next(iter(k)) for k in by_text.values()}
    assert len(keys) == len(by_text) and all(0 <= k < 2**40 < 10**14 for k in keys)


def test_arithmetic_splits_are_disjoint_by_hash():
    train_hashes = set()
    for seed in (0, 1):
        task = _arith(seed=seed, num_train=3000)
        for i in range(3000):
            p = task.train_problem(i)
            assert p.metadata["problem_hash"] == problem_hash(p.metadata["expression"])
            assert not is_heldout(p.metadata["problem_hash"])
            train_hashes.add(p.metadata["problem_hash"])
    heldout = _arith().heldout(400)
    held_hashes = {p.metadata["problem_hash"] for p in heldout}
    assert len(held_hashes) == 400  # distinct
    assert all(is_heldout(h) for h in held_hashes)
    assert not (train_hashes & held_hashes)
    # The share of the problem space that is held out is about HELDOUT_PERCENT.
    share = sum(is_heldout(problem_hash(f"{a} + {b}")) for a in range(100) for b in range(100)) / 10_000
    assert abs(share - HELDOUT_PERCENT / 100) < 0.02


def test_heldout_does_not_depend_on_run_seed():
    assert _arith(seed=0).heldout(30) == _arith(seed=9).heldout(30)
    assert _arith().heldout(10) == _arith().heldout(30)[:10]


def test_too_small_arithmetic_space_is_a_clear_error():
    task = _arith(digits=1, operators="+", n_terms=2)  # 100 problems, ~10 held out
    with pytest.raises(TaskError, match="distinct held-out problems"):
        task.heldout(50)


def test_train_index_out_of_range():
    with pytest.raises(IndexError):
        _arith(num_train=10).train_problem(10)


# ------------------------------------------------------------------------------------------------
# files


def test_parse_gsm8k_answer():
    assert parse_gsm8k_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert parse_gsm8k_answer("so #### 1,234") == "1234"
    assert parse_gsm8k_answer("#### $18 ") == "18"
    assert parse_gsm8k_answer("a #### 1 #### -3.5") == "-3.5"
    with pytest.raises(TaskError, match="no '####'"):
        parse_gsm8k_answer("the answer is 72")
    with pytest.raises(TaskError, match="nothing after"):
        parse_gsm8k_answer("72 ####  ")


def _rows(n):
    return [{"question": f"Tom has {i} apples and buys {i + 3}. How many?", "answer": f"{i}+{i + 3}\n#### {2 * i + 3}",
             "source": "unit"} for i in range(n)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_file_splits_and_gold(tmp_path):
    rows = _rows(60)
    task = FileTask(_write_jsonl(tmp_path / "gsm.jsonl", rows), "gsm8k")
    n_held = sum(is_heldout(problem_hash(r["question"])) for r in rows)
    assert 0 < n_held < 60 and task.num_train() == 60 - n_held
    train = [task.train_problem(i) for i in range(task.num_train())]
    held = task.heldout(n_held)
    assert {p.text for p in train}.isdisjoint({p.text for p in held})
    p = train[0]
    i = int(p.text.split()[2])
    assert p.gold == str(2 * i + 3) and p.metadata["gold"] == p.gold
    assert p.metadata["task"] == "gsm8k" and p.metadata["source"] == "unit"
    with pytest.raises(TaskError, match="distinct held-out"):
        task.heldout(n_held + 1)


def test_gsm8k_row_without_marker_is_an_error(tmp_path):
    rows = _rows(3) + [{"question": "q?", "answer": "no marker here"}]
    with pytest.raises(TaskError, match="row 3.*####"):
        FileTask(_write_jsonl(tmp_path / "bad.jsonl", rows), "gsm8k")


def test_jsonl_plain_answers_and_problem_field(tmp_path):
    rows = [{"problem": f"Compute {i}*2.", "answer": str(2 * i)} for i in range(40)]
    task = FileTask(_write_jsonl(tmp_path / "d.jsonl", rows), "jsonl")
    got = {task.train_problem(i).text: task.train_problem(i).gold for i in range(task.num_train())}
    for r in rows:
        if r["problem"] in got:
            assert got[r["problem"]] == r["answer"]


def test_parquet_loading(tmp_path):
    import datasets

    rows = _rows(40)
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    task = load_task(DataConfig(task="parquet", path=path))
    assert task.num_train() + len(task._heldout) == 40
    assert task.train_problem(0).gold.isdigit()


@pytest.mark.parametrize(
    "rows, match",
    [
        ([{"text": "q", "answer": "1"}], "needs a text field"),
        ([{"question": "q"}], "needs an 'answer' field"),
    ],
)
def test_file_rows_missing_fields(tmp_path, rows, match):
    with pytest.raises(TaskError, match=match):
        FileTask(_write_jsonl(tmp_path / "x.jsonl", rows), "jsonl")


def test_missing_unreadable_or_unset_files(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        FileTask(tmp_path / "nope.jsonl", "jsonl")
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file at all")
    with pytest.raises(TaskError, match="cannot read"):
        FileTask(garbage, "parquet")
    with pytest.raises(TaskError, match="needs data.path"):
        load_task(DataConfig(task="gsm8k"))
    with pytest.raises(TaskError, match="unknown file task kind"):
        FileTask(garbage, "csv")


# ------------------------------------------------------------------------------------------------
# chat template and stream


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from asyncrl.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def test_render_prompt_with_chat_template(tokenizer):
    text, ids = render_prompt(tokenizer, "What is 2 + 3?", "Be brief.")
    assert "Be brief." in text and "What is 2 + 3?" in text
    assert text.index("Be brief.") < text.index("What is 2 + 3?")
    assert text.endswith("<|im_start|>assistant\n")  # add_generation_prompt
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    no_system, _ = render_prompt(tokenizer, "What is 2 + 3?", None)
    assert "system" not in no_system and "What is 2 + 3?" in no_system


def test_render_prompt_without_template_is_an_error(tiny_model_dir):
    from asyncrl.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = None
    with pytest.raises(TaskError, match="no chat template"):
        render_prompt(tok, "q", None)


def test_stream_is_deterministic_and_resumable(tokenizer):
    data = DataConfig(num_train_prompts=7)
    s = TrainPromptStream(data, tokenizer, seed=5)
    it = s.iterate(0)
    first = [next(it) for _ in range(16)]
    assert [p.cursor for p in first] == list(range(16))
    # Resume at cursor 9 in a fresh stream: exactly the same continuation.
    resumed = TrainPromptStream(data, tokenizer, seed=5).iterate(9)
    assert [next(resumed) for _ in range(7)] == first[9:]
    # Each epoch visits every train problem exactly once, in a new order.
    idx = [p.problem.metadata["index"] for p in first]
    assert sorted(idx[:7]) == sorted(idx[7:14]) == list(range(7))
    assert idx[:7] != idx[7:14]
    assert [p.problem.metadata["epoch"] for p in first[6:8]] == [0, 1]
    other = TrainPromptStream(data, tokenizer, seed=6)
    assert [other.get(c).problem.text for c in range(7)] != [p.problem.text for p in first[:7]]
    p = first[0]
    assert p.prompt_ids == render_prompt(tokenizer, p.problem.text, data.system_prompt)[1]
    with pytest.raises(ValueError, match="cursor"):
        s.get(-1)


def test_stream_over_a_file_task(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "g.jsonl", _rows(30))
    s = TrainPromptStream(DataConfig(task="gsm8k", path=path), tokenizer, seed=0)
    texts = [s.get(c).problem.text for c in range(len(s))]
    assert len(set(texts)) == len(s) == s.task.num_train()
    assert all(not is_heldout(problem_hash(t)) for t in texts)


# ------------------------------------------------------------------------------------------------
# per-operand digits, held-out share, assistant prefill


def test_per_operand_digits():
    task = _arith(digits=[2, 1], operators="+", n_terms=2, num_train=300)
    nums = [[int(t) for t in task.train_problem(i).metadata["expression"].split()[::2]] for i in range(300)]
    assert all(0 <= a <= 99 and 0 <= b <= 9 for a, b in nums)
    assert max(a for a, _ in nums) >= 50  # the first operand really has two digits
    assert ArithmeticConfig(digits=3, n_terms=4).digits_per_term == [3, 3, 3, 3]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(digits=[2, 1, 1], n_terms=2), "has 3 entries but n_terms is 2"),
        (dict(digits=[2, 0], n_terms=2), "between 1 and 9"),
        (dict(digits=12), "between 1 and 9"),
    ],
)
def test_bad_digits_are_clear_errors(kw, match):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=match):
        ArithmeticConfig(**kw)


def test_heldout_percent_sets_the_share_and_keeps_splits_disjoint():
    cfg = ArithmeticConfig(digits=[2, 1], operators="+", n_terms=2)  # 1,000 problems
    small = ArithmeticTask(cfg, 2000, 0)  # default 10%: ~100 held out
    with pytest.raises(TaskError, match="raise data.heldout_percent"):
        small.heldout(400)
    big = ArithmeticTask(cfg, 2000, 0, heldout_percent=50)
    held = {p.metadata["problem_hash"] for p in big.heldout(450)}
    assert len(held) == 450
    train = {big.train_problem(i).metadata["problem_hash"] for i in range(2000)}
    assert not (train & held)
    assert all(is_heldout(h, 50) for h in held) and not any(is_heldout(h, 50) for h in train)
    # A larger share only moves problems from train to held out (nested hash buckets).
    assert all(is_heldout(p.metadata["problem_hash"], 50) for p in small.heldout(60))
    share = sum(is_heldout(problem_hash(f"{a} + {b}"), 50) for a in range(100) for b in range(100)) / 10_000
    assert abs(share - 0.5) < 0.02
    assert load_task(DataConfig(heldout_percent=30)).heldout_percent == 30


def test_heldout_percent_bounds():
    from pydantic import ValidationError

    for bad in (0, 91):
        with pytest.raises(ValidationError, match="heldout_percent"):
            DataConfig(heldout_percent=bad)


def test_file_task_uses_the_heldout_percent(tmp_path):
    path = _write_jsonl(tmp_path / "g.jsonl", _rows(200))
    ten, sixty = FileTask(path, "gsm8k"), FileTask(path, "gsm8k", heldout_percent=60)
    assert 60 <= ten.num_train() - sixty.num_train() <= 140  # ~50% of 200 rows moved
    held = sixty.heldout(200 - sixty.num_train())
    assert all(is_heldout(p.metadata["problem_hash"], 60) for p in held)
    with pytest.raises(TaskError, match="60% of rows"):
        sixty.heldout(200 - sixty.num_train() + 1)


def test_render_response_prefix():
    from asyncrl.tasks.tasks import render_response_prefix

    meta = {"expression": "82 + 2", "gold": "84", "task": "arithmetic"}
    assert render_response_prefix("{expression} =", meta) == "82 + 2 ="
    assert render_response_prefix(None, meta) == "" and render_response_prefix("", meta) == ""
    with pytest.raises(TaskError, match="never available"):
        render_response_prefix("The answer is {gold}", meta)  # would leak the answer
    with pytest.raises(TaskError, match=r"uses \{nope\}.*available: expression, task"):
        render_response_prefix("{nope}", meta)
    with pytest.raises(TaskError, match="not a valid format string"):
        render_response_prefix("{expression", meta)


def test_stream_renders_the_prefix_after_the_generation_prompt(tokenizer):
    data = DataConfig(num_train_prompts=5, response_prefix="{expression} =")
    p = TrainPromptStream(data, tokenizer, seed=0).get(0)
    expr = p.problem.metadata["expression"]
    assert p.problem.metadata["response_prefix"] == f"{expr} ="
    plain, _ = render_prompt(tokenizer, p.problem.text, data.system_prompt)
    assert p.prompt_text == plain + f"{expr} =" and p.prompt_text.endswith("<|im_start|>assistant\n" + f"{expr} =")
    assert p.prompt_ids == tokenizer(p.prompt_text, add_special_tokens=False)["input_ids"]
    assert "response_prefix" not in TrainPromptStream(DataConfig(num_train_prompts=5), tokenizer).get(0).problem.metadata
    with pytest.raises(TaskError, match="uses {missing}"):
        TrainPromptStream(DataConfig(num_train_prompts=5, response_prefix="{missing}"), tokenizer).get(0)


# ------------------------------------------------------------------------------------------------
# few-shot examples (data.few_shot): the chain job's prompt (configs/smollm2_longtail.yaml)


SHOTS = [{"user": "Add these numbers step by step: 4, 2, 7", "assistant": "4 + 2 = 6\n6 + 7 = 13\nAnswer: 13"},
         {"user": "Add these numbers step by step: 1, 1", "assistant": "1 + 1 = 2\nAnswer: 2"}]


def test_few_shot_examples_are_chat_turns_of_every_training_prompt(tokenizer):
    from asyncrl.core.config import FewShotExample

    shots = [FewShotExample(**s) for s in SHOTS]
    text, ids = render_prompt(tokenizer, "Add these numbers step by step: 9, 9", "Sys.", "9 + 9 =", shots)
    order = ["Sys.", SHOTS[0]["user"], SHOTS[0]["assistant"], SHOTS[1]["user"], SHOTS[1]["assistant"], "9, 9"]
    pos = [text.index(s) for s in order]
    assert pos == sorted(pos), pos
    # each example answer is an assistant turn of its own; the real problem opens a third one, prefilled
    assert text.count("<|im_start|>assistant\n") == 3 and text.endswith("<|im_start|>assistant\n9 + 9 =")
    assert text.count("<|im_end|>") == 6  # closed: the system turn, 2 x (user, assistant), the problem's user turn
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    data = DataConfig(task="chain", few_shot=SHOTS, system_prompt="Sys.", response_prefix="{first_step} =")
    p = TrainPromptStream(data, tokenizer, seed=0).get(0)
    prefix = p.problem.metadata["response_prefix"]
    assert p.prompt_ids == render_prompt(tokenizer, p.problem.text, "Sys.", prefix, shots)[1]
    assert p.prompt_ids != render_prompt(tokenizer, p.problem.text, "Sys.", prefix)[1]


def test_few_shot_config_is_bounded_and_strict():
    from asyncrl.core.config import ConfigError, load_config

    assert load_config(overrides={"data": {"few_shot": SHOTS}}).data.few_shot[1].assistant.endswith("Answer: 2")
    for bad, needle in (([{"user": "", "assistant": "x"}], "user"), ([{"user": "q"}], "assistant"),
                        ([{"user": "q", "assistant": "a", "role": "system"}], "role"),
                        ([SHOTS[0]] * 17, "few_shot"), ([{"user": "q" * 4001, "assistant": "a"}], "user")):
        with pytest.raises(ConfigError, match=needle):
            load_config(overrides={"data": {"few_shot": bad}})


def test_longtail_config_examples_are_correct_worked_answers():
    """The shipped examples teach the format the reward checks, with right sums."""
    from pathlib import Path

    from asyncrl.core.config import load_config
    from asyncrl.tasks.rewards import check_answer

    cfg = load_config(config_path=Path(__file__).parent.parent / "configs" / "smollm2_longtail.yaml")
    assert len(cfg.data.few_shot) == 2
    for ex in cfg.data.few_shot:
        numbers = [int(x) for x in ex.user.rsplit(":", 1)[1].split(",")]
        lines = ex.assistant.splitlines()
        assert len(lines) == len(numbers)  # one line per addition, then the answer
        assert check_answer(ex.assistant, str(sum(numbers))).correct
