"""Prompt datasets: the built-in arithmetic and chain tasks, GSM8K-format files, local JSONL/parquet files.

Every task yields :class:`Problem` records (problem text, gold answer, a JSON-serialisable
metadata dict that travels with the prompt group through Redis to the reward function), split
into a *train* and a *held-out* part. The split is a function of the problem alone: a problem
is held out iff ``sha256(canonical problem) mod 100 < data.heldout_percent`` (default
``HELDOUT_PERCENT`` = 10), so no problem can be in both splits whatever the seed, the file order
or the number of prompts requested.

Training prompts come from :class:`TrainPromptStream`, a deterministic function of
``(data config, tokenizer, seed, cursor)``: cursor ``c`` is the ``c``-th prompt fed, epoch
``c // N`` visits the ``N`` train problems in a permutation seeded by ``(seed, epoch)``. The
controller records the cursor, so a restart neither skips nor repeats a prompt
(docs/architecture.md#data-flow-of-one-sample, step 1).

Prompts are rendered with the tokenizer's chat template (system message from
``data.system_prompt``, ``add_generation_prompt=True``), followed by the optional assistant
prefill ``data.response_prefix`` formatted with the problem's metadata, and tokenized once; token
ids are never re-derived from text afterwards. The rendered prefill travels in the metadata
(``response_prefix``) so that rewards and evaluation read ``prefix + generated text``.

Simplified: file datasets are read whole into memory (the tasks this engine targets are at
most ~10^5 prompts); the arithmetic task is generated on demand by index, so its train split
costs no memory.
"""

from __future__ import annotations

import hashlib
import json
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from asyncrl.core.config import ArithmeticConfig, ChainConfig, DataConfig
from asyncrl.core.choices import FILE_TASKS
from asyncrl.tasks.registry import TaskError, register_task, task_factory

__all__ = [
    "HELDOUT_PERCENT",
    "Problem",
    "Prompt",
    "GeneratedTask",
    "TaskError",
    "Task",
    "ArithmeticTask",
    "ChainTask",
    "chain_steps",
    "chain_solution",
    "FileTask",
    "load_task",
    "arithmetic_task",
    "chain_task",
    "problem_hash",
    "is_heldout",
    "parse_gsm8k_answer",
    "render_prompt",
    "render_response_prefix",
    "TrainPromptStream",
]

#: Default percentage of the problem space (by hash) held out for evaluation (``data.heldout_percent``).
HELDOUT_PERCENT = 10


@dataclass(frozen=True)
class Problem:
    """One problem of a task.

    Attributes:
        text: the problem as shown to the model (the user message).
        gold: the gold final answer as a string (e.g. ``"68"``), what the verifier compares to.
        metadata: JSON-serialisable dict passed to reward functions; always has ``task``,
            ``gold``, ``problem_hash`` and ``split`` (``"train"`` or ``"heldout"``).
    """

    text: str
    gold: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Prompt:
    """A training prompt: a problem rendered with the chat template and tokenized.

    Attributes:
        cursor: position in the training stream (0-based count of prompts fed before this one).
        problem: the problem.
        prompt_text: the rendered chat text (for logs; never re-tokenized).
        prompt_ids: token ids of the rendered prompt, shape ``(prompt_tokens,)``.
    """

    cursor: int
    problem: Problem
    prompt_text: str
    prompt_ids: list[int]


def _canonical(text: str) -> str:
    return " ".join(text.split())


def problem_hash(text: str) -> str:
    """Hex sha256 (first 16 hex digits) of the whitespace-normalised problem text."""
    return hashlib.sha256(_canonical(text).encode("utf-8")).hexdigest()[:16]


def is_heldout(hash_hex: str, percent: int = HELDOUT_PERCENT) -> bool:
    """True when a problem with this :func:`problem_hash` belongs to the held-out split.

    Args:
        percent: share of the problem space held out, 1-90 (``data.heldout_percent``).
    """
    return int(hash_hex, 16) % 100 < percent


class Task(ABC):
    """A source of problems with a train and a held-out split (both deterministic)."""

    name: str = "task"

    @abstractmethod
    def num_train(self) -> int:
        """Number of distinct train indices (the epoch length of :class:`TrainPromptStream`)."""

    @abstractmethod
    def train_problem(self, index: int) -> Problem:
        """The train problem at ``0 <= index < num_train()``."""

    @abstractmethod
    def heldout(self, n: int) -> list[Problem]:
        """The first ``n`` held-out problems (distinct, deterministic, independent of the run seed).

        Raises:
            TaskError: the task has fewer than ``n`` held-out problems.
        """


# ------------------------------------------------------------------------------------------------
# arithmetic


class GeneratedTask(Task):
    """A task whose problems are drawn from a seeded generator (``arithmetic``, ``chain``).

    Args:
        cfg: the task's config section (``data.arithmetic`` / ``data.chain``).
        num_train: how many train problems one epoch visits (``data.num_train_prompts``).
        seed: the generator's seed for train problems (``data.seed``); held-out problems never
            depend on it.
        heldout_percent: the share of hash buckets held out (``data.heldout_percent``).
    """

    def __init__(self, cfg: Any, num_train: int, seed: int = 0, heldout_percent: int = HELDOUT_PERCENT):
        self.cfg = cfg
        self._num_train = num_train
        self.seed = seed
        self.heldout_percent = heldout_percent

    def num_train(self) -> int:
        return self._num_train


class ArithmeticTask(GeneratedTask):
    """Procedurally generated integer arithmetic: ``What is 37 - 5 * 12?``.

    Operand ``i`` is uniform in ``[0, 10**digits[i] - 1]``; operators are drawn uniformly from
    ``operators``; the gold answer follows the usual precedence (``*`` before ``+``/``-``).
    Train problem ``i`` is drawn from ``Random("arith-train:{seed}:{i}:{attempt}")``, redrawn
    while its hash falls in the held-out buckets; the held-out problems are drawn from a fixed
    stream (``seed``-independent, so every run and every evaluation sees the same held-out set),
    kept only if their hash is held out, de-duplicated.
    """

    name = "arithmetic"
    cfg: ArithmeticConfig

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        terms = [rng.randint(0, 10**d - 1) for d in self.cfg.digits_per_term]
        ops = [rng.choice(self.cfg.operators) for _ in range(self.cfg.n_terms - 1)]
        expr = str(terms[0])
        for op, t in zip(ops, terms[1:]):
            expr += f" {op} {t}"
        # Only digits, spaces and + - * : evaluating it is safe and exact (Python ints).
        value = eval(expr, {"__builtins__": {}}, {})  # noqa: S307
        return expr, int(value)

    def _problem(self, expr: str, value: int, h: str, split: str, index: int) -> Problem:
        meta = {
            "task": self.name,
            "gold": str(value),
            "problem_hash": h,
            "split": split,
            "index": index,
            "expression": expr,
        }
        return Problem(text=f"What is {expr}?", gold=str(value), metadata=meta)

    def train_problem(self, index: int) -> Problem:
        if not 0 <= index < self._num_train:
            raise IndexError(f"train index {index} outside [0, {self._num_train})")
        for attempt in range(1000):
            expr, value = self._draw(random.Random(f"arith-train:{self.seed}:{index}:{attempt}"))
            h = problem_hash(expr)
            if not is_heldout(h, self.heldout_percent):
                return self._problem(expr, value, h, "train", index)
        raise TaskError("could not draw a train problem in 1000 attempts")  # p < 0.1**1000

    def heldout(self, n: int) -> list[Problem]:
        rng = random.Random("arith-heldout")
        seen: set[str] = set()
        out: list[Problem] = []
        max_draws = 200 * n + 10_000
        for _ in range(max_draws):
            if len(out) == n:
                break
            expr, value = self._draw(rng)
            h = problem_hash(expr)
            if is_heldout(h, self.heldout_percent) and h not in seen:
                seen.add(h)
                out.append(self._problem(expr, value, h, "heldout", len(out)))
        if len(out) < n:
            c = self.cfg
            raise TaskError(
                f"the arithmetic task (digits={c.digits}, operators={c.operators!r}, n_terms={c.n_terms}) "
                f"has only about {len(out)} distinct held-out problems ({self.heldout_percent}% held out), "
                f"{n} requested: ask for fewer (data.num_heldout_prompts / --num_problems), raise "
                "data.heldout_percent or make the task larger"
            )
        return out


# ------------------------------------------------------------------------------------------------
# chain: running sums with a heavy-tailed number of steps


def chain_steps(rng: random.Random, cfg: ChainConfig) -> int:
    """Draw a problem's number of steps from the truncated discrete Pareto law of ``cfg``.

    ``steps = min(max_steps, floor(min_steps * U ** (-1 / tail_index)))``, ``U = 1 - rng.random()``
    uniform on ``(0, 1]``; so ``P(steps >= s) = (min_steps / s) ** tail_index`` for
    ``min_steps <= s < max_steps`` and ``P(steps = max_steps) = (min_steps / max_steps) ** tail_index``
    (:class:`asyncrl.core.config.ChainConfig` gives the source of the law).

    Returns:
        The number of additions, in ``[min_steps, max_steps]``.
    """
    u = 1.0 - rng.random()  # (0, 1]: never 0, so the power is finite
    return min(cfg.max_steps, int(cfg.min_steps * u ** (-1.0 / cfg.tail_index)))


def chain_solution(numbers: list[int]) -> str:
    """The worked answer of a chain problem: one line per step, then the ``Answer:`` line.

    ``[3, 5, 2, 7]`` -> ``"3 + 5 = 8\n8 + 2 = 10\n10 + 7 = 17\nAnswer: 17"`` (``len(numbers) - 1``
    step lines). It is the format the system prompt of ``configs/smollm2_longtail.yaml`` shows.

    Raises:
        ValueError: fewer than two numbers.
    """
    if len(numbers) < 2:
        raise ValueError(f"a chain needs at least two numbers, got {numbers}")
    lines, total = [], numbers[0]
    for n in numbers[1:]:
        lines.append(f"{total} + {n} = {total + n}")
        total += n
    lines.append(f"Answer: {total}")
    return "\n".join(lines)


class ChainTask(GeneratedTask):
    """Running sums whose length follows a heavy-tailed law: ``Add these numbers step by step: 3, 5, 2, 7``.

    A problem has ``steps + 1`` numbers, each uniform in ``[1, 10**digits - 1]``; ``steps`` is drawn
    by :func:`chain_steps` (truncated discrete Pareto). The gold answer is the sum; the worked
    answer (:func:`chain_solution`) has one line per step, so the length of a correct response
    grows linearly with ``steps`` (about 10 tokens a step for one-digit numbers with SmolLM2's
    tokenizer): a heavy-tailed step count gives heavy-tailed response lengths.

    Splits as for arithmetic, with one difference: the step count is drawn first and only the
    numbers are redrawn until the problem's hash lands in the wanted split, so both splits follow
    the step-count law exactly (redrawing whole problems would under-represent the short steps,
    whose problem space is small: 729 three-number problems of one-digit numbers). Train problem
    ``i`` uses ``Random("chain-train:{seed}:{i}")``; the held-out problems come from the fixed
    stream ``Random("chain-heldout")`` (seed-independent), distinct by hash.

    Metadata: ``numbers`` (list of ints, ``steps + 1`` of them), ``steps`` (int), ``first_step``
    (``"3 + 5"``, for the assistant prefill ``"{first_step} ="``) and ``numbers_text`` (``"3, 5, 2, 7"``).
    """

    name = "chain"
    cfg: ChainConfig
    _MAX_REDRAWS = 1000

    def _numbers(self, rng: random.Random, steps: int) -> list[int]:
        top = 10**self.cfg.digits - 1
        return [rng.randint(1, top) for _ in range(steps + 1)]

    def _problem(self, numbers: list[int], h: str, split: str, index: int) -> Problem:
        text = ", ".join(str(n) for n in numbers)
        gold = str(sum(numbers))
        meta = {
            "task": self.name,
            "gold": gold,
            "problem_hash": h,
            "split": split,
            "index": index,
            "numbers": list(numbers),
            "numbers_text": text,
            "steps": len(numbers) - 1,
            "first_step": f"{numbers[0]} + {numbers[1]}",
        }
        return Problem(text=f"Add these numbers step by step: {text}", gold=gold, metadata=meta)

    def _draw(self, rng: random.Random, heldout: bool, seen: set[str]) -> Problem | None:
        steps = chain_steps(rng, self.cfg)
        for _ in range(self._MAX_REDRAWS):
            numbers = self._numbers(rng, steps)
            h = problem_hash(", ".join(str(n) for n in numbers))
            if is_heldout(h, self.heldout_percent) == heldout and h not in seen:
                return self._problem(numbers, h, "heldout" if heldout else "train", 0)
        return None

    def train_problem(self, index: int) -> Problem:
        if not 0 <= index < self._num_train:
            raise IndexError(f"train index {index} outside [0, {self._num_train})")
        p = self._draw(random.Random(f"chain-train:{self.seed}:{index}"), heldout=False, seen=set())
        if p is None:  # p < (heldout_percent / 100) ** 1000
            raise TaskError(f"could not draw a chain train problem in {self._MAX_REDRAWS} attempts")
        return Problem(p.text, p.gold, {**p.metadata, "index": index})

    def heldout(self, n: int) -> list[Problem]:
        rng = random.Random("chain-heldout")
        seen: set[str] = set()
        out: list[Problem] = []
        while len(out) < n:
            p = self._draw(rng, heldout=True, seen=seen)
            if p is None:
                c = self.cfg
                raise TaskError(
                    f"the chain task (digits={c.digits}, min_steps={c.min_steps}) ran out of distinct held-out "
                    f"problems after {len(out)} of {n} ({self.heldout_percent}% held out; its shortest problems "
                    "have the smallest space): ask for fewer (data.num_heldout_prompts / --num_problems), raise "
                    "data.heldout_percent, data.chain.digits or data.chain.min_steps"
                )
            seen.add(p.metadata["problem_hash"])
            out.append(Problem(p.text, p.gold, {**p.metadata, "index": len(out)}))
        return out


# ------------------------------------------------------------------------------------------------
# files (GSM8K, JSONL, parquet)

_TEXT_FIELDS = ("question", "problem", "prompt")


def parse_gsm8k_answer(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after ``####``, commas and ``$`` removed.

    ``"Natalia sold 48/2 = 24 clips ... #### 72"`` -> ``"72"``; ``"#### 1,234"`` -> ``"1234"``.

    Raises:
        TaskError: there is no ``####`` or nothing after it.
    """
    if "####" not in answer:
        raise TaskError(f"GSM8K answer has no '####' final-answer marker: {answer[-80:]!r}")
    gold = answer.rsplit("####", 1)[1].replace(",", "").replace("$", "").strip()
    if not gold:
        raise TaskError(f"GSM8K answer has nothing after '####': {answer[-80:]!r}")
    return gold


class FileTask(Task):
    """Problems from a local JSONL or parquet file (read with ``datasets``, no network).

    Each row needs a text field (``question``, or ``problem``/``prompt``) and an ``answer``.
    ``kind="gsm8k"``: the answer is a GSM8K solution and the gold is the text after ``####``
    (required). ``kind="jsonl"``/``"parquet"``: the gold is the answer, or the text after
    ``####`` when present. Other columns are copied into the metadata (JSON-serialisable ones).
    Rows are split by :func:`is_heldout` of their text; the train split keeps file order.
    """

    def __init__(self, path: Path | str, kind: str, heldout_percent: int = HELDOUT_PERCENT):
        self.path = Path(path)
        self.name = kind
        self.heldout_percent = heldout_percent
        if kind not in ("gsm8k", "jsonl", "parquet"):
            raise TaskError(f"unknown file task kind {kind!r}: use gsm8k, jsonl or parquet")
        if not self.path.is_file():
            raise TaskError(f"data.path {str(self.path)!r} does not exist or is not a file")
        rows = self._read()
        self._train: list[Problem] = []
        self._heldout: list[Problem] = []
        for i, row in enumerate(rows):
            p = self._row_problem(i, row)
            (self._heldout if p.metadata["split"] == "heldout" else self._train).append(p)
        if not self._train:
            raise TaskError(f"{self.path}: no train problems ({len(rows)} rows, all held out or empty)")

    def _read(self) -> list[dict[str, Any]]:
        import datasets

        datasets.disable_progress_bars()
        suffix = self.path.suffix.lower()
        if suffix == ".parquet" or (self.name == "parquet" and suffix not in (".jsonl", ".json")):
            builder = "parquet"
        else:
            builder = "json"
        try:
            ds = datasets.load_dataset(builder, data_files=str(self.path), split="train")
        except Exception as exc:  # datasets raises many types for unreadable files
            raise TaskError(f"cannot read {self.path} as {builder}: {type(exc).__name__}: {exc}") from exc
        return [dict(r) for r in ds]

    def _row_problem(self, i: int, row: dict[str, Any]) -> Problem:
        text_key = next((k for k in _TEXT_FIELDS if isinstance(row.get(k), str)), None)
        if text_key is None:
            raise TaskError(f"{self.path} row {i}: needs a text field (one of {', '.join(_TEXT_FIELDS)}); has {sorted(row)}")
        if "answer" not in row or row["answer"] is None:
            raise TaskError(f"{self.path} row {i}: needs an 'answer' field; has {sorted(row)}")
        text, answer = row[text_key], str(row["answer"])
        if self.name == "gsm8k" or "####" in answer:
            try:
                gold = parse_gsm8k_answer(answer)
            except TaskError as exc:
                raise TaskError(f"{self.path} row {i}: {exc}") from None
        else:
            gold = answer.strip()
        h = problem_hash(text)
        meta: dict[str, Any] = {}
        for k, v in row.items():
            if k not in (text_key, "answer"):
                try:
                    json.dumps(v)
                    meta[k] = v
                except TypeError:
                    pass
        meta.update(task=self.name, gold=gold, problem_hash=h, row=i,
                    split="heldout" if is_heldout(h, self.heldout_percent) else "train")
        return Problem(text=text, gold=gold, metadata=meta)

    def num_train(self) -> int:
        return len(self._train)

    def train_problem(self, index: int) -> Problem:
        return self._train[index]

    def heldout(self, n: int) -> list[Problem]:
        # Distinct by hash (duplicate rows would be counted twice otherwise).
        seen: set[str] = set()
        out = []
        for p in self._heldout:
            if p.metadata["problem_hash"] not in seen:
                seen.add(p.metadata["problem_hash"])
                out.append(p)
        if len(out) < n:
            raise TaskError(
                f"{self.path} has {len(out)} distinct held-out problems ({self.heldout_percent}% of rows by hash), "
                f"{n} requested: ask for fewer, raise data.heldout_percent or use a larger file"
            )
        return out[:n]


@register_task("arithmetic")
def arithmetic_task(data: DataConfig, seed: int) -> ArithmeticTask:
    """The built-in ``arithmetic`` task of ``data.arithmetic``; ``seed`` selects its train problems."""
    return ArithmeticTask(data.arithmetic, data.num_train_prompts, seed, data.heldout_percent)


@register_task("chain")
def chain_task(data: DataConfig, seed: int) -> ChainTask:
    """The built-in long-tailed ``chain`` task of ``data.chain``; ``seed`` selects its train problems."""
    return ChainTask(data.chain, data.num_train_prompts, seed, data.heldout_percent)


def _file_task(kind: str) -> Callable[[DataConfig, int], FileTask]:
    """The factory of the built-in file task ``kind`` (``gsm8k``, ``jsonl``, ``parquet``)."""

    def make(data: DataConfig, seed: int) -> FileTask:
        if data.path is None:
            raise TaskError(f"data.task={data.task} needs data.path (a local file)")
        return FileTask(data.path, kind, data.heldout_percent)

    return make


for _kind in FILE_TASKS:
    register_task(_kind, _file_task(_kind))


def load_task(data: DataConfig, seed: int = 0) -> Task:
    """The task named by ``data.task``: a registered one (the built-ins ``arithmetic``, ``chain``,
    ``gsm8k``, ``jsonl``, ``parquet``) or a ``module:Class`` outside asyncrl (:mod:`asyncrl.tasks.registry`).

    ``seed`` selects the arithmetic and chain train problems (the held-out set never depends on it).

    Raises:
        TaskError: an unknown task, a file task without ``data.path``, an unreadable/malformed
            file, or a ``module:Class`` that cannot be imported or does not make a :class:`Task`.
    """
    task = task_factory(data.task)(data, seed)
    if not isinstance(task, Task):
        raise TaskError(f"data.task={data.task} made a {type(task).__name__}, not an asyncrl Task "
                        "(a subclass of asyncrl.tasks.tasks.Task taking (data, seed))")
    return task


# ------------------------------------------------------------------------------------------------
# chat template and the training stream


def render_response_prefix(template: str | None, metadata: dict[str, Any]) -> str:
    """The assistant prefill of one problem: ``template`` formatted with its metadata.

    ``"{expression} ="`` gives ``"37 + 5 ="`` for the arithmetic task. The gold answer is
    withheld (a prefill must not leak it).

    Returns:
        The prefix ("" when ``template`` is None or empty).

    Raises:
        TaskError: the template names a field the problem's metadata lacks, names ``gold``, or is
            not a valid format string.
    """
    if not template:
        return ""
    fields = {k: v for k, v in metadata.items() if k != "gold"}
    try:
        return template.format(**fields)
    except KeyError as exc:
        raise TaskError(
            f"data.response_prefix={template!r} uses {{{exc.args[0]}}}, which this task's problems do not "
            f"provide (available: {', '.join(sorted(fields))}; the gold answer is never available)"
        ) from None
    except (ValueError, IndexError, AttributeError) as exc:
        raise TaskError(f"data.response_prefix={template!r} is not a valid format string: {exc}") from None


def render_prompt(
    tokenizer: Any, problem_text: str, system_prompt: str | None, response_prefix: str = ""
) -> tuple[str, list[int]]:
    """Render one problem with the tokenizer's chat template, ready for generation.

    Messages: an optional system message, then the user message ``problem_text``; rendered with
    ``add_generation_prompt=True``, followed by ``response_prefix`` (an assistant prefill, see
    :func:`render_response_prefix`), and tokenized without adding special tokens again (the
    template already holds them).

    Returns:
        ``(prompt_text, prompt_ids)``.

    Raises:
        TaskError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TaskError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template: "
            "use an instruct model (its tokenizer_config.json must define chat_template)"
        )
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": problem_text}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text += response_prefix
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text, list(ids)


class TrainPromptStream:
    """Deterministic, resumable stream of training prompts.

    ``get(c)`` is the prompt at cursor ``c`` (0-based): epoch ``e = c // N`` visits the task's
    ``N`` train problems in the permutation ``Random("train-order:{seed}:{e}")``, position
    ``c % N``. ``iterate(start_cursor)`` yields ``get(start_cursor), get(start_cursor + 1), ...``
    forever. The controller stores the cursor of the next prompt to feed; resuming from it
    neither skips nor repeats a prompt.

    Args:
        data: the ``data`` config section.
        tokenizer: a Hugging Face tokenizer with a chat template.
        seed: the prompt-stream seed, ``data.seed`` (selects the order, and for arithmetic the train problems).
    """

    def __init__(self, data: DataConfig, tokenizer: Any, seed: int = 0, task: Task | None = None):
        self.data = data
        self.tokenizer = tokenizer
        self.seed = seed
        self.task = task or load_task(data, seed)
        self._epoch: int | None = None
        self._order: list[int] = []

    def __len__(self) -> int:
        """Prompts per epoch."""
        return self.task.num_train()

    def _order_for(self, epoch: int) -> list[int]:
        if self._epoch != epoch:
            order = list(range(self.task.num_train()))
            random.Random(f"train-order:{self.seed}:{epoch}").shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def problem_index(self, cursor: int) -> int:
        """Index of the train problem at ``cursor`` (>= 0): the same problem in every epoch has the same index."""
        if cursor < 0:
            raise ValueError(f"cursor must be >= 0, got {cursor}")
        epoch, pos = divmod(cursor, self.task.num_train())
        return self._order_for(epoch)[pos]

    def get(self, cursor: int) -> Prompt:
        """The prompt at ``cursor`` (>= 0)."""
        if cursor < 0:
            raise ValueError(f"cursor must be >= 0, got {cursor}")
        n = self.task.num_train()
        epoch, pos = divmod(cursor, n)
        base = self.task.train_problem(self._order_for(epoch)[pos])
        meta = {**base.metadata, "epoch": epoch, "cursor": cursor}
        prefix = render_response_prefix(self.data.response_prefix, base.metadata)
        if prefix:
            meta["response_prefix"] = prefix
        problem = Problem(base.text, base.gold, meta)
        text, ids = render_prompt(self.tokenizer, problem.text, self.data.system_prompt, prefix)
        return Prompt(cursor=cursor, problem=problem, prompt_text=text, prompt_ids=ids)

    def iterate(self, start_cursor: int = 0) -> Iterator[Prompt]:
        """Yield prompts from ``start_cursor`` on, forever (epochs repeat in new orders)."""
        cursor = start_cursor
        while True:
            yield self.get(cursor)
            cursor += 1
