"""Trainer-side samples and train batches, and the batch-source protocol.

The buffer (``buffers/``) hands the trainer prompt groups; this module turns them into
:class:`TrainSample` records (plain lists, validated), then into a :class:`TrainBatch`: the
samples in a fixed order (groups in the order the source gave them, samples by index) with
their processed rewards, per-token advantages and per-token loss masks. The order never depends
on anything but the input, so two runs on the same batches see the same micro-batches.

``TrainGroup.from_record`` accepts the buffer's group objects (or dicts) by field name, so
wiring the trainer to the buffer is a thin adapter: any object with ``next_batch()`` (sync or
async) returning a list of groups and ``acknowledge(step)`` is a :class:`BatchSource`.

Loss masks (per response token):
- a failed sample (``error`` set or no reward) is left out of the batch (docs/architecture.md#failed-samples: the
  group trains with the samples that succeeded if at least two remain, else it is skipped);
- ``mask_too_long``: samples with ``finish_reason == "length"`` contribute no loss token (DAPO
  overlong filtering, AReaL ``mask_too_long``); they still count in their group's baseline;
- ``mask_no_eos_with_zero``: samples that did not end with EOS get reward 0 before advantage
  estimation (AReaL ``get_packed_rewards``);
- ``overlong_buffer_len`` > 0: DAPO's soft overlong punishment is added to the raw reward
  (after ``mask_no_eos_with_zero``, before bias/scale/clip; :func:`trainer.advantages.overlong_penalty`);
- ``correction == mask_stale``: tokens whose policy version is older than the weights being
  trained get mask 0 (slime ``--mask-offpolicy-in-partial-rollout``);
- episodes of multi-turn workflows: environment tokens get mask 0 (trainer/episodes.py,
  docs/agents.md); ``agent.representation: stepwise`` then splits each episode into one sample
  per model call.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from asyncrl.core.types import Sample
from asyncrl.tasks.rewards import check_verifier_status
from trainer.advantages import group_advantages, overlong_penalty, process_rewards
from trainer.episodes import (
    apply_grouping_hook,
    check_stepwise_mode,
    env_mask,
    episode_layout,
    expand_stepwise,
    expand_trajectories,
    seg_tuple,
)

__all__ = [
    "BatchError",
    "TrainSample",
    "TrainGroup",
    "BatchSource",
    "PreparedSample",
    "TrainBatch",
    "prepare_batch",
]


class BatchError(ValueError):
    """A group or sample that cannot be trained on; the message names it and what is wrong."""


def _get(record: Any, name: str, default: Any = None) -> Any:
    if isinstance(record, Mapping):
        return record.get(name, default)
    return getattr(record, name, default)


@dataclass
class TrainSample(Sample):
    """One response to train on: the buffer's :class:`~asyncrl.core.types.Sample` plus what training needs.

    Inherited from :class:`~asyncrl.core.types.Sample` (same names, same meaning): ``sample_id``,
    ``group_id`` (used in messages and acknowledgements), ``index`` (position in the group),
    ``response_ids`` (R,), ``behaviour_logprobs`` (R,) log pi_behav per response token (engine,
    fp32), ``versions`` (R,) the policy version of each response token, ``reward`` (None when
    scoring failed), ``advantages`` (optional precomputed: a number or R numbers), ``error``
    (None when fine) and ``info`` (an episode's termination and counts, docs/agents.md).

    Attributes:
        finish_reason: ``stop`` (EOS or stop string, the default here), ``length`` (max_response_len) or other.
        segments: the episode's segments ``(start, end, reason, trajectory)`` (empty: single-turn).
        prompt_ids: (P,) prompt token ids, P >= 1.
        env_spans: ``[start, end)`` ranges of environment tokens of an episode (loss-masked).
        call_spans: ``[start, end)`` ranges of an episode's model calls (empty: single-turn).
    """

    finish_reason: str = "stop"
    segments: list[tuple] = field(default_factory=list)  # type: ignore[assignment]  # plain tuples here
    prompt_ids: list[int] = field(default_factory=list)
    env_spans: list[tuple[int, int]] = field(default_factory=list)
    call_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def eos(self) -> bool:
        """True when the sample ended on its own (EOS or a stop string), not by truncation."""
        return self.finish_reason == "stop"

    def validate(self) -> None:
        """Raise :class:`BatchError` naming the sample if its per-token lists are inconsistent."""
        r = len(self.response_ids)
        if not self.prompt_ids:
            raise BatchError(f"sample {self.sample_id}: empty prompt_ids")
        if len(self.behaviour_logprobs) != r or len(self.versions) != r:
            raise BatchError(
                f"sample {self.sample_id}: {r} response tokens but {len(self.behaviour_logprobs)} behaviour "
                f"logprobs and {len(self.versions)} versions (one of each per response token)"
            )
        if any((not math.isfinite(x)) or x > 1e-4 for x in self.behaviour_logprobs):
            raise BatchError(f"sample {self.sample_id}: behaviour logprobs must be finite and <= 0")
        if any(v < 0 for v in self.versions):
            raise BatchError(f"sample {self.sample_id}: negative policy version")

    @classmethod
    def from_record(cls, record: Any, group_id: str, prompt_ids: Sequence[int]) -> "TrainSample":
        """Build from a buffer sample (object or dict with the buffer's field names)."""
        response = [int(x) for x in _get(record, "response_ids", [])]
        env_spans, call_spans = episode_layout(_get(record, "segments", None) or [], len(response))
        return cls(
            sample_id=str(_get(record, "sample_id")),
            group_id=str(group_id),
            index=int(_get(record, "index", 0)),
            prompt_ids=list(prompt_ids),
            response_ids=response,
            behaviour_logprobs=[float(x) for x in _get(record, "behaviour_logprobs", [])],
            versions=[int(x) for x in _get(record, "versions", [])],
            finish_reason=str(getattr(reason, "value", reason)) if (reason := _get(record, "finish_reason")) else "stop",
            reward=_get(record, "reward"),
            advantages=_get(record, "advantages"),
            error=_get(record, "error"),
            env_spans=env_spans,
            call_spans=call_spans,
            info=_get(record, "info"),
            segments=[seg_tuple(x) for x in (_get(record, "segments", None) or [])]
            if env_spans or call_spans else [],
        )


@dataclass
class TrainGroup:
    """A prompt group: one prompt and its samples (ordered by ``index``)."""

    group_id: str
    prompt_ids: list[int]
    samples: list[TrainSample]
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_record(cls, record: Any) -> "TrainGroup":
        """Build from a buffer group (object or dict with ``group_id``, ``prompt_ids``, ``samples``)."""
        if isinstance(record, TrainGroup):
            return record
        head = _get(record, "group", None) or record  # asyncrl.core.types.BatchGroup wraps a PromptGroup
        gid = _get(head, "group_id")
        if gid is None:
            raise BatchError(f"a batch group has no group_id: {type(record).__name__}")
        gid = str(gid)
        prompt = [int(x) for x in _get(head, "prompt_ids", [])]
        samples = [
            s if isinstance(s, TrainSample) else TrainSample.from_record(s, gid, prompt)
            for s in _get(record, "samples", [])
        ]
        return cls(gid, prompt, sorted(samples, key=lambda s: s.index), dict(_get(head, "metadata", {}) or {}))


@runtime_checkable
class BatchSource(Protocol):
    """Where rank 0 gets train batches (the Redis buffer, or a list in tests).

    ``next_batch()`` (plain or ``async``) returns the next list of prompt groups (objects accepted
    by :meth:`TrainGroup.from_record`), or None when the source is exhausted.
    ``acknowledge(step)`` marks the groups of the last batch as trained by ``step``.
    Optional: ``commit(step)`` after a checkpoint covering ``step``; ``state_dict()`` /
    ``load_state_dict(d)`` for the dataset cursor stored in checkpoints.
    """

    def next_batch(self) -> Any: ...

    def acknowledge(self, step: int) -> Any: ...


@dataclass
class PreparedSample:
    """A sample ready for packing: token ids and per-response-token tensors (all (R,) fp32/long)."""

    sample_id: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    versions: torch.Tensor
    reward: float
    call_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens fed to the model: prompt + response minus the last response token (never an input)."""
        return len(self.prompt_ids) + len(self.response_ids) - 1

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class TrainBatch:
    """Samples of one train batch, in training order, and batch statistics."""

    samples: list[PreparedSample]
    group_ids: list[str]
    stats: dict[str, float]


def _normalize_advantages(prepared: list[PreparedSample], eps: float = 1e-5) -> None:
    """``A <- (A - mean) / (std + eps)`` over the batch's loss tokens (AReaL ``adv_norm``), in place."""
    masked = [p.advantages[p.loss_mask > 0] for p in prepared]
    flat = torch.cat(masked).double() if masked else torch.zeros(0, dtype=torch.float64)
    if flat.numel() == 0:
        return
    mean, std = float(flat.mean()), float(flat.std(unbiased=False))
    for p in prepared:
        p.advantages = ((p.advantages.double() - mean) / (std + eps)).float()


def _staleness_histogram(staleness: list[int]) -> dict[str, float]:
    counts = Counter(min(s, 8) for s in staleness)
    return {f"staleness_tokens_{k if k < 8 else '8plus'}": float(counts.get(k, 0)) for k in range(9) if k in counts}


def _load_hook(spec: str) -> Any:
    from asyncrl.agents.loader import load_callable

    if spec not in _HOOKS:
        _HOOKS[spec] = load_callable(spec, "agent.trajectory_grouping_hook")
    return _HOOKS[spec]


_HOOKS: dict[str, Any] = {}


def _episode_stats(episodes: list[dict], n_train_samples: int) -> dict[str, float]:
    """Means of the episodes' turns, tool calls and replayed calls, and their termination shares."""
    if not episodes:
        return {}
    n = len(episodes)
    out = {
        "episodes": float(n),
        "episode_turns_mean": sum(float(e.get("turns", 0)) for e in episodes) / n,
        "episode_tool_calls_mean": sum(float(e.get("tool_calls", 0)) for e in episodes) / n,
        "episode_replayed_calls": float(sum(float(e.get("replayed_calls", 0)) for e in episodes)),
        "train_samples": float(n_train_samples),
    }
    for term in ("env_done", "turn_limit", "token_limit", "timeout", "error"):
        out[f"episode_{term}_fraction"] = sum(1.0 for e in episodes if e.get("termination") == term) / n
    return out


def prepare_batch(groups: Sequence[Any], cfg: Any, policy_version: int) -> TrainBatch:
    """Validate groups, compute rewards, advantages and loss masks.

    Args:
        groups: prompt groups (buffer objects, dicts or :class:`TrainGroup`).
        cfg: the :class:`asyncrl.core.config.AsyncRLConfig` (``trainer``, ``data``, ``rollout`` sections).
        policy_version: version of the weights being trained (staleness = this - token version).

    Returns:
        the :class:`TrainBatch`.

    Raises:
        BatchError: inconsistent sample lists, a duplicate sample id, or an empty batch.
        trainer.advantages.AdvantageError: malformed precomputed advantages.
        asyncrl.tasks.rewards.VerifierStatusError: ``data.check_verifier_status`` is on and every raw
            reward of the batch's scored samples is 0 (a broken verifier); the trainer exits
            with status 2, which the controller does not restart, and the batch stays in the
            buffer unacknowledged.
    """
    tcfg, dcfg = cfg.trainer, cfg.data
    loss_cfg = tcfg.loss
    per_group = tcfg.advantage in ("grpo", "dr_grpo", "rloo")
    kept: list[TrainGroup] = []
    seen: set[str] = set()
    dropped = 0
    for group in expand_trajectories([TrainGroup.from_record(r) for r in groups]):
        good = []
        for s in group.samples:
            if s.sample_id in seen:
                raise BatchError(f"sample {s.sample_id} appears twice in the batch")
            seen.add(s.sample_id)
            s.validate()
            if s.error is None and (s.reward is not None or s.advantages is not None):
                good.append(s)
        if len(good) < len(group.samples):
            dropped += len(group.samples) - len(good)
        if not good or (per_group and len(good) < 2 and any(s.advantages is None for s in good)):
            warnings.warn(f"group {group.group_id}: fewer than 2 scored samples, skipped (reward_error)", stacklevel=2)
            continue
        kept.append(TrainGroup(group.group_id, group.prompt_ids, good, group.metadata))
    if not kept:
        raise BatchError("no trainable group in the batch (every sample failed or groups too small)")
    agent = getattr(cfg, "agent", None)
    if agent is not None and agent.trajectory_grouping_hook:
        kept = apply_grouping_hook(_load_hook(agent.trajectory_grouping_hook), kept, TrainGroup)
    if dcfg.check_verifier_status:
        check_verifier_status([float(s.reward) for g in kept for s in g.samples if s.reward is not None])

    rewards = []
    for g in kept:
        raw = torch.tensor([float(s.reward) if s.reward is not None else 0.0 for s in g.samples])
        if loss_cfg.mask_no_eos_with_zero:
            raw = torch.where(torch.tensor([s.eos for s in g.samples]), raw, torch.zeros_like(raw))
        if loss_cfg.overlong_buffer_len > 0:
            lengths = torch.tensor([len(s.response_ids) for s in g.samples])
            raw = raw + overlong_penalty(lengths, cfg.rollout.max_response_len, loss_cfg.overlong_buffer_len,
                                         loss_cfg.overlong_penalty_factor)
        rewards.append(process_rewards(raw, bias=dcfg.reward_bias, scale=dcfg.reward_scale, clip=dcfg.reward_clip))
    if tcfg.advantage == "gae":
        # placeholders: the critic (trainer/critic.py) sets per-token GAE advantages in begin_step
        advantages = [[torch.zeros(len(s.response_ids)) for s in g.samples] for g in kept]
    else:
        advantages = group_advantages(
            tcfg.advantage,
            [r.tolist() for r in rewards],
            [[len(s.response_ids) for s in g.samples] for g in kept],
            [[s.advantages for s in g.samples] for g in kept],
            [[s.sample_id for s in g.samples] for g in kept],
            mode=tcfg.precomputed_advantages,
        )

    prepared: list[PreparedSample] = []
    staleness: list[int] = []
    for g, rew, advs in zip(kept, rewards, advantages):
        for s, r, a in zip(g.samples, rew.tolist(), advs):
            versions = torch.tensor(s.versions, dtype=torch.long)
            model_tokens = env_mask(len(s.response_ids), s.env_spans)  # episodes: environment tokens untrained
            mask = model_tokens.clone()
            if loss_cfg.mask_too_long and s.finish_reason == "length":
                mask.zero_()
            if loss_cfg.correction == "mask_stale":
                mask = mask * (versions >= policy_version).float()
            staleness += (policy_version - versions[model_tokens > 0]).clamp(min=0).tolist()
            prepared.append(PreparedSample(
                s.sample_id, g.group_id, list(s.prompt_ids), list(s.response_ids),
                torch.tensor(s.behaviour_logprobs, dtype=torch.float32), a, mask, versions, float(r),
                list(s.call_spans),
            ))
    if tcfg.adv_norm and tcfg.advantage != "gae":  # gae: normalised by the critic, after GAE
        _normalize_advantages(prepared)
    n_trajectories = len(prepared)
    episodes = [s.info for g in kept for s in g.samples if s.info is not None]
    if agent is not None and agent.representation == "stepwise":
        prepared = expand_stepwise(prepared, check_stepwise_mode(agent.stepwise_mode))
    all_adv = torch.cat([p.advantages for p in prepared]) if prepared else torch.zeros(0)
    all_rew = torch.tensor([p.reward for p in prepared])
    stats = {
        "reward_mean": float(all_rew.mean()),
        "reward_std": float(all_rew.std()) if len(prepared) > 1 else 0.0,
        "advantage_mean": float(all_adv.mean()) if all_adv.numel() else 0.0,
        "advantage_std": float(all_adv.std()) if all_adv.numel() > 1 else 0.0,
        "advantage_min": float(all_adv.min()) if all_adv.numel() else 0.0,
        "advantage_max": float(all_adv.max()) if all_adv.numel() else 0.0,
        "groups": float(len(kept)),
        "samples": float(len(prepared)),
        "samples_failed": float(dropped),
        "response_tokens": float(sum(len(p.response_ids) for p in prepared)),
        "loss_tokens": float(sum(p.num_loss_tokens for p in prepared)),
        "staleness_max": float(max(staleness)) if staleness else 0.0,
        "staleness_mean": float(sum(staleness) / len(staleness)) if staleness else 0.0,
        "truncated_fraction": sum(1.0 for g in kept for s in g.samples if not s.eos) / n_trajectories,
        **_staleness_histogram(staleness),
        **_episode_stats(episodes, len(prepared)),
    }
    return TrainBatch(prepared, [g.group_id for g in kept], stats)
