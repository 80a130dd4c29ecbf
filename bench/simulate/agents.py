"""Multi-call agent episodes in the simulator: model calls separated by tool calls that take seconds.

An agent episode (docs/agents.md) is a sequence of model calls; between two calls the episode
waits for its tool (on the environment server: ``agent.env_server.latency``) and the tool's
observation is appended to the context. In the simulator a sample of an agent configuration
(``SimConfig.agent``, an :class:`AgentModel`) draws its episode when it is first claimed: the
model tokens of each call and the observation tokens after each call but the last
(:class:`Episodes`, taken from a run's own per-sample timelines by :func:`episodes_from_trace`).
Its target length is the sum of the calls' model tokens; budget windows, parking and staleness
work on model tokens as in the buffer (``agent`` episodes count ``max_budget`` in model tokens).

While an episode waits for its tool it holds its worker slot (``max_inflight``) but runs no
engine request: the rollout server counts as idle when only tool waits are in flight, as
``asyncrl_rollout_idle_seconds_total`` does. The next call is prefilled whole (prompt, every
earlier call and observation): the embedded engine has no prefix cache across calls
(docs/agents.md "Not built yet"). Assumptions, named here because the model rests on them: a
weight update does not interrupt a tool wait (the next call runs under the engine's version
then), and the first call of the n samples of a group shares its prompt's prefill (the engine's
prompt cache, docs/rollout.md).
"""

from __future__ import annotations

import bisect
import functools
import glob
import itertools
import json
import math
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Episode", "Episodes", "ToolLatency", "AgentModel", "AgentEvents", "episodes_from_trace"]


@dataclass(frozen=True)
class Episode:
    """One episode's shape: ``calls[i]`` model tokens of call i, ``observations[i]`` tokens appended after call i.

    ``len(observations) == len(calls) - 1``; both in tokens.
    """

    calls: tuple[int, ...]
    observations: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.calls or any(c < 1 for c in self.calls):
            raise ValueError(f"an episode needs >= 1 call of >= 1 token, got {self.calls}")
        if len(self.observations) != len(self.calls) - 1 or any(o < 0 for o in self.observations):
            raise ValueError(f"an episode of {len(self.calls)} calls has {len(self.calls) - 1} observations "
                             f"(>= 0 tokens), got {self.observations}")

    @property
    def model_tokens(self) -> int:
        """Tokens the policy generated (the sample's target length)."""
        return sum(self.calls)

    @functools.cached_property
    def _stops(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.calls[:-1]))

    def stops(self) -> list[int]:
        """Model-token positions where a tool call starts: the end of every call but the last."""
        return list(self._stops)

    def observation_tokens_before(self, model_pos: int) -> int:
        """Observation tokens in the context once ``model_pos`` model tokens exist (calls ended at or before it)."""
        return sum(self.observations[:bisect.bisect_right(self._stops, model_pos)])


@dataclass
class Episodes:
    """Episode shapes by the policy version that generated them (a run's own, see :func:`episodes_from_trace`).

    :meth:`draw` picks uniformly among the episodes of the newest version <= ``version`` that has
    any (the oldest version's when ``version`` is older than all): the simulated policy's episodes
    change over a run as the measured policy's did.

    Raises:
        ValueError: no episode.
    """

    by_version: dict[int, list[Episode]]
    source: str = ""
    _keys: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.by_version = {int(v): list(eps) for v, eps in self.by_version.items() if eps}
        if not self.by_version:
            raise ValueError("Episodes needs at least one episode")
        self._keys = sorted(self.by_version)

    def draw(self, rng: random.Random, version: int) -> Episode:
        """One episode for a sample first claimed under ``version``."""
        i = bisect.bisect_right(self._keys, version) - 1
        eps = self.by_version[self._keys[max(0, i)]]
        return eps[rng.randrange(len(eps))]

    def all(self) -> list[Episode]:
        """Every episode, oldest version first."""
        return [e for v in self._keys for e in self.by_version[v]]

    def to_json(self) -> dict[str, Any]:
        """``{"source", "by_version": {version: [[calls...], [observations...], count], ...}}`` (equal episodes counted)."""
        out: dict[str, list] = {}
        for v in self._keys:
            counts: dict[Episode, int] = {}
            for e in self.by_version[v]:
                counts[e] = counts.get(e, 0) + 1
            out[str(v)] = [[list(e.calls), list(e.observations), n] for e, n in counts.items()]
        return {"source": self.source, "by_version": out}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Episodes":
        """Inverse of :meth:`to_json`."""
        return cls({int(v): [Episode(tuple(c), tuple(o)) for c, o, n in eps for _ in range(int(n))]
                    for v, eps in d["by_version"].items()}, source=d.get("source", ""))


@dataclass(frozen=True)
class ToolLatency:
    """Seconds per tool call: ln(latency) ~ N(ln median, sigma^2), cut at ``deadline`` (docs/agents.md).

    The same distribution as ``asyncrl.env_server.latency`` (``lognormal``); sigma 0 is a constant.
    """

    median: float
    sigma: float = 0.0
    deadline: float = math.inf

    def draw(self, rng: random.Random) -> float:
        """One call's latency (seconds)."""
        x = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)) if self.sigma > 0 else self.median
        return min(x, self.deadline)


@dataclass
class AgentModel:
    """What ``SimConfig.agent`` holds: the episodes and the tool's latency."""

    episodes: Episodes
    latency: ToolLatency


_EVENT = re.compile(r"^(gen|turn|complete)\b.*?\blen=(\d+)")


def _episode_of(timeline: str) -> Episode | None:
    """Parse one sample's timeline (``trace/``, docs/timeline.md) into its calls and observations.

    ``gen`` opens a model call at the sample's length then (a ``gen`` while a call is open is a
    resumption after a park), ``turn`` / ``complete`` closes it; the tokens between a call's end
    and the next call's start are the observation. A ``restart`` starts the episode over.
    """
    calls: list[int] = []
    obs: list[int] = []
    start = last_end = None
    opened_with_obs = False
    for line in timeline.splitlines():
        if line.startswith("restart"):
            calls, obs, start, last_end = [], [], None, None
            continue
        m = _EVENT.match(line)
        if m is None:
            continue
        ev, n = m.group(1), int(m.group(2))
        if ev == "gen" and start is None:
            opened_with_obs = last_end is not None
            if opened_with_obs:
                obs.append(n - last_end)
            start = n
        elif ev in ("turn", "complete") and start is not None:
            if n > start:
                calls.append(n - start)
                last_end = n
            elif opened_with_obs:  # an empty call: its observation joins the next call's
                obs.pop()
            start = None
    if not calls or len(obs) != len(calls) - 1 or any(o < 0 for o in obs):
        return None
    return Episode(tuple(calls), tuple(obs))


def episodes_from_trace(run_dir: str | os.PathLike, source: str = "") -> Episodes:
    """The episodes a run trained on, by the policy version that began them, from its ``trace/`` timelines.

    Args:
        run_dir: an ``asyncrl train`` run directory with ``trace/timeline-*.jsonl``.
        source: a label kept with the episodes.

    Returns:
        Episodes keyed by each sample's oldest token version (``minv``).

    Raises:
        FileNotFoundError: no timeline in ``run_dir/trace``.
        ValueError: no committed sample could be parsed.
    """
    files = sorted(glob.glob(os.path.join(os.fspath(run_dir), "trace", "*.jsonl")))
    if not files:
        raise FileNotFoundError(f"no trace/*.jsonl in {run_dir}: run with the sample timeline on (docs/timeline.md)")
    by_version: dict[int, list[Episode]] = {}
    for path in files:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("kind") != "group" or rec.get("how") != "committed":
                    continue
                for s in rec["samples"]:
                    ep = _episode_of(s.get("tl", ""))
                    if ep is not None:
                        by_version.setdefault(int(s.get("minv", 0)), []).append(ep)
    if not by_version:
        raise ValueError(f"{run_dir}: no committed sample's timeline could be read as an episode")
    return Episodes(by_version, source=source)


class AgentEvents:
    """The simulator's agent events, mixed into :class:`bench.simulate.model.Simulator`.

    A segment claimed for an agent sample runs to its next tool call (``Req.stops``, relative to
    the segment's start); there the request leaves the engine (:meth:`_tool_call`), waits the
    tool's latency holding its worker slot (``Server.tools``) and comes back as a new engine
    request whose context is prefilled whole (:meth:`_on_tool_done`).
    """

    def _episode(self, s: Any) -> Episode:
        """The episode of sample ``s`` (drawn at its first claim, again after a restart); sets its target."""
        key = (s.sid, s.restarts)
        ep = self.agent_episodes.get(key)
        if ep is None:
            ep = self.cfg.agent.episodes.draw(self.rng, self.buf.v)
            self.agent_episodes[key] = ep
            s.target = max(1, min(self.cfg.max_response_len, ep.model_tokens))
            s.extra = sum(ep.observations)
        return ep

    def _agent_request(self, r: Any, s: Any, ep: Episode) -> None:
        """Tool stops inside the segment of ``r`` and the observations already in its context."""
        end = s.length + r.seg_len
        r.stops = [p - s.length for p in ep.stops() if s.length < p < end]
        r.ctx0 += ep.observation_tokens_before(s.length)

    def _tool_call(self, srv: Any, r: Any) -> None:
        """``r`` reached a tool call: it leaves the engine and waits the tool's latency."""
        s = r.item.sample
        del srv.running[s.sid]
        srv.kv_base -= r.ctx0 - r.start
        if not srv.running:
            srv.kv_base = 0.0
        stop = r.stops.pop(0)
        r.credited.append((r.ver, max(0, stop - sum(c for _, c in r.credited))))  # since the last credit: r.ver's
        r.pos = stop
        srv.tools[s.sid] = r
        self._push(self.now + self.cfg.agent.latency.draw(self.rng), "tool_done", srv.idx, s.sid)

    def _on_tool_done(self, idx: int, sid: int) -> None:
        srv = self.servers[idx]
        r = srv.tools.pop(sid, None)
        if r is None:
            return
        s = r.item.sample
        srv.advance(self.now)
        if s.status != "running":  # dropped meanwhile: the slot is free
            self._dispatch(srv)
            self._wake()
            return
        ep = self.agent_episodes[(s.sid, s.restarts)]
        r.ctx0 = self.cfg.prompt_tokens + s.length + r.pos + ep.observation_tokens_before(s.length + r.pos)
        srv.waiting.append(r)
        self._start_waiting(srv)
        self._schedule(srv)
        self._wake()
