"""How a role serves its metrics: build info, per-role registries, the exposition and its HTTP servers."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import prometheus_client
from prometheus_client import CollectorRegistry, Gauge

from asyncrl.metrics.buffer import BufferMetrics
from asyncrl.metrics.controller import ControllerMetrics
from asyncrl.metrics.env_server import EnvServerMetrics
from asyncrl.metrics.labels import ROLES, _check
from asyncrl.metrics.reward_model import RewardModelMetrics
from asyncrl.metrics.rollout import RolloutMetrics
from asyncrl.metrics.trainer import TrainerMetrics


def git_sha(repo: Path | None = None) -> str:
    """The source tree's commit: ``$ASYNCRL_GIT_SHA`` (set in the image), else ``.git/HEAD``, else ``unknown``.

    Reads the files directly (no ``git`` subprocess) so it is cheap and works in slim images.
    """
    env = os.environ.get("ASYNCRL_GIT_SHA")
    if env:
        return env[:40]
    root = repo or Path(__file__).resolve().parents[2]
    try:
        head = (root / ".git" / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            ref_file = root / ".git" / ref
            if ref_file.exists():
                return ref_file.read_text().strip()[:40]
            packed = root / ".git" / "packed-refs"
            for line in packed.read_text().splitlines() if packed.exists() else []:
                sha, _, name = line.partition(" ")
                if name == ref:
                    return sha[:40]
            return "unknown"
        return head[:40]
    except OSError:
        return "unknown"


def build_info(registry: CollectorRegistry, role: str) -> Gauge:
    """Create ``asyncrl_build_info{version,git_sha,role} 1`` on ``registry``.

    Dashboards join on it (``label_values(asyncrl_build_info, job)``) and alerts use it to see
    which roles are up.

    Raises:
        ValueError: ``role`` not in :data:`ROLES`.
    """
    from asyncrl import __version__

    _check(role, ROLES, "role")
    g = Gauge("asyncrl_build_info", "Build of this asyncrl process (always 1).", ["version", "git_sha", "role"], registry=registry)
    g.labels(__version__, git_sha(), role).set(1)
    return g


def role_registry(role: str) -> tuple[CollectorRegistry, object]:
    """A fresh registry with ``asyncrl_build_info`` and the catalogue of ``role``.

    Returns ``(registry, metrics)`` where ``metrics`` is a :class:`RolloutMetrics`,
    :class:`TrainerMetrics`, :class:`ControllerMetrics`, :class:`BufferMetrics` or
    :class:`RewardModelMetrics` or :class:`EnvServerMetrics`.

    Raises:
        ValueError: unknown ``role``.
    """
    classes = {"rollout": RolloutMetrics, "trainer": TrainerMetrics, "controller": ControllerMetrics, "buffer": BufferMetrics,
               "reward_model": RewardModelMetrics, "env_server": EnvServerMetrics}
    _check(role, ROLES, "role")
    reg = CollectorRegistry()
    build_info(reg, role)
    return reg, classes[role](reg)


def exposition(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """Render ``registry`` for a scrape: ``(body, content_type)``, always the classic text format 0.0.4.

    No OpenMetrics negotiation, on purpose: Prometheus 2.x asks for OpenMetrics without an
    ``escaping`` parameter, and prometheus_client (0.26) then rewrites colons in metric names
    to underscores (``escaping=underscores``), so SGLang-named series (``sglang:num_running_reqs``)
    would arrive as ``sglang_num_running_reqs`` and the dashboard's engine panels would stay
    empty. The text format keeps names as they are and every Prometheus version reads it.
    ``accept`` is accepted for symmetry with handlers and ignored.
    """
    return prometheus_client.generate_latest(registry), prometheus_client.exposition.CONTENT_TYPE_PLAIN_0_0_4


def metrics_app_handler(registry: CollectorRegistry):
    """An aiohttp handler serving ``registry`` (``app.router.add_get("/metrics", handler)``).

    The content type carries a charset, so it goes in ``headers`` — aiohttp's
    ``content_type=`` argument rejects charsets (``ValueError: charset must not be in
    content_type argument``). Serves the classic text
    format whatever the ``Accept`` header says (see :func:`exposition`), so a registry that
    also holds SGLang-named engine metrics keeps their colons.
    """
    from aiohttp import web

    async def handle_metrics(request: "web.Request") -> "web.Response":
        body, content_type = exposition(registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    return handle_metrics


_SERVERS: dict[int, object] = {}


def start_metrics_server(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread; returns the bound port.

    Same body as :func:`metrics_app_handler` (classic text format, see :func:`exposition`).

    For roles without an HTTP server of their own (trainer rank 0, the controller). ``port`` 0
    picks a free port. Loopback by default (docs/architecture.md#operations); in a pod pass ``0.0.0.0``.

    Raises:
        OSError: the port is taken (the message names it).
    """
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    def app(environ, start_response):
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: metrics are at /metrics\n"]
        body, content_type = exposition(registry)
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    class _Quiet(WSGIRequestHandler):
        def log_message(self, *args):
            """Drop the access-log line: one line per scrape would flood the role's log."""

    try:
        httpd = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc
    threading.Thread(target=httpd.serve_forever, name=f"metrics-{httpd.server_port}", daemon=True).start()
    bound = int(httpd.server_port)
    _SERVERS[bound] = httpd
    return bound


def stop_metrics_server(port: int) -> None:
    """Stop a server started by :func:`start_metrics_server` (no-op for an unknown port)."""
    httpd = _SERVERS.pop(port, None)
    if httpd is not None:
        httpd.shutdown()  # type: ignore[attr-defined]
        httpd.server_close()  # type: ignore[attr-defined]
