"""Reward functions: the math answer verifier, the format reward, user functions, reward processing.

A reward function has the signature ``fn(prompt: str, response: str, metadata: dict) -> float``
(``metadata`` is the task's :class:`asyncrl.tasks.base.Problem` metadata: ``task``, ``gold``,
``problem_hash``, ...). :class:`RewardScorer` runs the configured one and never raises: a
function that raises, returns a non-number, hangs the verifier, or (a user function) does not
return within ``data.reward_timeout_seconds`` gives a :class:`RewardResult` with ``error`` set
(``RewardTimeout: ...`` for the last), and the rollout worker marks the sample FAILED
(docs/architecture.md#failed-samples).

**Answer extraction** (one function, :func:`check_answer`, for training and evaluation alike):
the *answer region* of a response is the rest of the line after its last ``Answer:`` (case
insensitive) when that line is non-empty, otherwise the whole response. math-verify's
``parse`` (LaTeX and plain-expression extraction; with several candidates it takes the last
one) turns the region into a value and ``verify`` compares it with ``parse(gold)``. When the
gold is a number, the extraction must be a number written out: math-verify would otherwise
accept ``51 - 93`` (the question restated, e.g. by a truncated response) as equal to ``-42``.
A response is *format compliant* when it has an ``Answer:`` line holding such a final answer;
the format reward is reported separately from correctness.

**Guarding math-verify.** math-verify bounds its sympy work with ``signal.alarm``, which only
works in a process's main thread (elsewhere it refuses with ``ValueError``). On the main thread
we call it with ``parsing_timeout = verify timeout = 2 s`` (a timed-out check counts as
"no answer"/"wrong"); from any other thread the same call runs in a spawned helper process
(``python -m asyncrl.tasks.rewards --verify-worker``, itself signal-guarded) with a hard limit of
``HARD_TIMEOUT_SECONDS``, after which the helper is killed and the sample fails with a timeout
error. Regions are cut to their last ``MAX_REGION_CHARS`` characters before parsing.

**Reward model.** With ``reward.model`` set, :class:`RewardScorer` also asks the reward-model
role (:mod:`asyncrl.reward_model`) for the sample's term and replaces or adds to the rule
reward (``reward.model.combine``); its failures give ``RewardModelError: ...`` errors
(docs/reward_model.md).

**Processing** (PPO practice; AReaL's ``output_scaling``/``output_bias``):
``r' = clip((r - bias) * scale, -clip, +clip)``, and :func:`check_verifier_status` raises when
every raw reward of a batch is zero (AReaL's ``check_verifier_status``: a broken verifier
otherwise trains silently on nothing).
"""

from __future__ import annotations

import atexit
import importlib
import json
import math
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

__all__ = [
    "ANSWER_MARKER",
    "AnswerCheck",
    "RewardFn",
    "RewardResult",
    "RewardError",
    "RewardTimeout",
    "VerifierStatusError",
    "answer_region",
    "check_answer",
    "math_verify_reward",
    "format_reward",
    "load_reward_fn",
    "RewardScorer",
    "process_reward",
    "process_rewards",
    "check_verifier_status",
]

#: The marker the system prompt asks for; the answer is the rest of its line.
ANSWER_MARKER = "Answer:"
#: Only the last this-many characters of an answer region are given to math-verify.
MAX_REGION_CHARS = 1000
#: math-verify's own (signal.alarm) limits, seconds; integers because alarm() takes integers.
PARSE_TIMEOUT_SECONDS = 2
VERIFY_TIMEOUT_SECONDS = 2
#: Limit of a check run in the helper process (off the main thread), seconds.
HARD_TIMEOUT_SECONDS = 10.0
#: Default limit of one call of a user reward function, seconds (``data.reward_timeout_seconds``).
DEFAULT_REWARD_TIMEOUT_SECONDS = 60.0
#: Timed-out user calls still running (their threads cannot be killed) beyond which new calls fail at once.
MAX_ABANDONED_CALLS = 16

RewardFn = Callable[[str, str, dict], float]
"""``fn(prompt, response, metadata) -> float``."""

_MARKER_RE = re.compile(re.escape(ANSWER_MARKER), re.IGNORECASE)
_LEADING_SIGN_RE = re.compile(r"^-\s+(\d)")


class RewardError(ValueError):
    """A reward function spec that cannot be used (bad ``module:function``, not importable, not callable)."""


class RewardTimeout(TimeoutError):
    """A user reward function did not return within ``data.reward_timeout_seconds``.

    Its sample's error starts with ``RewardTimeout:``; the buffer counts such failures as
    ``failed_samples:reward_timeout`` (buffers/lua/score.lua).
    """


class VerifierStatusError(RuntimeError):
    """Every reward of a batch is zero: the verifier is probably broken (``data.check_verifier_status``)."""


# ------------------------------------------------------------------------------------------------
# answer extraction (the one function used by training and evaluation)


def answer_region(response: str) -> tuple[str, bool]:
    """The part of a response that holds its final answer.

    Returns:
        ``(region, has_marker)``: the rest of the line after the last ``Answer:`` and True when
        that is non-empty; else the whole response and False. Cut to its last
        ``MAX_REGION_CHARS`` characters; a typographic minus becomes ``-``, and ``- 42`` at the
        start of an answer line becomes ``-42``.
    """
    response = response.replace("\u2212", "-")  # typographic minus
    matches = list(_MARKER_RE.finditer(response))
    if matches:
        tail = response[matches[-1].end():].lstrip(" \t*:")
        line = _LEADING_SIGN_RE.sub(r"-\1", tail.split("\n", 1)[0].strip())
        if line:
            return line[-MAX_REGION_CHARS:], True
    return response[-MAX_REGION_CHARS:], False


_FRACTION_RE = re.compile(r"^-?\d+\s*/\s*\d+$")


def _is_literal(value: Any, text: str) -> bool:
    """A number written out (``-42``, ``3.5``, ``\\frac{2}{3}``, ``1/2``), not an expression of numbers."""
    import sympy

    return isinstance(value, sympy.Number) or bool(_FRACTION_RE.match(text.strip()))


def _mv_check(region: str, gold: str | None) -> tuple[str | None, bool, bool]:
    """math-verify on one answer region: ``(extracted text, final, correct)``.

    ``final``: the extraction is a final answer: a literal number when the gold is a number
    (``51 - 93`` restates the question; it is not an answer to it), anything parseable otherwise.
    ``correct``: ``final`` and math-verify ``verify(gold, extracted)``.
    """
    from math_verify import parse, verify

    pred = parse(region, parsing_timeout=PARSE_TIMEOUT_SECONDS)
    if not pred:
        return None, False, False
    extracted = str(pred[-1])
    literal = _is_literal(pred[0], extracted)
    if gold is None:
        return extracted, True, False
    gold_parsed = parse(gold, parsing_timeout=PARSE_TIMEOUT_SECONDS) or parse(
        f"${gold}$", parsing_timeout=PARSE_TIMEOUT_SECONDS
    )  # bare LaTeX such as \sqrt{2} parses only inside math delimiters
    if not gold_parsed:
        return extracted, literal, False
    final = literal or not _is_literal(gold_parsed[0], str(gold_parsed[-1]))
    if not final:
        return extracted, False, False
    return extracted, True, bool(verify(gold_parsed, pred, timeout_seconds=VERIFY_TIMEOUT_SECONDS))


class _VerifyHelper:
    """A ``python -m asyncrl.tasks.rewards --verify-worker`` child answering checks over JSON lines.

    A plain subprocess (not ``multiprocessing``), so it works whatever the host's ``__main__``
    is, and it can be killed when a check exceeds its limit.
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.tasks.rewards", "--verify-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def call(self, region: str, gold: str | None, timeout_seconds: float) -> tuple[str | None, bool, bool]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"region": region, "gold": gold}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_seconds)
        if not ready:
            self.close()
            raise TimeoutError(f"math-verify did not answer within {timeout_seconds} s (helper process killed)")
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise OSError(f"the math-verify helper process exited (code {self.proc.returncode})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"math-verify failed: {reply['error']}")
        return reply["extracted"], reply["final"], reply["correct"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_helper_lock = threading.Lock()
_helper: _VerifyHelper | None = None


def _close_helper() -> None:
    global _helper
    with _helper_lock:
        if _helper is not None:
            _helper.close()
            _helper = None


atexit.register(_close_helper)


def _guarded_check(region: str, gold: str | None) -> tuple[str | None, bool, bool]:
    global _helper
    if threading.current_thread() is threading.main_thread():
        return _mv_check(region, gold)
    with _helper_lock:  # one helper, one check at a time (a check takes ~1 ms)
        if _helper is None or _helper.proc.poll() is not None:
            _helper = _VerifyHelper()
        try:
            return _helper.call(region, gold, HARD_TIMEOUT_SECONDS)
        except (TimeoutError, OSError, ValueError):
            _helper.close()
            _helper = None
            raise


def _verify_worker() -> None:
    """Loop of the helper process: one JSON request per stdin line, one JSON reply per stdout line."""
    for line in sys.stdin:
        req = json.loads(line)
        try:
            extracted, final, correct = _mv_check(req["region"], req["gold"])
            reply: dict[str, Any] = {"extracted": extracted, "final": final, "correct": correct}
        except Exception as exc:  # reported to the caller, who marks the sample failed
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


@dataclass(frozen=True)
class AnswerCheck:
    """Result of :func:`check_answer`.

    Attributes:
        extracted: the parsed final answer as text, or None when nothing parseable was found.
        correct: the extracted answer equals the gold (math-verify ``verify``).
        format_ok: the response has an ``Answer:`` line holding a final answer (a number, when
            the gold is a number).
    """

    extracted: str | None
    correct: bool
    format_ok: bool


def check_answer(response: str, gold: str | None) -> AnswerCheck:
    """Extract a response's final answer and compare it with ``gold`` (see the module docstring).

    Args:
        response: the generated response text (no prompt).
        gold: the gold answer (``"68"``, ``"\\frac{1}{2}"``), or None to only extract.

    Raises:
        TimeoutError: off the main thread, the helper process exceeded ``HARD_TIMEOUT_SECONDS``.
    """
    region, has_marker = answer_region(response)
    extracted, final, correct = _guarded_check(region, gold)
    return AnswerCheck(extracted=extracted, correct=correct, format_ok=has_marker and final)


# ------------------------------------------------------------------------------------------------
# built-in reward functions


def _gold(metadata: dict) -> str:
    gold = metadata.get("gold")
    if gold is None or str(gold).strip() == "":
        raise ValueError("task metadata has no 'gold' answer; math_verify needs one")
    return str(gold)


def math_verify_reward(prompt: str, response: str, metadata: dict) -> float:
    """1.0 when the response's final answer equals ``metadata["gold"]`` (math-verify), else 0.0."""
    return 1.0 if check_answer(response, _gold(metadata)).correct else 0.0


def format_reward(prompt: str, response: str, metadata: dict) -> float:
    """1.0 when the response states its final answer on an ``Answer:`` line (see :func:`check_answer`)."""
    gold = metadata.get("gold")
    return 1.0 if check_answer(response, None if gold is None else str(gold)).format_ok else 0.0


_BUILTINS: dict[str, RewardFn] = {"math_verify": math_verify_reward, "format": format_reward}
#: built-in rewards that live in modules of their own, loaded by name like a user function; like
#: ``math_verify`` they run without a thread and a timeout, and score exactly 1.0 for a right answer
#: (the scorer reports that as ``correct``)
_NAMED: dict[str, str] = {"chain_partial": "asyncrl.tasks.chain_reward:chain_partial_reward",
                          "chain_partial_matched": "asyncrl.tasks.chain_reward:chain_partial_matched_reward"}


def load_reward_fn(spec: str) -> RewardFn:
    """A reward function by name: ``math_verify``, ``format``, ``chain_partial``, ``chain_partial_matched`` or a
    user ``module:function``.

    Raises:
        RewardError: the spec is malformed, the module cannot be imported, the attribute does
            not exist or is not callable. The message says which and what to fix.
    """
    if spec in _BUILTINS:
        return _BUILTINS[spec]
    spec = _NAMED.get(spec, spec)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(
            f"data.reward={spec!r}: use 'math_verify', 'format', 'chain_partial', 'chain_partial_matched' or a user function "
            "as 'module:function' "
            "(e.g. 'my_rewards:score')"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise RewardError(
            f"data.reward={spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
            "is it installed or on PYTHONPATH?"
        ) from exc
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardError(f"data.reward={spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardError(f"data.reward={spec!r}: {attr!r} is a {type(fn).__name__}, not a callable")
    return fn


# ------------------------------------------------------------------------------------------------
# scoring that never raises


@dataclass(frozen=True)
class RewardResult:
    """The outcome of scoring one sample.

    Attributes:
        reward: raw reward (reward function + ``format_reward_weight`` * format); 0.0 when failed.
        correct: the math-verify correctness (1.0/0.0) when the reward function is the built-in
            verifier or a named built-in such as ``chain_partial``, else None.
        format: format compliance (1.0/0.0), reported separately from correctness.
        error: None, or ``"ExceptionType: message"`` when the reward function failed (the
            sample is then FAILED and not trained).
        elapsed_seconds: wall time of the scoring.
    """

    reward: float
    correct: float | None
    format: float
    error: str | None
    elapsed_seconds: float

    @property
    def failed(self) -> bool:
        """True when the reward function raised, timed out or returned a non-number."""
        return self.error is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (stored with the sample)."""
        return asdict(self)


class RewardScorer:
    """Scores samples with the configured reward function; never raises.

    ``reward = fn(prompt, response, metadata) + format_reward_weight * format``, where
    ``response`` is the assistant's whole turn: ``metadata["response_prefix"]`` (the assistant
    prefill of ``data.response_prefix``, when the task has one) followed by the generated text.

    A user function runs in a thread of its own and gets ``timeout_seconds`` per call: a call
    that has not returned by then fails its sample with a :class:`RewardTimeout` error and is
    abandoned (a Python thread cannot be killed; it is a daemon thread, so it never holds up
    the process's exit). While ``MAX_ABANDONED_CALLS`` abandoned calls are still running, new
    calls fail at once with the same error instead of piling up threads. The built-in
    functions are bounded by math-verify's own limits instead.

    With a reward model (``reward_model``, docs/reward_model.md) its term
    ``clip((score - bias) * scaling, ±clip)`` (:class:`asyncrl.reward_model.RewardModelClient`)
    either replaces ``fn`` (``combine="replace"``: ``reward = term + format_reward_weight *
    format``, ``fn`` is not called) or is added to it (``combine="add"``). A reward model that
    fails (unreachable, HTTP error, ``reward.model.timeout_seconds`` passed) fails the sample
    with ``RewardModelError: ...`` (counted as ``failed_samples:reward_model``).

    Args:
        reward: ``data.reward`` (``math_verify``, ``format`` or ``module:function``).
        format_reward_weight: ``data.format_reward_weight``.
        timeout_seconds: ``data.reward_timeout_seconds``; None: no limit.
        reward_model: a :class:`asyncrl.reward_model.RewardModelClient` (or anything with its
            ``term(prompt, response) -> float``), or None.
        combine: ``reward.model.combine``, ``replace`` or ``add``.

    Raises:
        RewardError: at construction, when ``reward`` cannot be loaded (a run must not start
            with a reward function that can never work).
    """

    def __init__(self, reward: str = "math_verify", format_reward_weight: float = 0.0,
                 timeout_seconds: float | None = DEFAULT_REWARD_TIMEOUT_SECONDS, reward_model: Any = None,
                 combine: str = "replace"):
        if combine not in ("replace", "add"):
            raise RewardError(f"reward.model.combine={combine!r}: use 'replace' or 'add'")
        self.reward_model, self.combine = reward_model, combine
        self.spec = reward
        self.fn = load_reward_fn(reward)
        self.format_reward_weight = float(format_reward_weight)
        if timeout_seconds is not None and not (math.isfinite(timeout_seconds) and timeout_seconds > 0):
            raise RewardError(f"data.reward_timeout_seconds must be a positive number of seconds, got {timeout_seconds!r}")
        self.timeout_seconds = timeout_seconds
        self._named = reward in _NAMED  # a built-in of its own module (not a user function)
        self._user = all(self.fn is not f for f in _BUILTINS.values()) and not self._named
        self._lock = threading.Lock()
        self._abandoned = 0  # timed-out calls whose threads are still running

    @classmethod
    def from_config(cls, data: Any, reward: Any = None, api_key: str | None = None) -> "RewardScorer":
        """From the ``data`` config section and, when ``reward.model`` is enabled, a reward-model client
        (``api_key``: ``security.api_key``, sent when ``reward.model.api_key_required``)."""
        from asyncrl.core.secret_values import reveal

        api_key = reveal(api_key)  # a SecretStr from the config, or plain text
        rm = None
        if reward is not None and reward.model.enabled:
            from asyncrl.reward_model import RewardModelClient

            rm = RewardModelClient.from_config(reward.model, api_key)
        return cls(data.reward, data.format_reward_weight, data.reward_timeout_seconds, rm,
                   reward.model.combine if rm is not None else "replace")

    def close(self) -> None:
        """Close the reward-model client's connections (no-op without one)."""
        if self.reward_model is not None and hasattr(self.reward_model, "close"):
            self.reward_model.close()

    @property
    def abandoned_calls(self) -> int:
        """Timed-out calls of the user function that are still running."""
        return self._abandoned

    def _call_user(self, prompt: str, response: str, metadata: dict) -> Any:
        """``self.fn(...)`` in a daemon thread, waited for at most ``timeout_seconds``.

        Raises:
            RewardTimeout: the call did not return in time (it is abandoned), or too many
                earlier calls are still running past their limit.
            Exception: whatever the function raised.
        """
        if self.timeout_seconds is None or not self._user:
            return self.fn(prompt, response, metadata)
        with self._lock:
            if self._abandoned >= MAX_ABANDONED_CALLS:
                raise RewardTimeout(
                    f"reward function {self.spec!r}: {self._abandoned} earlier calls are still running past "
                    f"data.reward_timeout_seconds={self.timeout_seconds:g}; not starting another until one returns"
                )
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = self.fn(prompt, response, metadata)
            except BaseException as exc:  # handed to the caller (if it still waits)
                box["error"] = exc
            finally:
                with self._lock:
                    box["finished"] = True
                    if box.get("abandoned"):
                        self._abandoned -= 1
                done.set()

        threading.Thread(target=run, name="asyncrl-reward-fn", daemon=True).start()
        if not done.wait(self.timeout_seconds):
            with self._lock:
                if not box.get("finished"):
                    box["abandoned"] = True
                    self._abandoned += 1
                    raise RewardTimeout(
                        f"reward function {self.spec!r} did not return within data.reward_timeout_seconds="
                        f"{self.timeout_seconds:g} s (the call is abandoned)"
                    )
        if "error" in box:
            raise box["error"]
        return box["value"]

    def score(self, prompt: str, response: str, metadata: dict) -> RewardResult:
        """Score one sample (see the class docstring); errors come back in ``result.error``."""
        start = time.perf_counter()
        response = str(metadata.get("response_prefix") or "") + response
        try:
            if self.reward_model is not None and self.combine == "replace":
                value, correct = self.reward_model.term(prompt, response), None
                fmt = format_reward(prompt, response, metadata)
            elif self.fn is math_verify_reward:
                check = check_answer(response, _gold(metadata))
                value, correct, fmt = float(check.correct), float(check.correct), float(check.format_ok)
            else:
                raw = self._call_user(prompt, response, metadata)
                if not isinstance(raw, (int, float)) and not hasattr(raw, "__float__"):
                    raise TypeError(f"reward function {self.spec!r} returned {raw!r}; expected a float")
                value = float(raw)
                if not math.isfinite(value):
                    raise ValueError(f"reward function {self.spec!r} returned {value}; expected a finite float")
                correct = float(value >= 1.0) if self._named else None  # 1.0 only when right
                fmt = value if self.fn is format_reward else format_reward(prompt, response, metadata)
            if self.reward_model is not None and self.combine == "add":
                value += self.reward_model.term(prompt, response)
        except Exception as exc:  # a reward function must never crash a run
            return RewardResult(0.0, None, 0.0, f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
        return RewardResult(
            reward=value + self.format_reward_weight * fmt,
            correct=correct,
            format=fmt,
            error=None,
            elapsed_seconds=time.perf_counter() - start,
        )


# ------------------------------------------------------------------------------------------------
# processing


def process_reward(raw: float, scale: float = 1.0, bias: float = 0.0, clip: float = 10.0) -> float:
    """``clip((raw - bias) * scale, -clip, clip)`` (PPO reward scaling/bias/clip; AReaL output_scaling/bias).

    The one place of reward shaping: the trainer applies it to each reward of a batch
    (:func:`trainer.advantages.process_rewards`).
    """
    return max(-clip, min(clip, (raw - bias) * scale))


def process_rewards(raw: Sequence[float], data: Any) -> list[float]:
    """:func:`process_reward` of each raw reward with ``data.reward_scale/reward_bias/reward_clip``."""
    return [process_reward(r, data.reward_scale, data.reward_bias, data.reward_clip) for r in raw]


def check_verifier_status(raw_rewards: Sequence[float], what: str = "train batch") -> None:
    """Raise when every raw reward of a batch is zero (AReaL's ``check_verifier_status``).

    Call it on the raw rewards of the samples that succeeded (failed samples are excluded),
    before processing. Note the false-alarm rate: with accuracy ``a`` and ``k`` independent
    samples it is ``(1 - a)**k``; prompt groups are correlated, so use batches large enough
    (or turn ``data.check_verifier_status`` off) for tasks the model rarely solves.

    Raises:
        VerifierStatusError: ``raw_rewards`` is non-empty and all zero.
    """
    if raw_rewards and all(r == 0 for r in raw_rewards):
        raise VerifierStatusError(
            f"every reward of the {what} ({len(raw_rewards)} samples) is 0: the verifier is probably "
            "broken (check data.reward, the answer format asked by data.system_prompt and the gold answers), "
            "or the task is too hard for the model; set data.check_verifier_status=false to train anyway"
        )


if __name__ == "__main__" and sys.argv[1:] == ["--verify-worker"]:
    _verify_worker()
