"""Weight publishing: versioned, checksummed, atomic HF model directories, and their transports.

``publish`` writes ``<weights_dir>/v<version:06d>/`` containing ``config.json``,
``model.safetensors`` (the full weights in the engine's dtype; tied embeddings stored once, as
``save_pretrained`` does), ``generation_config.json`` when the source model has one, and
the source model's tokenizer files (so a version directory is a complete model directory), and
``SHA256SUMS`` (``sha256sum`` format, one line per file). Atomicity: everything is written into
a hidden temporary directory, each file and the directory are fsynced, the directory is renamed
into place and the parent fsynced, so a reader sees either no version directory or a complete
one. Then the oldest versions beyond ``keep_last`` are deleted, and only then is the version
announced (``announce(version, uri, checksum)``; the buffer's clock does compare-and-set). The
announced checksum is the sha256 of ``model.safetensors``.

Transports (ARCHITECTURE §7, pull):

- ``disk``: the uri is the version directory's absolute path; a rollout server calls
  ``/update_weights_from_disk`` with it.
- ``http``: :class:`WeightFileServer` (aiohttp, in a background thread of trainer rank 0)
  serves ``GET /weights/v000007/<file>`` from the weights directory and ``GET /weights/latest``;
  the uri is ``http://host:port/weights/v000007/``. :func:`download_weights` fetches
  ``SHA256SUMS`` and every file it lists, verifies each hash (and the announced checksum),
  and installs the directory atomically on local disk, ready for ``/update_weights_from_disk``.
  Nothing received is unpickled: safetensors and JSON only.
- ``nccl``: the weights are still written to disk first (durable; new or restarted servers
  load them from there), then :class:`NcclWeightPusher` broadcasts them to the running engines
  with SGLang's choreography (``/init_weights_update_group`` once, then
  ``/update_weights_from_distributed`` + one broadcast per tensor, via
  ``rollout_server.weights.DistributedWeightSender``): NCCL where CUDA exists, gloo on CPU.
  The announced uri is the disk directory; engines already updated report the new
  ``weight_version`` and skip the reload.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "PublishError",
    "ChecksumError",
    "version_dir_name",
    "list_versions",
    "write_weights",
    "sha256_file",
    "verify_weights_dir",
    "WeightFileServer",
    "download_weights",
    "NcclWeightPusher",
]

WEIGHTS_FILE = "model.safetensors"
SUMS_FILE = "SHA256SUMS"
_VERSION_RE = re.compile(r"^v(\d{6,})$")


class PublishError(RuntimeError):
    """Weights could not be published (bad version, existing directory, I/O failure)."""


class ChecksumError(ValueError):
    """Downloaded or local weight files do not match their checksum."""


def version_dir_name(version: int) -> str:
    """``v000007`` for version 7."""
    if version < 0:
        raise PublishError(f"policy version must be >= 0, got {version}")
    return f"v{version:06d}"


def list_versions(weights_dir: Path) -> list[int]:
    """Published versions present in ``weights_dir``, ascending (temporary directories ignored)."""
    weights_dir = Path(weights_dir)
    if not weights_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in weights_dir.iterdir() if p.is_dir() and (m := _VERSION_RE.match(p.name)))


def sha256_file(path: Path, chunk_bytes: int = 8 << 20) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> str:
    """Write and fsync ``data``; returns its hex sha256.

    The hash is computed from memory in a second thread while the file is written (hashlib
    releases the GIL on large buffers), so publishing costs max(write, hash), not their sum.
    """
    result: dict[str, str] = {}
    hasher = None
    if len(data) > (1 << 20):
        hasher = threading.Thread(target=lambda: result.update(h=hashlib.sha256(data).hexdigest()))
        hasher.start()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if hasher is None:
        return hashlib.sha256(data).hexdigest()
    hasher.join()
    return result["h"]


def write_weights(
    weights_dir: Path,
    version: int,
    state_dict: Mapping[str, Any],
    config_json: dict[str, Any],
    *,
    generation_config_json: dict[str, Any] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    keep_last: int | None = None,
) -> tuple[Path, str]:
    """Write one version directory atomically and prune old versions.

    Args:
        weights_dir: parent directory of version directories (created if missing).
        version: the policy version (``v<version:06d>``); must not exist yet.
        state_dict: name -> CPU tensor, already in the engine dtype, tied duplicates removed.
        config_json: the model's ``config.json`` content (its ``dtype`` should match the tensors).
        generation_config_json: optional ``generation_config.json`` content.
        extra_files: other files copied verbatim (the tokenizer files, so that a version directory
            is a complete model directory usable as ``--model-path``).
        keep_last: keep only this many newest versions (None: keep all).

    Returns:
        ``(version directory, sha256 of model.safetensors)``.

    Raises:
        PublishError: the version directory already exists (versions are immutable), or the write failed.
    """
    from safetensors.torch import save_file

    weights_dir = Path(weights_dir)
    weights_dir.mkdir(parents=True, exist_ok=True)
    final = weights_dir / version_dir_name(version)
    if final.exists():
        raise PublishError(f"{final} already exists: published versions are immutable (is another trainer running?)")
    tmp = weights_dir / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
        # save_file writes straight from the tensors (several times faster than building the
        # bytes in Python and writing them); the hash then re-reads the file from the page cache.
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        _fsync_file(tmp / WEIGHTS_FILE)
        sums = {WEIGHTS_FILE: sha256_file(tmp / WEIGHTS_FILE)}
        sums["config.json"] = _write_file(tmp / "config.json", json.dumps(config_json, indent=2, sort_keys=True).encode())
        if generation_config_json is not None:
            sums["generation_config.json"] = _write_file(tmp / "generation_config.json",
                                                         json.dumps(generation_config_json, indent=2).encode())
        for name, data in (extra_files or {}).items():
            if "/" in name or name.startswith(".") or name in sums or name == SUMS_FILE:
                raise PublishError(f"extra file name {name!r} is not allowed in a version directory")
            sums[name] = _write_file(tmp / name, data)
        sums = dict(sorted(sums.items()))
        _write_file(tmp / SUMS_FILE, "".join(f"{h}  {n}\n" for n, h in sums.items()).encode())
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(weights_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PublishError(f"writing weights version {version} into {weights_dir} failed: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        for old in list_versions(weights_dir)[:-keep_last]:
            if old != version:
                shutil.rmtree(weights_dir / version_dir_name(old), ignore_errors=True)
    return final, sums[WEIGHTS_FILE]


def _read_sums(text: str) -> dict[str, str]:
    sums = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-f]{64}", parts[0]):
            raise ChecksumError(f"malformed {SUMS_FILE} line: {line!r}")
        name = parts[1].strip().lstrip("*")
        if "/" in name or name.startswith(".") or not name:
            raise ChecksumError(f"{SUMS_FILE} names a file outside the directory: {name!r}")
        sums[name] = parts[0]
    if WEIGHTS_FILE not in sums:
        raise ChecksumError(f"{SUMS_FILE} does not list {WEIGHTS_FILE}")
    return sums


def verify_weights_dir(path: Path, checksum: str | None = None) -> None:
    """Check every file listed in ``SHA256SUMS`` (and ``checksum`` of model.safetensors when given).

    Raises:
        ChecksumError: a file is missing or its hash differs (the message names it).
    """
    path = Path(path)
    try:
        sums = _read_sums((path / SUMS_FILE).read_text())
    except FileNotFoundError:
        raise ChecksumError(f"{path} has no {SUMS_FILE}") from None
    if checksum is not None and sums[WEIGHTS_FILE] != checksum:
        raise ChecksumError(f"{path}: {SUMS_FILE} lists {WEIGHTS_FILE} as {sums[WEIGHTS_FILE]}, announced {checksum}")
    for name, expected in sums.items():
        if not (path / name).is_file():
            raise ChecksumError(f"{path}: {name} is missing")
        got = sha256_file(path / name)
        if got != expected:
            raise ChecksumError(f"{path}: {name} has sha256 {got}, expected {expected}")


class WeightFileServer:
    """Serves the versioned weight files of ``weights_dir`` over HTTP (aiohttp, background thread).

    Routes: ``GET /weights/latest`` -> ``{"version": int|null, "uri": str|null}``;
    ``GET /weights/v000007/<file>`` -> the file (404 for anything not a published file).
    Binds ``host`` (loopback by default); ``port`` 0 picks a free port (see :attr:`url`).
    """

    def __init__(self, weights_dir: Path, host: str = "127.0.0.1", port: int = 0):
        self.weights_dir = Path(weights_dir)
        self.host, self.port = host, port
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

        async def start():
            app = web.Application()
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


async def download_weights(uri: str, checksum: str, dest_root: Path, *, timeout_seconds: float = 300.0) -> Path:
    """Download a published version over HTTP, verify it, install it atomically under ``dest_root``.

    Args:
        uri: ``http://host:port/weights/v000007/`` as announced.
        checksum: announced sha256 of ``model.safetensors``.
        dest_root: local directory; the version lands in ``dest_root/v000007`` (reused if already
            present and valid).

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
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(base + SUMS_FILE) as resp:
                resp.raise_for_status()
                sums_text = await resp.text()
            sums = _read_sums(sums_text)
            if sums[WEIGHTS_FILE] != checksum:
                raise ChecksumError(f"{uri}: {WEIGHTS_FILE} is listed as {sums[WEIGHTS_FILE]}, announced {checksum}")
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


AnnounceFn = Callable[[int, str, str], Any]


class NcclWeightPusher:
    """Trainer rank 0's side of the ``nccl`` transport: push full weights into running engines.

    Args:
        urls: the rollout engines' base URLs (``rollout.server_urls``, or the launched servers').
        master_address: address the engines use to reach this process's rendezvous.
        backend: ``nccl`` (GPU) or ``gloo`` (CPU; tests).
        api_key: bearer token of the engines' state-changing endpoints.

    The process group is created on the first :meth:`push` and reused.
    """

    def __init__(self, urls: list[str], master_address: str = "127.0.0.1", backend: str = "gloo",
                 api_key: str | None = None, timeout_seconds: float = 300.0):
        if not urls:
            raise PublishError("weight_sync.transport=nccl needs the engines' URLs (rollout.server_urls)")
        self.urls, self.master_address, self.backend = list(urls), master_address, backend
        self.api_key, self.timeout_seconds = api_key, timeout_seconds
        self._sender = None

    async def push(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Broadcast ``state_dict`` to every engine as ``weight_version = str(version)``."""
        from rollout_server.launch import free_port
        from rollout_server.weights import DistributedWeightSender

        if self._sender is None:
            sender = DistributedWeightSender(self.urls, self.master_address, free_port(self.master_address),
                                             backend=self.backend, api_key=self.api_key,
                                             timeout_seconds=self.timeout_seconds)
            await sender.init()
            self._sender = sender
        await self._sender.send(dict(state_dict), version=str(version))

    async def close(self) -> None:
        """Destroy the weight-update group on the engines and here."""
        if self._sender is not None:
            await self._sender.close()
            self._sender = None
