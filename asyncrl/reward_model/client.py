"""The rollout worker's side of the reward-model role: :class:`RewardModelClient` and the score's scaling.

A rollout worker scores a completed sample in an executor thread (``RewardScorer.score``,
docs/architecture.md#failed-samples), so the client is synchronous: one ``POST /score`` per
sample over a pooled, thread-safe ``httpx.Client``. The server's dynamic batcher
(:mod:`asyncrl.reward_model.server`) gathers the concurrent requests of every worker into
forward passes.

**The reward-model term** of a sample with raw score ``s`` (the ``reward.model.label_index``
logit of the sequence-classification model on ``prompt + response``)::

    term = clip((s - output_bias) * output_scaling, -max_reward_clip, max_reward_clip)

AReaL's formula for the reward model's output: ``PPOHyperparameters`` documents "the number
outputted by the reward model will be CLIP((x - bias) * scaling, -max_reward_clip,
max_reward_clip)" (``realhf/api/cli_args.py`` and ``realhf/experiments/common/ppo_code_exp.py``
in github.com/inclusionAI/AReaL), and its reward interfaces compute
``(scores - output_bias) * output_scaling`` (``realhf/impl/model/interface/math_rw_interface.py``).
``output_scaling`` is AReaL's ``rm_output_scaling`` (which defaults there to
``ppo.reward_output_scaling``). The term then joins the rule reward
(``reward.model.combine``) and, like every reward, goes through ``data.reward_bias/scale/clip``
in the trainer (docs/reward_model.md).

**Failures** (server unreachable, HTTP 4xx/5xx, no answer within
``reward.model.timeout_seconds``, a malformed answer) raise :class:`RewardModelError`; the
scorer turns it into the sample's error ``RewardModelError: ...``, the sample is FAILED and the
buffer counts it as ``failed_samples:reward_model`` (``buffers/lua/score.lua``).
"""

from __future__ import annotations

import math
import time
from typing import Any

import httpx

__all__ = ["RewardModelError", "RewardModelClient", "scale_score"]


class RewardModelError(RuntimeError):
    """The reward model could not score a text (unreachable, HTTP error, timeout, malformed answer).

    A sample whose error starts with ``RewardModelError:`` is counted by the buffer as
    ``failed_samples:reward_model``.
    """


def scale_score(score: float, scaling: float = 1.0, bias: float = 0.0, clip: float = 20.0) -> float:
    """``clip((score - bias) * scaling, -clip, clip)``: AReaL's processing of a reward model's output.

    Args:
        score: raw score (a logit) of the reward model.
        scaling: ``reward.model.output_scaling`` (AReaL ``rm_output_scaling``), > 0.
        bias: ``reward.model.output_bias``.
        clip: ``reward.model.max_reward_clip`` (AReaL ``ppo.max_reward_clip``), > 0.

    Raises:
        ValueError: ``score`` is not finite.
    """
    if not math.isfinite(score):
        raise ValueError(f"reward model score {score} is not finite")
    return max(-clip, min(clip, (score - bias) * scaling))


class RewardModelClient:
    """Scores texts on a reward-model server (``POST /score``); thread-safe, synchronous.

    Args:
        url: the server, ``http://host:port``.
        api_key: bearer token (``security.api_key``) or None; never logged or put in errors.
        timeout_seconds: limit of one request (connect + queueing + forward pass + answer).
        scaling, bias, clip: the term's processing (:func:`scale_score`).

    Usage::

        rm = RewardModelClient("http://127.0.0.1:30500", timeout_seconds=30)
        rm.wait_ready(600)
        raw = rm.score_texts(["<prompt><response>"])      # [logit]
        term = rm.term("<prompt>", "<response>")          # scaled and clipped
    """

    def __init__(self, url: str, api_key: str | None = None, timeout_seconds: float = 60.0,
                 scaling: float = 1.0, bias: float = 0.0, clip: float = 20.0):
        self.url = url.rstrip("/")
        self.timeout_seconds = float(timeout_seconds)
        self.scaling, self.bias, self.clip = float(scaling), float(bias), float(clip)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout_seconds,
                                  limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

    @classmethod
    def from_config(cls, rm: Any, api_key: str | None = None) -> "RewardModelClient":
        """From the ``reward.model`` config section; ``api_key`` is sent when ``rm.api_key_required``."""
        return cls(rm.server_url, api_key if rm.api_key_required else None, rm.timeout_seconds,
                   rm.output_scaling, rm.output_bias, rm.max_reward_clip)

    def score_texts(self, texts: list[str]) -> list[float]:
        """Raw scores of ``texts`` (one float per text, in order).

        Raises:
            RewardModelError: unreachable, timed out, HTTP error (the server's message is kept),
                or an answer that is not one finite float per text.
        """
        try:
            r = self._http.post("/score", json={"texts": texts})
        except httpx.TimeoutException as exc:
            raise RewardModelError(f"no answer from the reward model at {self.url} within "
                                   f"reward.model.timeout_seconds={self.timeout_seconds:g} s ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            raise RewardModelError(f"reward model at {self.url} unreachable: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            try:
                err = r.json().get("error")
                msg = err.get("message") if isinstance(err, dict) else err
            except ValueError:
                msg = r.text[:200]
            raise RewardModelError(f"reward model at {self.url} answered HTTP {r.status_code}: {msg}")
        try:
            scores = [float(s) for s in r.json()["scores"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise RewardModelError(f"reward model at {self.url} sent a malformed answer: {r.text[:200]!r}") from exc
        if len(scores) != len(texts) or not all(math.isfinite(s) for s in scores):
            raise RewardModelError(f"reward model at {self.url} sent {len(scores)} scores for {len(texts)} texts "
                                   f"(or a non-finite one): {scores[:8]}")
        return scores

    def term(self, prompt: str, response: str) -> float:
        """The reward-model term of one sample: :func:`scale_score` of the score of ``prompt + response``.

        Raises:
            RewardModelError: as :meth:`score_texts`.
        """
        (score,) = self.score_texts([prompt + response])
        return scale_score(score, self.scaling, self.bias, self.clip)

    def health(self) -> bool:
        """True when ``/health`` answers 200 (the model is loaded and the server is not draining)."""
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_seconds: float = 600.0, poll_seconds: float = 0.5) -> None:
        """Block until :meth:`health` is True.

        Raises:
            RewardModelError: not ready within ``timeout_seconds``.
        """
        deadline = time.monotonic() + timeout_seconds
        while not self.health():
            if time.monotonic() >= deadline:
                raise RewardModelError(f"the reward model at {self.url} was not ready within {timeout_seconds:g} s "
                                       "(is `asyncrl reward-model` running, and reward.model.url/port right?)")
            time.sleep(poll_seconds)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()
