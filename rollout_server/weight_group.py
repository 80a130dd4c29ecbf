"""The embedded engine's side of a weight-update group: bounded in time, bound to the server's host.

One job: join rank 0's gloo group and receive its broadcasts without ever holding the server
hostage (issue #18 item 5). :func:`join_group` makes the same group as
:func:`asyncrl.core.weights.init_weights_update_group` (SGLang's ``init_custom_process_group``: a
``tcp://`` rendezvous, then a gloo group under the store prefix ``<group_name>/cpu/`` that
torch's ``_new_process_group_helper`` uses, so the trainer's rank 0 is unchanged) but creates the
gloo device on the server's own host, so the engine listens only where its HTTP server does
(loopback by default) instead of wherever the machine's hostname resolves. Every wait (the
rendezvous, each broadcast) is bounded by ``timeout_seconds``. :func:`on_daemon_thread` runs
such blocking work on a dedicated daemon thread that the caller stops waiting for after a
bound, and that shutdown abandons (an executor thread would be joined at exit).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
from typing import Any, Callable

__all__ = ["GroupTimeout", "join_group", "receive_broadcasts", "leave_group", "on_daemon_thread"]

log = logging.getLogger("rollout_server.server")


class GroupTimeout(TimeoutError):
    """A weight-update group operation did not finish within its bound."""


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               host: str, timeout_seconds: float) -> Any:
    """Join rank 0's gloo group as ``rank`` of ``world_size``; the gloo device listens on ``host``.

    Returns:
        a ``torch.distributed.ProcessGroupGloo`` (for :func:`receive_broadcasts`).

    Raises:
        RuntimeError / DistStoreError / TimeoutError: the rendezvous or the gloo connection
            failed or took longer than ``timeout_seconds``.
    """
    from torch.distributed import PrefixStore, ProcessGroupGloo
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=float(timeout_seconds))
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{master_address}:{int(master_port)}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    opts = ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [ProcessGroupGloo.create_device(hostname=host if host not in ("", "0.0.0.0", "::") else "")]
    return ProcessGroupGloo(PrefixStore("cpu/", PrefixStore(f"{group_name}/", store)), rank, world_size, opts)


def receive_broadcasts(pg: Any, names: list[str], dtypes: list[str], shapes: list[list[int]],
                       timeout_seconds: float) -> dict[str, Any]:
    """Receive one broadcast from group rank 0 per tensor, in order; returns ``{name: tensor}``.

    Raises:
        WeightLoadError: an unknown dtype (checked before anything is received).
        RuntimeError: a broadcast failed or did not arrive within ``timeout_seconds``.
    """
    import torch
    import torch.distributed as dist

    from asyncrl.core.weights import WeightLoadError

    allowed = ("float32", "float16", "bfloat16", "float64")
    specs = []
    for name, dt, shape in zip(names, dtypes, shapes):
        dt = str(dt).replace("torch.", "")
        if dt not in allowed:
            raise WeightLoadError(f"tensor {name!r}: unsupported dtype {dt!r} (use one of {', '.join(allowed)})")
        specs.append((name, getattr(torch, dt), list(shape)))
    out = {}
    for name, dtype, shape in specs:
        t = torch.empty(shape, dtype=dtype)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=float(timeout_seconds))
        pg.broadcast([t], opts).wait()
        out[name] = t
    return out


def leave_group(pg: Any) -> None:
    """Shut a group made by :func:`join_group` down, best effort (its peers see the pairs close)."""
    try:
        pg.shutdown()
    except Exception:  # best effort: shutdown, or the destroy endpoint
        log.debug("shutting down a weight update group failed", exc_info=True)


async def on_daemon_thread(fn: Callable[..., Any], *args: Any, timeout_seconds: float | None, what: str,
                           on_late_result: Callable[[Any], None] | None = None) -> Any:
    """``fn(*args)`` on a new daemon thread; its result, or :class:`GroupTimeout` after ``timeout_seconds``.

    A thread the caller stopped waiting for runs on (Python cannot stop it) but holds nothing
    up: it is a daemon, so interpreter exit does not join it, and a result it returns late is
    handed to ``on_late_result`` (to release a group joined too late) instead of being lost.

    Raises:
        GroupTimeout: ``fn`` did not return within ``timeout_seconds`` (None: no bound).
        Exception: whatever ``fn`` raised.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if fut.done():
            if ok and on_late_result is not None:
                on_late_result(value)
            return
        fut.set_result(value) if ok else fut.set_exception(value)

    def target() -> None:
        try:
            ok, value = True, fn(*args)
        except BaseException as exc:  # handed to the waiting handler
            ok, value = False, exc
        try:
            loop.call_soon_threadsafe(deliver, ok, value)
        except RuntimeError:  # the loop is closed: the server has shut down
            if ok and on_late_result is not None:
                on_late_result(value)

    threading.Thread(target=target, name=f"asyncrl-{what}", daemon=True).start()
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout_seconds)
    finally:
        if not fut.done():  # timed out, or the handler was cancelled: a late result goes to on_late_result
            fut.cancel()
    if not done:
        raise GroupTimeout(f"{what} did not finish within {timeout_seconds:g} s")
    return fut.result()
