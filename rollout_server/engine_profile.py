"""Where the embedded engine's thread spends its time: seconds per component (a mixin of the engine).

One job: account every second of the engine thread to one component, so that a run's rollout
profile (docs/rollout.md, "Rollout profile") can be read off a live server
(``/get_server_info``'s ``engine_profile_seconds``, ``asyncrl_rollout_engine_seconds_total`` on
``/metrics``). :class:`EngineProfile` is a mixin of :class:`rollout_server.engine.Engine`, first in
its bases, so its ``_forward_with_adapters`` and ``_sample`` wrap the real ones (wall time with
``time.perf_counter``; on a CPU torch runs synchronously, so wall time is compute time; on a GPU
the forward's time shows up where its results are first read, the sampling).

Components (:data:`ENGINE_COMPONENTS`, seconds of the engine thread):

* ``prefill_forward`` / ``decode_forward``: the model's forward pass in a prefill / decode step;
* ``sampling``: next-token sampling and behaviour logprobs (``rollout_server.sampling``), both kinds of step;
* ``prefill_other``: the rest of admission and prefill (masks, placing rows in the KV cache, output bookkeeping);
* ``decode_other``: the rest of a decode step (KV growth, output bookkeeping, stop rules, compaction);
* ``weights``: validating and copying a weight update (the engine's part of a publish; reading the files
  happens on the HTTP side and is not engine time);
* ``publish``: handing progress to the HTTP layer (the ``on_update`` callback);
* ``idle``: waiting for work, not paused; ``paused``: waiting while paused (``/pause_generation``);
* ``other``: the rest of the loop (commands, aborts, thread-count following).

The components add up to the thread's lifetime since :meth:`_profile_start` (up to the loop
iteration in flight).
"""

from __future__ import annotations

import time
from typing import Any

from asyncrl.metrics.labels import ENGINE_COMPONENTS  # the one list (also the metric's label values)

__all__ = ["ENGINE_COMPONENTS", "EngineProfile"]



class EngineProfile:
    """Seconds of the engine thread per component (see the module docstring).

    Expects ``_paused`` on the engine; the engine's loop calls :meth:`_profile_start` once and
    :meth:`_profile_add` around each part of an iteration.
    """

    def _profile_init(self) -> None:
        #: seconds per component (:data:`ENGINE_COMPONENTS`); read by other threads (plain float stores)
        self.profile: dict[str, float] = dict.fromkeys(ENGINE_COMPONENTS, 0.0)
        self._phase = "decode"  # which step the forward pass and sampling being timed belong to
        self._nested = 0  # time only the outermost _sample (it recurses row by row after an error)
        self._profile_t = None

    def _profile_start(self) -> None:
        """Start the clock (the engine thread, once)."""
        self._profile_t = time.perf_counter()

    def _profile_add(self, component: str) -> None:
        """Charge the time since the last mark to ``component`` (minus what nested timers charged)."""
        now = time.perf_counter()
        if self._profile_t is not None:
            self.profile[component] += now - self._profile_t - self._inner
        self._profile_t = now
        self._inner = 0.0

    _inner = 0.0  # seconds of nested timers (forward, sampling) inside the part being charged

    def profile_snapshot(self) -> dict[str, float]:
        """A copy of :attr:`profile`, seconds per component (any thread)."""
        return {k: float(v) for k, v in dict(self.profile).items()}

    def _timed(self, component: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._nested:
            return fn(*args, **kwargs)
        self._nested += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            self._nested -= 1
            self.profile[component] += dt
            self._inner += dt

    def _forward_with_adapters(self, rows: list, **kwargs: Any) -> Any:
        return self._timed(self._phase + "_forward", super()._forward_with_adapters, rows, **kwargs)  # type: ignore[misc]

    def _sample(self, logits: Any, samples: list) -> Any:
        return self._timed("sampling", super()._sample, logits, samples)  # type: ignore[misc]

    def _cmd_update_weights(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("weights", super()._cmd_update_weights, *args, **kwargs)  # type: ignore[misc]

    def _cmd_update_adapter(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("weights", super()._cmd_update_adapter, *args, **kwargs)  # type: ignore[misc]

    def _apply_pending_updates(self) -> None:
        if not getattr(self, "_pending_updates", None):  # the common case: nothing to time
            return
        self._timed("weights", super()._apply_pending_updates)  # type: ignore[misc]
