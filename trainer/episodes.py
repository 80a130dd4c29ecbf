"""Episodes in the trainer: loss masks, the ``concat``/``stepwise`` representations, the grouping hook.

An episode arrives as one buffer sample (docs/agents.md): its response is the conversation after
the prompt, model calls and environment observations in order, and its segments say which is
which (``obs`` segments hold environment tokens; ``turn`` closes a model call).

* **Loss mask**: environment tokens get mask 0 in both representations (only model tokens are
  trained); staleness statistics count model tokens only.
* ``concat`` (default): the episode is one training sample, the whole conversation.
* ``stepwise``: each model call is its own sample, whose prompt is the episode's prompt plus
  every token before the call (exact ids, so the model sees the context the engine saw) and
  whose response is the call's tokens. ``stepwise_mode: broadcast``: every step carries the
  trajectory's advantage (per token, as computed for the episode); per-step advantages come
  from the workflow (``step.advantages``) or a grouping hook.
* ``trajectory_grouping_hook``: ``module:function`` called with the batch's
  :class:`trainer.batch.TrainGroup` list (one per prompt group, samples = episodes with their
  rewards, ``info`` and ``call_spans``) before advantages are computed; it returns the groups to
  train — it may regroup episodes, change rewards, or set ``advantages`` (then validated as any
  precomputed advantages: all valid -> the estimator is skipped; some -> warning and fallback;
  wrong length -> an error naming the sample).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

__all__ = ["episode_layout", "check_stepwise_mode", "expand_stepwise", "apply_grouping_hook", "expand_trajectories",
           "seg_tuple"]


def _seg_fields(seg: Any) -> tuple[int, int, str]:
    return seg_tuple(seg)[:3]  # type: ignore[return-value]


def seg_tuple(seg: Any) -> tuple[int, int, str, int]:
    """``(start, end, finish_reason, trajectory)`` of a segment given as an object, tuple or dict."""
    if isinstance(seg, (tuple, list)):
        return int(seg[0]), int(seg[1]), str(seg[2]), int(seg[3]) if len(seg) > 3 else 0
    if isinstance(seg, dict):
        return int(seg["start"]), int(seg["end"]), str(seg["finish_reason"]), int(seg.get("trajectory", 0))
    return int(seg.start), int(seg.end), str(seg.finish_reason), int(getattr(seg, "trajectory", 0))


def expand_trajectories(groups: list[Any]) -> list[Any]:
    """Split episodes with several trajectories into one sample per trajectory (docs/agents.md).

    ``groups`` are :class:`trainer.batch.TrainGroup` s; the new samples and groups are copies
    (:func:`dataclasses.replace`) of the episode's. Trajectory 0 keeps the group (its prompt is the group's); trajectory k of every episode of
    the group forms the group ``<group_id>~<name>``, each sample's prompt being its ``ctx``
    segment. A sample's response is the concatenation of its trajectory's segments; its reward
    is ``info["trajectory_rewards"][k]`` (the episode's reward when absent); per-token
    precomputed advantages are sliced the same way. Groups without such episodes pass unchanged.

    Raises:
        ValueError: a trajectory whose first segment is not its prompt (``ctx``), or episodes of
            one group whose trajectory names differ.
    """
    out: list[Any] = []
    for g in groups:
        multi = any(any(seg_tuple(x)[3] > 0 for x in (s.segments or [])) for s in g.samples)
        if not multi:
            out.append(g)
            continue
        by_traj: dict[int, list[Any]] = {}
        names: dict[int, str] = {0: "main"}
        for s in g.samples:
            segs = [seg_tuple(x) for x in s.segments]
            info = s.info or {}
            tnames = list(info.get("trajectories") or ["main"])
            trewards = list(info.get("trajectory_rewards") or [])
            for k in sorted({t for *_, t in segs} | {0}):
                own = [x for x in segs if x[3] == k]
                if k == 0:
                    prompt = list(s.prompt_ids)
                else:
                    if not own or own[0][2] != "ctx":
                        raise ValueError(f"sample {s.sample_id}: trajectory {k} does not start with its prompt (ctx)")
                    prompt = list(s.response_ids[own[0][0]:own[0][1]])
                    own = own[1:]
                name = tnames[k] if k < len(tnames) else f"t{k}"
                if names.setdefault(k, name) != name:
                    raise ValueError(f"group {g.group_id}: trajectory {k} is {names[k]!r} in one episode and {name!r} "
                                     "in another; open trajectories in the same order in every episode")
                idx = [i for a, b, _, _ in own for i in range(a, b)]
                local, pos = [], 0
                for a, b, r, _ in own:
                    local.append((pos, pos + (b - a), r))
                    pos += b - a
                env, calls = episode_layout(local, pos)
                adv = s.advantages
                if isinstance(adv, list):
                    adv = [adv[i] for i in idx]
                reward = trewards[k] if k < len(trewards) else s.reward
                by_traj.setdefault(k, []).append(dataclasses.replace(
                    s, sample_id=s.sample_id if k == 0 else f"{s.sample_id}~{name}", group_id=g.group_id, index=s.index,
                    prompt_ids=prompt, response_ids=[s.response_ids[i] for i in idx],
                    behaviour_logprobs=[s.behaviour_logprobs[i] for i in idx], versions=[s.versions[i] for i in idx],
                    finish_reason=s.finish_reason, reward=reward, advantages=adv, error=s.error,
                    env_spans=env, call_spans=calls, info=s.info if k == 0 else None, segments=local))
        for k in sorted(by_traj):
            gid = g.group_id if k == 0 else f"{g.group_id}~{names[k]}"
            samples = by_traj[k]
            for smp in samples:
                smp.group_id = gid
            out.append(dataclasses.replace(g, group_id=gid, prompt_ids=samples[0].prompt_ids if k == 0 else list(g.prompt_ids),
                                           samples=samples))
    return out


def episode_layout(segments: Sequence[Any], response_len: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Environment spans and model-call spans of an episode's response.

    Args:
        segments: the sample's segments (:class:`asyncrl.core.types.Segment`, ``(start, end, reason)``
            tuples or dicts), in order.
        response_len: R, the response length.

    Returns:
        ``(env_spans, call_spans)``: half-open ``[start, end)`` token ranges of environment
        observations and of model calls. Both empty for a single-turn sample (no ``obs`` or
        ``turn`` segment).
    """
    segs = [_seg_fields(s) for s in segments]
    if not any(r in ("obs", "turn", "ctx") for _, _, r in segs):
        return [], []
    env: list[tuple[int, int]] = []
    calls: list[tuple[int, int]] = []
    open_start: int | None = None
    pos = 0
    for start, end, reason in segs:
        pos = max(pos, end)
        if reason in ("obs", "ctx"):
            if open_start is not None and start > open_start:
                calls.append((open_start, start))
            open_start = None
            env.append((start, end))
            continue
        if open_start is None:
            open_start = start
        if reason in ("turn", "stop", "length"):
            if end > open_start:
                calls.append((open_start, end))
            open_start = None
    if open_start is not None and response_len > open_start:
        calls.append((open_start, response_len))
    elif open_start is None and response_len > pos:
        calls.append((pos, response_len))
    return env, calls


def check_stepwise_mode(mode: str) -> str:
    """The step-wise advantage mode, checked strictly (the config maps the deprecated ``per_step``).

    Raises:
        ValueError: anything but ``broadcast``.
    """
    if mode != "broadcast":
        raise ValueError(f"stepwise_mode must be 'broadcast' here (the config maps the deprecated 'per_step'), got {mode!r}")
    return mode


def expand_stepwise(prepared: list[Any], mode: str = "broadcast") -> list[Any]:
    """Split episode samples into one sample per model call (``agent.representation: stepwise``).

    Args:
        prepared: :class:`trainer.batch.PreparedSample` list; a sample with ``call_spans`` is split,
            others pass unchanged.
        mode: the step-wise mode (only ``broadcast``; checked strictly).

    Returns:
        the samples in order; step k of sample ``s`` is named ``s#k``, its prompt is
        ``prompt + response[:start_k]`` and its per-token tensors are the episode's sliced to
        ``[start_k, end_k)`` (so each step carries the trajectory's advantage).
    """
    check_stepwise_mode(mode)
    out: list[Any] = []
    for p in prepared:
        spans = getattr(p, "call_spans", None) or []
        if not spans:
            out.append(p)
            continue
        for k, (a, b) in enumerate(spans):
            out.append(dataclasses.replace(
                p, sample_id=f"{p.sample_id}#{k}", prompt_ids=list(p.prompt_ids) + list(p.response_ids[:a]),
                response_ids=list(p.response_ids[a:b]), behaviour_logprobs=p.behaviour_logprobs[a:b].clone(),
                advantages=p.advantages[a:b].clone(), loss_mask=p.loss_mask[a:b].clone(),
                versions=p.versions[a:b].clone(), call_spans=[],
            ))
    return out


def apply_grouping_hook(hook: Any, groups: list[Any], group_type: type) -> list[Any]:
    """Run a ``trajectory_grouping_hook`` on the batch's groups and check what it returns.

    ``group_type`` is the class every returned group must be (:class:`trainer.batch.TrainGroup`;
    passed in so this module never imports the batch module that calls it).

    Raises:
        ValueError: the hook returned something other than a non-empty list of groups, or a
            sample twice.
    """
    result = hook(groups)
    if not isinstance(result, list) or not result or not all(isinstance(g, group_type) for g in result):
        raise ValueError("agent.trajectory_grouping_hook must return a non-empty list of trainer.batch.TrainGroup")
    seen: set[str] = set()
    for g in result:
        for s in g.samples:
            if s.sample_id in seen:
                raise ValueError(f"agent.trajectory_grouping_hook put sample {s.sample_id} in two groups")
            seen.add(s.sample_id)
    return result


def env_mask(response_len: int, env_spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """(R,) 1.0 on model tokens, 0.0 on environment tokens."""
    m = torch.ones(response_len)
    for a, b in env_spans:
        m[a:b] = 0.0
    return m
