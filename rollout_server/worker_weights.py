"""The rollout worker's weight sync: follow the version clock and load each policy version.

Step 12 of docs/architecture.md#data-flow-of-one-sample, the rollout side of
docs/architecture.md#weight-sync. :class:`WorkerWeightSync` is a base of
:class:`rollout_server.worker.RolloutWorker` (the module docstring there describes the whole
worker); its methods run on the worker:

* **Version clock (pull).** ``_subscribe`` listens on the weights channel and ``_watch_versions``
  polls ``clock.latest()`` every ``version_poll_seconds`` (pub/sub can miss messages); a newer
  version, or a new lineage (``_is_new``), is loaded by ``_update_weights``.
* **Loading** (``_update_weights``): the weights are fetched first (``_weights_path``: ``http``
  downloads and verifies into ``weights_cache_dir``, keeping the last ``keep_downloads``;
  ``disk`` uses the announced directory; version 0 without a uri is ``model.path``), then the
  engine pauses (``rollout.pause_mode``), loads them with ``/update_weights_from_disk`` and
  resumes; claiming stops meanwhile. With ``in_place`` and ``rollout.flush_cache_on_update:
  false`` the load is sent with ``flush_cache: false``: the engine keeps the keys/values of
  parked samples' contexts for their resumption, as it keeps those of running requests. ``nccl``: the trainer pushes the weights, the worker waits
  until the engine reports the announced version. A failed load is logged and retried 2 s
  later; the engine keeps generating with the weights it has.
* **LoRA by name** (``lora_mode: by_name``, SGLang's adapter path; docs/trainer.md#lora): an
  adapter-only version is registered with ``/load_lora_adapter`` under a versioned name
  (:func:`adapter_name`: lineage, version and checksum) from its directory, without touching the
  base weights; the answer must list the name, or the load failed (loud: logged, counted,
  retried, and the worker stays at its version and its adapter). With ``pause_mode: abort`` the
  engine's running requests then end, so their samples resume under the new adapter. Every
  request of a segment generated under version v carries ``lora_path`` = v's name, and its
  tokens are labelled v (the adapter a request names serves it to its end); an engine that
  reports the adapter it used (``meta_info.lora_path``, the embedded engine) must report that
  one. At most ``max_lora_adapters`` (default ``max_staleness + 1``) versions stay registered:
  older ones, and leftovers of an earlier worker on the same engine, are unloaded with
  ``/unload_lora_adapter`` in the background (SGLang's unload waits for their requests).
* **Catching up** (``_catch_up``): an item claimed under a clock newer than the engine's
  weights loads them before generating.
* **Start and engine loss** (:meth:`sync_weights`, ``_recover_engine``): align the engine with
  the clock (a restarted engine holds the base model); an engine unreachable for
  ``engine_wait_seconds`` stops the worker with :class:`WorkerError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from pathlib import Path

from asyncrl.core.aio import wait_event
from asyncrl.core.outage import outage_errors
from asyncrl.core.types import WeightAnnouncement
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rollout_server.client import EngineError, EngineUnavailable
from rollout_server.worker_options import WorkerError

__all__ = ["WorkerWeightSync", "adapter_name", "ADAPTER_NAME_PREFIX"]

#: prefix of the adapter names the worker registers (``by_name``); leftovers with it are unloaded
ADAPTER_NAME_PREFIX = "asyncrl-"


def adapter_name(ann: WeightAnnouncement) -> str:
    """The name a version's adapter is registered under: ``asyncrl-l<lineage>-v<version>-<sha256[:12]>``.

    Lineage and version say which policy it is; the checksum prefix makes a name never stand for
    two different adapters (a restarted trainer may publish another adapter as the same version).
    """
    return f"{ADAPTER_NAME_PREFIX}l{ann.lineage}-v{ann.version}-{(ann.checksum or 'nochecksum')[:12]}"

# The worker's logger: these records read as they did when this code was in worker.py.
log = logging.getLogger("rollout_server.worker")


def _now() -> float:
    return time.monotonic()


class WorkerWeightSync:
    """Weight sync of one rollout worker (a base of :class:`rollout_server.worker.RolloutWorker`).

    Uses the worker's ``buffer`` (its ``clock``), ``client``, ``opts``, ``stats``, ``metrics``,
    ``version``/``lineage`` (the weights the engine holds), the claim gate, the update lock and
    the flags ``_draining``, ``_stopping``, ``_engine_lost``, ``_retry_after`` and ``_fatal``.
    """

    # ------------------------------------------------------------------ start and resync
    async def sync_weights(self, initial: bool = False) -> bool:
        """Bring the engine to the announced policy version; True if weights were (re)loaded.

        ``initial``: also align an engine that reports another version string (e.g. SGLang's
        ``"default"`` or a restarted engine) with the clock; with no announcement yet the engine
        holds version 0 (``model.path``) and is told so via ``/update_weight_version``.
        """
        ann = await self.buffer.clock.latest()
        if ann is None:
            if initial or self.version is None:
                with contextlib.suppress(EngineError):
                    if await self.client.weight_version() != "0":
                        await self.client.update_weight_version("0", abort_all_requests=False)
                self.version = 0
                self.lineage = await self.buffer.clock.lineage()
            return False
        if not initial and not self._is_new(ann):
            return False
        if initial and self.lineage is None and self.opts.lora_mode != "by_name":
            # (by_name: the engine's version string says nothing about which adapters it holds: load)
            with contextlib.suppress(EngineError, EngineUnavailable):
                if await self.client.weight_version() == str(ann.version):
                    self.version, self.lineage = ann.version, ann.lineage
                    return False
        return await self._update_weights(ann)

    async def _catch_up(self) -> None:
        """Load the announced weights now if they are newer than the engine's (see :meth:`generate`)."""
        with contextlib.suppress(RedisConnectionError, RedisTimeoutError):
            ann = await self.buffer.clock.latest()
            if self._is_new(ann) and not self._draining and _now() >= self._retry_after:  # a failed load waits
                self.stats.caught_up += 1
                await self._update_weights(ann)
    # ------------------------------------------------------------------ version clock
    def _is_new(self, ann: WeightAnnouncement | None) -> bool:
        if ann is None:
            return False
        if self.version is None or self.lineage is None:
            return True
        return ann.lineage > self.lineage or (ann.lineage == self.lineage and ann.version > self.version)

    async def _subscribe(self) -> None:
        while not self._stopping:
            try:
                async for _ann in self.buffer.clock.subscribe():
                    self._announced.set()
            except asyncio.CancelledError:
                raise
            except Exception:  # connection lost: polling covers the gap; resubscribe
                log.debug("weights subscription broke; resubscribing", exc_info=True)
            await asyncio.sleep(1.0)

    async def _watch_versions(self) -> None:
        while not self._stopping:
            # not asyncio.wait_for: on Python < 3.12 it can swallow the cancellation that ends
            # this loop at shutdown (asyncrl.core.aio explains)
            await wait_event(self._announced, self.opts.version_poll_seconds)
            self._announced.clear()
            if self._stopping or self._draining or self._engine_lost or _now() < self._retry_after:
                continue
            try:
                ann = await self.buffer.clock.latest()
                if self._is_new(ann):
                    await self._update_weights(ann)
            except asyncio.CancelledError:
                raise
            except outage_errors() as exc:  # Redis restarting: one line per outage (the worker's), no traceback
                self._note_outage(f"version clock unreachable ({type(exc).__name__}: {exc}); polling on")
                continue
            except Exception:
                log.warning("polling the version clock failed", exc_info=True)
                continue
            self._note_recovery()

    async def _weights_path(self, ann: WeightAnnouncement) -> str:
        """Local directory holding the announced weights (downloading and verifying for ``http``)."""
        uri = ann.uri
        if not uri and ann.version == 0 and self.opts.base_model_path:
            from asyncrl.models import resolve_model_path

            return str(resolve_model_path(self.opts.base_model_path))
        if uri.startswith(("http://", "https://")):
            from asyncrl.core.weights import download_weights

            cache = self.opts.weights_cache_dir
            if cache is None:
                import tempfile

                cache = self.opts.weights_cache_dir = Path(tempfile.mkdtemp(prefix=f"asyncrl-weights-{self.opts.worker_id}-"))
            path = await download_weights(uri, ann.checksum, Path(cache), api_key=self.opts.weights_api_key)
            self._prune_downloads(Path(cache), keep=path)
            return str(path)
        if uri.startswith("file://"):
            uri = uri[len("file://"):]
        if not uri or not Path(uri).is_dir():
            raise FileNotFoundError(f"announced weights of version {ann.version} are not a local directory: {ann.uri!r} "
                                    "(weight_sync.transport=disk needs storage shared with the trainer; use http otherwise)")
        return uri

    def _prune_downloads(self, cache: Path, keep: Path) -> None:
        dirs = sorted(p for p in cache.iterdir() if p.is_dir() and p.name.startswith("v"))
        for old in dirs[:-self.opts.keep_downloads]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    async def _update_weights(self, ann: WeightAnnouncement) -> bool:
        """Pause, load ``ann``'s weights, continue (see the module docstring). False on failure (retried later)."""
        async with self._update_lock:
            if self.version is not None and not self._is_new(ann) and self.lineage == ann.lineage:
                return False
            self._claim_gate.clear()
            t0 = _now()
            transport = self.opts.transport
            name = None  # by_name: the adapter registered for ann
            try:
                if transport == "nccl":
                    await self._wait_engine_version(str(ann.version))
                else:
                    from asyncrl.core.weights import is_adapter_dir

                    path = await self._weights_path(ann)  # fetch before pausing: the pause stays short
                    t_load = self._spent("weight_fetch", t0)
                    if self.opts.lora_mode == "by_name" and is_adapter_dir(path):
                        name = await self._load_adapter_by_name(path, ann)
                    else:
                        await self.client.pause(self.opts.pause_mode)
                        try:
                            # in_place keeps running requests' KV cache across the update; with
                            # flush_cache_on_update false, parked ones' too (the engine's context cache)
                            res = await self.client.update_weights_from_disk(
                                path, weight_version=str(ann.version), flush_cache=self.opts.flush_cache_on_update)
                        finally:
                            await self.client.resume()
                        self._check_adapter_landed(path, ann, res)
                        name = None
                    self._spent("weight_load", t_load)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.stats.weight_update_errors += 1
                self._retry_after = _now() + 2.0
                if self.metrics is not None:
                    self.metrics.weight_updates.labels("error").inc()
                log.error("loading policy version %d (%s) failed: %s; generating on with version %s, retrying",
                          ann.version, ann.uri, exc, self.version)
                if isinstance(exc, EngineUnavailable):
                    self._engine_lost = True
                return False
            finally:
                self._claim_gate.set()
            self.version, self.lineage = ann.version, ann.lineage
            self.adapter = name  # with version, in one step: requests name the adapter of the version they label
            if name is not None:
                self._prune_adapters_soon()
            self.stats.weight_updates += 1
            if self.metrics is not None:
                lag = time.time() - ann.published_ms / 1000.0 if ann.published_ms else None
                self.metrics.weights_loaded(ann.version, transport, _now() - t0, lag)
            log.info("policy version %d (lineage %d) live on %s", ann.version, ann.lineage, self.client.url)
            return True

    # ------------------------------------------------------------------ LoRA by name (SGLang's adapter path)
    async def _load_adapter_by_name(self, path: str, ann: WeightAnnouncement) -> str:
        """Register ``ann``'s adapter directory with ``/load_lora_adapter``; returns its name.

        A name this worker registered before on this engine is not loaded again. One it did not
        (a restarted worker, the engine kept running) is unloaded first, quietly, so the load
        cannot fail on a leftover of the same name. With ``pause_mode: abort`` the engine's running
        requests end after the load (their samples resume under the new adapter).

        Raises:
            EngineError: the load failed, or its answer's ``loaded_adapters`` lacks the name
                (the engine would not serve it).
            EngineUnavailable: the engine cannot be reached.
        """
        name = adapter_name(ann)
        if name not in self._adapters:
            with contextlib.suppress(EngineError):
                await self.client.unload_lora_adapter(name)
            res = await self.client.load_lora_adapter(name, path)
            loaded = (res or {}).get("loaded_adapters")
            if not isinstance(loaded, dict) or name not in loaded:
                raise EngineError(200, f"the engine did not confirm LoRA adapter {name!r} of version {ann.version}: "
                                  f"its /load_lora_adapter answer lists {sorted(loaded) if isinstance(loaded, dict) else loaded!r}",
                                  self.client.url)
            self._adapters[name] = ann.version
            self._engine_adapters = set(loaded)
        if self.opts.pause_mode == "abort":  # like a full load: running segments end and resume under the new policy
            await self.client.pause("abort")
            await self.client.resume()
        return name

    def _adapter_request(self) -> tuple[dict, tuple[str, int] | None]:
        """``(extra /generate fields, (adapter name, version) or None)`` for a request sent now.

        ``by_name`` with an adapter loaded: ``{"lora_path": name}`` and the version its tokens are
        labelled with; otherwise nothing (the engine's own per-token versions label the tokens).
        """
        if self.adapter is None or self.opts.lora_mode != "by_name":
            return {}, None
        return {"lora_path": self.adapter}, (self.adapter, int(self.version))

    def _token_versions(self, d, tag: tuple[str, int] | None) -> list[int]:
        """Policy versions of the new tokens of stream delta ``d`` of a request sent with ``tag``.

        Raises:
            EngineError: the engine reports (``meta_info.lora_path``) another adapter than the
                request named: its tokens are not that version's (status 500: the segment is
                parked and retried, and a worker that keeps seeing it stops).
        """
        if tag is None:
            return [self._version_of(v) for v in d.versions]
        name, version = tag
        used = (d.meta or {}).get("lora_path", name)
        if used != name:
            raise EngineError(500, f"the engine generated under LoRA adapter {used!r} while the request named {name!r}",
                              self.client.url)
        return [version] * len(d.token_ids)

    def _prune_adapters_soon(self) -> None:
        """Unload, in the background, the registered adapters beyond the newest ``max_lora_adapters``."""
        previous = self._adapter_pruning

        async def run() -> None:
            if previous is not None:
                with contextlib.suppress(Exception):
                    await previous
            await self.prune_adapters()

        self._adapter_pruning = asyncio.create_task(run(), name="lora-adapter-prune")

    async def prune_adapters(self) -> list[str]:
        """Unload the adapters beyond the newest ``max_lora_adapters`` (and asyncrl leftovers); returns the names unloaded.

        SGLang's unload waits for the requests running under the adapter, so this may take as long
        as the longest of them. A failed unload is logged (the adapter stays registered: more
        memory, never a wrong sample) and retried at the next version.
        """
        keep = self.opts.max_lora_adapters or (int(self.settings.max_staleness) + 1)
        order = list(self._adapters)  # load order (versions restart after a new lineage)
        drop = [n for n in order[:-keep] if n != self.adapter]
        drop += sorted(n for n in self._engine_adapters if n.startswith(ADAPTER_NAME_PREFIX) and n not in self._adapters)
        done = []
        for n in drop:
            try:
                res = await self.client.unload_lora_adapter(n)
            except EngineUnavailable as exc:
                log.warning("unloading LoRA adapter %s failed: %s; retrying at the next version", n, exc)
                continue
            except EngineError as exc:  # not loaded (any more): nothing to keep track of
                log.warning("unloading LoRA adapter %s failed: %s", n, exc.message)
                res = None
            self._adapters.pop(n, None)
            self._engine_adapters.discard(n)
            if isinstance((res or {}).get("loaded_adapters"), dict):
                self._engine_adapters = set(res["loaded_adapters"])
            done.append(n)
        return done

    async def adapters_pruned(self) -> None:
        """Wait until the background unloading started by the last adapter load is done."""
        if self._adapter_pruning is not None:
            await self._adapter_pruning

    def _check_adapter_landed(self, path: str, ann: WeightAnnouncement, res: dict) -> None:
        """An adapter-only version (``trainer.lora``) must be confirmed by the engine, or the load failed.

        The embedded engine answers ``lora_adapter`` with the checksum of the adapter it merged; an
        engine that does not (SGLang's ``/update_weights_from_disk`` knows no adapter directory)
        would keep sampling from the old policy while the worker labelled tokens with the new
        version, so that is an error: the worker stays at its version and retries (loud).

        Raises:
            EngineError: the answer names no adapter, or another one than announced.
        """
        from asyncrl.core.weights import is_adapter_dir

        if not is_adapter_dir(path):
            return
        got = (res or {}).get("lora_adapter") or {}
        if got.get("checksum") != ann.checksum or got.get("version") != str(ann.version):
            raise EngineError(200, f"the engine did not confirm LoRA adapter version {ann.version} (checksum {ann.checksum[:12]}): "
                              f"it answered lora_adapter={got or None}; merging an adapter needs the embedded engine "
                              "(SGLang takes adapters by name: rollout.lora_mode by_name, docs/trainer.md#lora)",
                              self.client.url)

    async def _wait_engine_version(self, version: str, timeout_seconds: float = 600.0) -> None:
        deadline = _now() + timeout_seconds
        while await self.client.weight_version() != version:
            if _now() > deadline:
                raise TimeoutError(f"the engine did not receive version {version} over nccl in {timeout_seconds:.0f} s")
            await asyncio.sleep(0.1)
    # ------------------------------------------------------------------ engine loss
    async def _recover_engine(self, stop: asyncio.Event) -> None:
        """Wait for the engine to answer again, then reload the announced weights."""
        deadline = _now() + self.opts.engine_wait_seconds
        while not stop.is_set():
            if await self.client.health():
                self._engine_lost = False
                self.version = self.lineage = None  # a restarted engine holds the base model
                self.adapter = None  # ... and no named adapter
                self._adapters.clear()
                self._engine_adapters.clear()
                await self.sync_weights(initial=True)
                return
            if _now() > deadline:
                self._fatal = WorkerError(f"the engine at {self.client.url} has been unreachable for "
                                          f"{self.opts.engine_wait_seconds:.0f} s")
                return
            await asyncio.sleep(0.5)
