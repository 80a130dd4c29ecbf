"""The Kubernetes Redis's ACL setup (configs/k8s/base/redis-start.sh), run for real here.

The script the Redis pod runs is executed with a real redis-server >= 7.0 (the image is
``redis:7.2``): it must write the users with hashed passwords only (0600), keep every password
off command lines, and give each role exactly the ACL of ``asyncrl.controller.redis_acl``; the rules file
shipped in the ConfigMap must be the one ``python -m asyncrl.controller.redis_acl`` generates.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoPermissionError

from asyncrl.core.net import free_port
from asyncrl.controller.redis_acl import ROLES, k8s_rules_text
from asyncrl.controller.redis_server import _redis_version, find_redis_binary

BASE = Path(__file__).resolve().parent.parent / "configs" / "k8s" / "base"
PASSWORDS = {"REDIS_PASSWORD": "admin-pw-k8s-0123456789", **{f"REDIS_{r.upper()}_PASSWORD": f"{r}-pw-k8s-0123456789" for r in ROLES}}


def test_rules_file_is_generated_from_asyncrl():
    assert (BASE / "redis-acl.rules").read_text() == k8s_rules_text(), \
        "regenerate: python -m asyncrl.controller.redis_acl > configs/k8s/base/redis-acl.rules"


def _start(tmp_path, env_extra):
    binary = find_redis_binary()
    if _redis_version(binary) < (7, 0):
        pytest.skip("the Kubernetes ACL rules use Redis 7 selectors: needs redis-server >= 7.0 (Debian's package)")
    (tmp_path / "run").mkdir()
    (tmp_path / "data").mkdir()
    port = free_port()
    env = {"PATH": os.environ["PATH"], "ACL_RULES": str(BASE / "redis-acl.rules"), "RUN_DIR": str(tmp_path / "run"),
           "DATA_DIR": str(tmp_path / "data"), "REDIS_PORT": str(port), "REDIS_BIND": "127.0.0.1",
           "REDIS_SERVER": binary, **env_extra}
    proc = subprocess.Popen(["sh", str(BASE / "redis-start.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=tmp_path)
    return proc, port


def test_start_script_sets_up_role_users(tmp_path):
    proc, port = _start(tmp_path, PASSWORDS)
    try:
        deadline = time.monotonic() + 20
        admin = redis.Redis(port=port, password=PASSWORDS["REDIS_PASSWORD"])
        while True:
            try:
                admin.ping()
                break
            except redis.exceptions.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "timeout"
                time.sleep(0.1)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()  # PID 1 in the pod: redis-server itself
        assert b"redis" in cmdline and not any(pw.encode() in cmdline for pw in PASSWORDS.values())
        acl = tmp_path / "run" / "users.acl"
        assert stat.S_IMODE(acl.stat().st_mode) == 0o600
        assert not any(pw in acl.read_text() for pw in PASSWORDS.values())
        assert {u if isinstance(u, str) else u.decode() for u in admin.acl_users()} == {"default", *ROLES}
        rollout = redis.Redis(port=port, username="rollout", password=PASSWORDS["REDIS_ROLLOUT_PASSWORD"])
        assert rollout.ping() and rollout.get("asyncrl:{tiny}:version") is None
        for call in (lambda: rollout.set("asyncrl:{tiny}:version", 9), lambda: rollout.get("asyncrl:{tiny}:batch:open"),
                     lambda: rollout.config_set("appendonly", "no"), rollout.flushall):
            with pytest.raises(NoPermissionError):
                call()
        trainer = redis.Redis(port=port, username="trainer", password=PASSWORDS["REDIS_TRAINER_PASSWORD"])
        trainer.set("asyncrl:{tiny}:batch:open", "1")
        with pytest.raises(NoPermissionError):
            trainer.config_set("appendonly", "no")
        assert admin.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_start_script_refuses_a_missing_role_password(tmp_path):
    env = {k: v for k, v in PASSWORDS.items() if k != "REDIS_ROLLOUT_PASSWORD"}
    proc, _ = _start(tmp_path, env)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and b"REDIS_ROLLOUT_PASSWORD is not set" in err
