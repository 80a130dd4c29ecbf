"""Idle time of a role, counted live and exported at scrape time (:class:`IdleTracker`)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class IdleTracker(Collector):
    """Counts a role's idle seconds live, exported at scrape time.

    Exposes ``asyncrl_<subsystem>_idle_seconds_total`` (counter; ``rate()`` of it is the idle
    ratio over any window) and ``asyncrl_<subsystem>_idle_ratio`` (gauge, 0..1, idle share of
    the time since the tracker was created). A counter updated only on transitions would
    stay flat during a long idle spell and then jump; computing it at scrape time does not.

    The role calls :meth:`set_idle` on every transition (thread-safe). It starts idle.
    """

    def __init__(self, registry: CollectorRegistry, subsystem: str, what: str, clock: Callable[[], float] = time.monotonic):
        """``what`` says what idle means for this role (it goes into the help text)."""
        self._name = f"asyncrl_{subsystem}_idle"
        self._what = what
        self._clock = clock
        self._lock = threading.Lock()
        self._start = clock()
        self._idle_since: float | None = self._start
        self._idle_accum = 0.0
        registry.register(self)

    def set_idle(self, idle: bool) -> None:
        """Mark the role idle (``True``) or busy (``False``) from now on."""
        with self._lock:
            now = self._clock()
            if idle and self._idle_since is None:
                self._idle_since = now
            elif not idle and self._idle_since is not None:
                self._idle_accum += now - self._idle_since
                self._idle_since = None

    @contextmanager
    def idle(self) -> Iterator[None]:
        """Context manager: idle inside the block, busy after it."""
        self.set_idle(True)
        try:
            yield
        finally:
            self.set_idle(False)

    def idle_seconds(self) -> float:
        """Idle seconds accumulated so far (including the current idle spell)."""
        with self._lock:
            now = self._clock()
            return self._idle_accum + (now - self._idle_since if self._idle_since is not None else 0.0)

    def idle_ratio(self) -> float:
        """Idle share (0..1) of the time since the tracker was created."""
        elapsed = self._clock() - self._start
        return min(1.0, self.idle_seconds() / elapsed) if elapsed > 0 else 0.0

    def describe(self):  # registry asks for names at register time
        return [
            CounterMetricFamily(self._name + "_seconds", ""),
            GaugeMetricFamily(self._name + "_ratio", ""),
        ]

    def collect(self):
        c = CounterMetricFamily(
            self._name + "_seconds", f"Seconds spent idle ({self._what}); rate() of it is the idle ratio over a window."
        )
        c.add_metric([], self.idle_seconds())
        g = GaugeMetricFamily(self._name + "_ratio", f"Idle share (0-1) since the process started ({self._what}).")
        g.add_metric([], self.idle_ratio())
        return [c, g]
