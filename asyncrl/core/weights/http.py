"""The ``http`` weight transport, both ends: the trainer serves version directories, a rollout server downloads one.

For machines without shared storage. :class:`WeightFileServer` (aiohttp, in a background thread
of trainer rank 0) serves ``GET /weights/v000007/<file>`` from the weights directory and
``GET /weights/latest``; the announced uri is ``http://host:port/weights/v000007/``.
:func:`download_weights` fetches ``SHA256SUMS`` and every file it lists, verifies each hash (and
the announced checksum), and installs the directory atomically on local disk, ready for
``/update_weights_from_disk``. Nothing received is unpickled: safetensors and JSON only. The
directory format is :mod:`asyncrl.core.weights.directory`.

Authentication: with an ``api_key`` (``security.api_key``, the bearer token the rollout servers'
own endpoints use) every request must carry ``Authorization: Bearer <key>``, compared in
constant time; anything else gets 401 and no file. The server binds one address
(``weight_sync.http_host``: on Kubernetes the pod IP), never all interfaces by default.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from asyncrl.core.weights.directory import (
    _VERSION_RE,
    SUMS_FILE,
    ChecksumError,
    _fsync_dir,
    _read_sums,
    _write_file,
    list_versions,
    verify_weights_dir,
    weights_file_of,
    version_dir_name,
)

__all__ = ["WeightFileServer", "download_weights"]


class WeightFileServer:
    """Serves the versioned weight files of ``weights_dir`` over HTTP (aiohttp, background thread).

    Routes: ``GET /weights/latest`` -> ``{"version": int|null, "uri": str|null}``;
    ``GET /weights/v000007/<file>`` -> the file (404 for anything not a published file).
    Binds ``host`` (loopback by default); ``port`` 0 picks a free port (see :attr:`url`).
    With ``api_key`` (a ``str`` or pydantic ``SecretStr``) every route answers 401 unless the
    request carries ``Authorization: Bearer <api_key>``.

    Raises:
        ValueError: ``host`` is ``0.0.0.0``/``::`` (the announced uri would not be fetchable, and
            the server would listen on every interface): bind a concrete address.
    """

    def __init__(self, weights_dir: Path, host: str = "127.0.0.1", port: int = 0, api_key: Any = None):
        if host in ("0.0.0.0", "::", ""):
            raise ValueError(f"the weight file server must bind one address, not {host!r}: set "
                             "weight_sync.http_host to this machine's (pod's) IP")
        self.weights_dir = Path(weights_dir)
        self.host, self.port = host, port
        key = api_key.get_secret_value() if hasattr(api_key, "get_secret_value") else api_key
        self._expected = f"Bearer {key}".encode() if key else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``."""
        return f"http://{self.host}:{self.port}"

    def uri_for(self, version: int) -> str:
        """The uri announced for ``version``."""
        return f"{self.url}/weights/{version_dir_name(version)}/"

    async def _latest(self, request):
        from aiohttp import web

        versions = list_versions(self.weights_dir)
        v = versions[-1] if versions else None
        return web.json_response({"version": v, "uri": self.uri_for(v) if v is not None else None})

    async def _file(self, request):
        from aiohttp import web

        version, name = request.match_info["version"], request.match_info["name"]
        if not _VERSION_RE.match(version) or "/" in name or name.startswith("."):
            raise web.HTTPNotFound()
        path = self.weights_dir / version / name
        if not path.is_file():
            raise web.HTTPNotFound(text=f"no {version}/{name}")
        return web.FileResponse(path)

    def _run(self) -> None:
        from aiohttp import web

        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        expected = self._expected

        @web.middleware
        async def auth(request, handler):
            if expected is not None:
                got = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(got, expected):
                    raise web.HTTPUnauthorized(text="missing or wrong bearer token (security.api_key)",
                                               headers={"WWW-Authenticate": "Bearer"})
            return await handler(request)

        async def start():
            app = web.Application(middlewares=[auth])
            app.router.add_get("/weights/latest", self._latest)
            app.router.add_get("/weights/{version}/{name}", self._file)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]

        try:
            loop.run_until_complete(start())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._started.set()
            return
        self._started.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    def start(self) -> "WeightFileServer":
        """Start serving; returns self once listening.

        Raises:
            OSError: the port cannot be bound.
        """
        self._thread = threading.Thread(target=self._run, name="weight-file-server", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None


async def download_weights(uri: str, checksum: str, dest_root: Path, *, timeout_seconds: float = 300.0,
                           api_key: Any = None) -> Path:
    """Download a published version over HTTP, verify it, install it atomically under ``dest_root``.

    Args:
        uri: ``http://host:port/weights/v000007/`` as announced.
        checksum: announced sha256 of ``model.safetensors`` (``adapter_model.safetensors`` in an
            adapter-only version, which downloads the same way).
        dest_root: local directory; the version lands in ``dest_root/v000007`` (reused if already
            present and valid).
        timeout_seconds: bound on the whole download.
        api_key: bearer token (``str`` or ``SecretStr``) sent with every request; None: none.

    Returns:
        the local version directory (loadable with ``/update_weights_from_disk``).

    Raises:
        ChecksumError: a hash mismatch (nothing is installed).
        aiohttp.ClientError: the download failed.
    """
    import aiohttp

    base = uri if uri.endswith("/") else uri + "/"
    name = base.rstrip("/").rsplit("/", 1)[-1]
    if not _VERSION_RE.match(name):
        raise ValueError(f"weights uri must end with a version directory like v000007/, got {uri!r}")
    dest_root = Path(dest_root)
    dest_root.mkdir(parents=True, exist_ok=True)
    final = dest_root / name
    if final.is_dir():
        verify_weights_dir(final, checksum)
        return final
    tmp = dest_root / f".{name}.download-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        key = api_key.get_secret_value() if hasattr(api_key, "get_secret_value") else api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            async with session.get(base + SUMS_FILE) as resp:
                resp.raise_for_status()
                sums_text = await resp.text()
            sums = _read_sums(sums_text)
            main = weights_file_of(sums)  # model.safetensors, or adapter_model.safetensors (adapter-only)
            if sums[main] != checksum:
                raise ChecksumError(f"{uri}: {main} is listed as {sums[main]}, announced {checksum}")
            for fname, expected in sums.items():
                h = hashlib.sha256()
                with open(tmp / fname, "wb") as f:
                    async with session.get(base + fname) as resp:
                        resp.raise_for_status()
                        async for chunk in resp.content.iter_chunked(4 << 20):
                            h.update(chunk)
                            f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
                if h.hexdigest() != expected:
                    raise ChecksumError(f"{uri}{fname}: downloaded sha256 {h.hexdigest()}, expected {expected}")
        _write_file(tmp / SUMS_FILE, sums_text.encode())
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(dest_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
