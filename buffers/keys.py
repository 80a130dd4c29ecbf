"""Key names of a run's keyspace: every key starts with ``asyncrl:{<run>}:`` (one hash slot).

Keys (docs/architecture.md#redis-layout-and-guarantees): ``schema`` (string), ``settings`` (JSON),
``version``, ``lineage``, ``cursor`` (ints), ``weights:latest`` (hash) and the ``weights`` pub/sub
channel, ``pending`` (list of fed group ids), ``group:<gid>`` and ``sample:<gid>/<i>`` (hashes,
arrays packed), ``fresh`` / ``resumable`` / ``parked`` / ``unscored`` / ``leases`` (sorted sets of
sample ids), ``inflight`` / ``groups`` / ``ready`` (sorted sets of group ids by admission order),
``replay`` (list), ``batch:<bid>`` (hash), ``batch:open``, ``acked_batches`` (sorted set by step),
``committed_batches`` (set), ``dropped`` (hash gid -> reason), ``stats`` (hash of counters).
"""

from __future__ import annotations

import re

SCHEMA_VERSION = "asyncrl-buffer/1"
"""Stored in ``<prefix>schema``; a different value means an incompatible writer."""

RUN_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
GROUP_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def key_prefix(run: str) -> str:
    """``asyncrl:{<run>}:`` for a run name (letters, digits, ``_.-``, at most 64).

    Raises:
        ValueError: the run name has other characters (they would break the hash tag).
    """
    if not RUN_NAME.match(run):
        raise ValueError(f"run name {run!r} must match {RUN_NAME.pattern}")
    return f"asyncrl:{{{run}}}:"
