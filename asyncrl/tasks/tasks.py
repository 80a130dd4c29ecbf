"""Prompt datasets: GSM8K-format files, local JSONL/parquet files, the task loader and the train-prompt stream.

Every task (:class:`asyncrl.tasks.base.Task`; the generated ``arithmetic`` and ``chain`` tasks are
in :mod:`asyncrl.tasks.generated`) yields :class:`~asyncrl.tasks.base.Problem` records (problem text,
gold answer, a JSON-serialisable metadata dict that travels with the prompt group through Redis to
the reward function), split into a *train* and a *held-out* part. The split is a function of the
problem alone (:mod:`asyncrl.tasks.base`): a problem is held out iff
``sha256(canonical problem) mod 100 < data.heldout_percent`` (default ``HELDOUT_PERCENT`` = 10), so
no problem can be in both splits whatever the seed, the file order or the number of prompts requested.

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

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from asyncrl.core.choices import FILE_TASKS
from asyncrl.core.config import DataConfig
import asyncrl.tasks.generated  # noqa: F401  (registers the built-in arithmetic and chain tasks)
from asyncrl.tasks.base import HELDOUT_PERCENT, Problem, Task, is_heldout, problem_hash, problem_key
from asyncrl.tasks.registry import TaskError, register_task, task_factory

__all__ = [
    "Prompt",
    "TaskError",
    "FileTask",
    "load_task",
    "parse_gsm8k_answer",
    "render_prompt",
    "render_response_prefix",
    "TrainPromptStream",
]


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
                        "(a subclass of asyncrl.tasks.base.Task taking (data, seed))")
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
    tokenizer: Any, problem_text: str, system_prompt: str | None, response_prefix: str = "",
    few_shot: Sequence[Any] = (),
) -> tuple[str, list[int]]:
    """Render one problem with the tokenizer's chat template, ready for generation.

    Messages: an optional system message, then for each ``few_shot`` example (objects with
    ``user`` and ``assistant``, as :class:`asyncrl.core.config.FewShotExample`) a user and an
    assistant turn, then the user message ``problem_text``; rendered with
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
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for ex in few_shot:
        messages += [{"role": "user", "content": ex.user}, {"role": "assistant", "content": ex.assistant}]
    messages.append({"role": "user", "content": problem_text})
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

    def problem_key(self, cursor: int) -> int:
        """Identity of the train problem at ``cursor`` (>= 0): :func:`asyncrl.tasks.base.problem_key` of
        its text, equal at every position where the same problem recurs (within an epoch too: a
        generated task draws its problems with replacement, so ``problem_index`` differs there)."""
        return self.key_of_problem(self.problem_index(cursor))

    def key_of_problem(self, index: int) -> int:
        """:func:`asyncrl.tasks.base.problem_key` of train problem ``index`` (0 <= index < ``len(self)``)."""
        return problem_key(self.task.train_problem(index).text)

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
        text, ids = render_prompt(self.tokenizer, problem.text, self.data.system_prompt, prefix, self.data.few_shot)
        return Prompt(cursor=cursor, problem=problem, prompt_text=text, prompt_ids=ids)

    def iterate(self, start_cursor: int = 0) -> Iterator[Prompt]:
        """Yield prompts from ``start_cursor`` on, forever (epochs repeat in new orders)."""
        cursor = start_cursor
        while True:
            yield self.get(cursor)
            cursor += 1
