"""Secrets never leak (issue #18 item 6): config dumps, file modes, argv, logs.

The end-to-end check is the issue's proof: after a tiny run with an API key and a Redis
password, no file under the run directory, no process's command line (``/proc/*/cmdline``, read
while the run is live) and no log contains either, nor the per-role Redis passwords the
controller generated (read from the roles' environments, where they belong).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from asyncrl.core.config import dump_config, load_config
from asyncrl.core.net import free_port

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"
API_KEY = "apikey-5f1c0e9a7b3d4c21a8e6"
REDIS_PASSWORD = "redispw-9d8c7b6a5f4e3d2c1b0a"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secrets_are_redacted_in_repr_and_dumps(tmp_path):
    cfg = load_config(environ={"ASYNCRL_SECURITY__API_KEY": API_KEY, "ASYNCRL_SECURITY__REDIS_PASSWORD": REDIS_PASSWORD,
                               "ASYNCRL_BUFFER__REDIS_URL": f"redis://trainer:{REDIS_PASSWORD}@h:6379/0"})
    for text in (repr(cfg), str(cfg), str(cfg.model_dump()), str(cfg.model_dump(mode="json"))):
        assert API_KEY not in text and REDIS_PASSWORD not in text
    path = tmp_path / "run" / "config.yaml"
    dump_config(cfg, path)
    text = path.read_text()
    assert API_KEY not in text and REDIS_PASSWORD not in text and "**********" not in text
    assert _mode(path) == 0o600
    assert "redis_url: redis://trainer@h:6379/0" in text  # host, port and user stay: only the password goes
    again = load_config(["--config", str(path)], environ={"ASYNCRL_SECURITY__API_KEY": API_KEY})
    assert again.security.api_key.get_secret_value() == API_KEY  # the dump loads; secrets come from the environment


def test_secret_values_are_never_coerced_and_flags_warn():
    cfg = load_config(environ={"ASYNCRL_SECURITY__API_KEY": "0123456789"})
    assert cfg.security.api_key.get_secret_value() == "0123456789"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(["--security.api_key", API_KEY])
        load_config(["--redis_url", "redis://h:1/0"])  # no password: no warning
    assert len(caught) == 1 and "ps" in str(caught[0].message) and API_KEY not in str(caught[0].message)


def test_write_private_and_private_dir(tmp_path):
    from asyncrl.core.secret_values import private_dir, write_private

    old = os.umask(0o022)
    try:
        d = private_dir(tmp_path / "a" / "b")
        f = write_private(d / "f", "x")
        f.chmod(0o644)
        write_private(d / "f", "y")  # replaced by a new 0600 file
    finally:
        os.umask(old)
    assert _mode(d) == 0o700 and _mode(f) == 0o600 and f.read_text() == "y"


def _cmdlines() -> dict[int, bytes]:
    out = {}
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            out[int(p.parent.name)] = p.read_bytes()
        except (OSError, ValueError):
            continue
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


@pytest.mark.slow
def test_tiny_run_leaks_no_secret(tmp_path, tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "ASYNCRL_"))}
    env.update(OMP_NUM_THREADS="1", ASYNCRL_SECURITY__API_KEY=API_KEY, ASYNCRL_SECURITY__REDIS_PASSWORD=REDIS_PASSWORD)
    run_dir = tmp_path / "tiny"
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "--config", str(TINY), "--output_dir", str(tmp_path),
           "--model_path", str(tiny_model_dir), "--rollout.base_port", str(free_port()), "--total_steps", "2",
           "--trainer.checkpoint_interval", "1", "--rollout.api_key_required", "true", "--monitoring.progress", "false"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    secrets = {API_KEY.encode(), REDIS_PASSWORD.encode()}
    seen_cmdlines: list[tuple[int, bytes]] = []
    role_urls: set[str] = set()
    done = threading.Event()

    def watch() -> None:  # every live process's command line, and the roles' Redis URLs (their environment)
        while not done.is_set():
            for pid, line in _cmdlines().items():
                seen_cmdlines.append((pid, line))
                if str(run_dir).encode() in line:
                    url = _environ(pid).get("ASYNCRL_BUFFER__REDIS_URL", "")
                    if "@" in url:
                        role_urls.add(url)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        done.set()
        watcher.join()
        if proc.poll() is None:
            proc.kill()
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert proc.returncode == 0, err.decode(errors="replace")[-4000:] + logs
    # the roles had their own Redis users (not the admin password)
    users = {u.split("//", 1)[1].split(":", 1)[0] for u in role_urls}
    assert {"feeder", "rollout", "trainer"} <= users, role_urls
    secrets |= {u.split(":", 2)[2].split("@", 1)[0].encode() for u in role_urls}
    assert all(len(s) >= 16 for s in secrets)
    # 1. no process's command line, at any time of the run
    for pid, line in seen_cmdlines:
        for s in secrets:
            assert s not in line, f"pid {pid} had a secret on its command line: {line[:200]!r}"
    # 2. no file under the run directory (config dumps, checkpoints, logs, metrics, AOF, weights)
    files = [p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.name == "config.yaml" and "checkpoints" in p.parts for p in files)
    for p in files:
        data = p.read_bytes()
        for s in secrets:
            assert s not in data, f"{p} holds a secret"
    # 3. nor the controller's own output
    for s in secrets:
        assert s not in out and s not in err
    # modes: the run directory is the owner's only; files holding configuration are 0600
    assert _mode(run_dir) == 0o700 and _mode(run_dir / "redis") == 0o700
    for p in (run_dir / "config.yaml", run_dir / "redis" / "users.acl", run_dir / "redis" / "redis.conf",
              *run_dir.glob("checkpoints/*/config.yaml"), *run_dir.glob("logs/*.log")):
        assert _mode(p) == 0o600, p
