"""The timeline of every sample's life: the exported files of ``<run_dir>/trace/`` and their reading.

The buffer's Lua scripts record each transition of a sample (fed, admitted, claimed, first tokens,
parked, resumed, completed, scored, batched, acknowledged, committed, restarted, dropped...) in the
string ``<sample or group key>|tl``, with the server time of the script (Redis ``TIME``) and the
caller's ``role@host:pid``: no extra round trip. When a group is committed or dropped, its timeline
leaves Redis through the ``timeline`` list; the trainer moves that list to rotated JSON-lines files
here after each commit (:meth:`buffers.ReplayBuffer.export_timeline`), so Redis memory does not grow
with the run (docs/buffer.md#timeline). ``asyncrl trace`` turns the files into a Perfetto trace.

A file is ``timeline-<n:06d>.jsonl``; each line is one record (``kind``: ``group``, ``batch``,
``publish``, ``recover``). A new file starts when the current one would pass ``max_file_bytes``;
beyond ``max_files`` files the oldest is deleted, so the directory is bounded too.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

__all__ = ["TimelineWriter", "TimelineEvent", "export_list", "origin_of", "parse_events", "read_records", "trace_files"]

_FILE = re.compile(r"^timeline-(\d{6,})\.jsonl$")


def origin_of(role: str) -> str:
    """``role@host:pid`` of this process, as the scripts record it (no spaces, at most 128 characters)."""
    import socket

    raw = f"{role}@{socket.gethostname()}:{os.getpid()}"
    return re.sub(r"[^A-Za-z0-9_.:@/-]", "_", raw)[:128]


def trace_files(trace_dir: str | os.PathLike) -> list[Path]:
    """The timeline files of ``trace_dir``, oldest first (by their number)."""
    d = Path(trace_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _FILE.match(p.name))]
    return [p for _, p in sorted(found)]


class TimelineWriter:
    """Appends timeline records to rotated files ``timeline-<n>.jsonl`` under ``trace_dir``.

    Args:
        trace_dir: the directory (created when missing); a resumed run appends to the same one.
        max_file_bytes: a file is closed once the next batch of records would make it larger (a single
            record larger than this gets a file of its own).
        max_files: the most files kept; the oldest are deleted beyond it (0 keeps every file).
    """

    def __init__(self, trace_dir: str | os.PathLike, max_file_bytes: int = 64 << 20, max_files: int = 64) -> None:
        if max_file_bytes < 1 or max_files < 0:
            raise ValueError(f"max_file_bytes must be >= 1 and max_files >= 0, got {max_file_bytes}, {max_files}")
        self.dir = Path(trace_dir)
        self.max_file_bytes = int(max_file_bytes)
        self.max_files = int(max_files)

    def write(self, records: Iterable[str]) -> None:
        """Append ``records`` (one JSON object each, as text), fsynced, rotating as needed."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lines = [r.strip().replace("\n", " ") + "\n" for r in records if r.strip()]
        files = trace_files(self.dir)
        path = files[-1] if files else self.dir / "timeline-000001.jsonl"
        size = path.stat().st_size if path.exists() else 0
        i = 0
        while i < len(lines):
            chunk: list[str] = []
            n = 0
            while i < len(lines):
                b = len(lines[i].encode())
                if chunk and size + n + b > self.max_file_bytes:
                    break
                if not chunk and size > 0 and size + b > self.max_file_bytes:
                    break
                chunk.append(lines[i])
                n += b
                i += 1
            if chunk:
                with open(path, "a", encoding="utf-8") as f:
                    f.write("".join(chunk))
                    f.flush()
                    os.fsync(f.fileno())
            if i < len(lines):
                path = self.dir / f"timeline-{int(_FILE.match(path.name).group(1)) + 1:06d}.jsonl"
                size = 0
        self._prune()

    def _prune(self) -> None:
        if self.max_files <= 0:
            return
        files = trace_files(self.dir)
        for old in files[: max(0, len(files) - self.max_files)]:
            old.unlink(missing_ok=True)


async def export_list(redis: Any, key: str, writer: "TimelineWriter") -> int:
    """Move the records of the Redis list ``key`` to ``writer``'s files, 1000 at a time: each chunk is
    written and fsynced before it is trimmed from Redis (a crash in between exports it twice, never
    loses it). Returns how many records moved."""
    total = 0
    while True:
        raw = await redis.lrange(key, 0, 999)
        if not raw:
            return total
        writer.write([r.decode() if isinstance(r, bytes) else str(r) for r in raw])
        await redis.ltrim(key, len(raw), -1)
        total += len(raw)


def read_records(trace_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of ``trace_dir``, oldest file first, duplicates (a record exported twice after a
    crash between the write and the trim) dropped; a truncated last line is skipped."""
    seen: set[str] = set()
    out = []
    for path in trace_files(trace_dir):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line or line in seen:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                seen.add(line)
                out.append(rec)
    return out


@dataclass
class TimelineEvent:
    """One recorded transition: ``name`` at server time ``t_ms`` by ``origin`` (``role@host:pid``)."""

    name: str
    t_ms: int
    origin: str
    args: dict[str, str] = field(default_factory=dict)

    @property
    def role(self) -> str:
        """The role part of the origin (``rollout``, ``trainer``, ...)."""
        return self.origin.split("@", 1)[0]


def parse_events(tl: str) -> Iterator[TimelineEvent]:
    """The events of a timeline string: lines ``<name> <t_ms> <origin>[ key=value ...]``; damaged lines skipped."""
    for line in (tl or "").splitlines():
        parts = line.split(" ")
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        args = dict(p.split("=", 1) for p in parts[3:] if "=" in p)
        yield TimelineEvent(parts[0], int(parts[1]), parts[2], args)
