"""A JIT-build lock left by an interrupted build no longer hangs the trainer (trainer/jit_lock.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer.jit_lock import builders_in, clear_stale_jit_lock, extension_build_dir

REPO = Path(__file__).resolve().parent.parent


def _lock(build_dir: Path, age_s: float) -> Path:
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    lock.touch()
    t = time.time() - age_s
    os.utime(lock, (t, t))
    return lock


def test_old_lock_without_a_build_is_removed(tmp_path):
    lock = _lock(tmp_path / "op", age_s=600)
    assert clear_stale_jit_lock("op", build_dir=lock.parent) is True
    assert not lock.exists()


def test_no_lock_is_nothing_to_do(tmp_path):
    (tmp_path / "op").mkdir()
    assert clear_stale_jit_lock("op", build_dir=tmp_path / "op") is False


def test_lock_of_a_live_build_is_kept(tmp_path):
    lock = _lock(tmp_path / "op", age_s=600)
    # A process whose working directory is the build directory, as torch's ninja is.
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.parent)
    try:
        deadline = time.time() + 10
        while builder.pid not in builders_in(lock.parent) and time.time() < deadline:
            time.sleep(0.05)
        assert builder.pid in builders_in(lock.parent)
        assert clear_stale_jit_lock("op", build_dir=lock.parent) is False
        assert lock.exists()
    finally:
        builder.kill()
        builder.wait()


def test_young_lock_is_removed_only_once_it_is_old_enough(tmp_path):
    lock = _lock(tmp_path / "op", age_s=0)
    t0 = time.monotonic()
    assert clear_stale_jit_lock("op", build_dir=lock.parent, min_age_s=1.0, poll_s=0.1) is True
    assert time.monotonic() - t0 >= 0.9
    assert not lock.exists()


def test_build_dir_follows_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extension_build_dir("deepspeed_shm_comm") == tmp_path / "deepspeed_shm_comm"


@pytest.mark.slow
def test_trainer_process_group_starts_despite_a_stale_lock(tmp_path):
    """The trap itself: a stale lock in DeepSpeed's shm-op build directory; init must not hang."""
    src = extension_build_dir("deepspeed_shm_comm")
    ext_root = tmp_path / "ext"
    if (src / "deepspeed_shm_comm.so").exists():  # reuse the build; a fresh machine compiles once
        shutil.copytree(src, ext_root / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
    lock = _lock(ext_root / "deepspeed_shm_comm", age_s=3600)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(TORCH_EXTENSIONS_DIR=str(ext_root), DS_ACCELERATOR="cpu",
               PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    code = textwrap.dedent("""
        import logging
        logging.basicConfig(level=logging.INFO)
        from trainer.engine import init_distributed
        print("ranks", init_distributed(), flush=True)
    """)
    # Its own session, so that a hang kills ninja and the compilers too (they would otherwise
    # outlive the test and hold the build directory).
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)  # a compile on a fresh 2-core machine is ~1 min
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"init_distributed hung behind the stale lock:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    assert "ranks (0, 1)" in out
    assert "removed a stale JIT-build lock" in err
    assert not lock.exists()


def test_a_port_taken_before_the_store_binds_it_is_picked_again():
    """The race of free_port() and the gloo store's bind (seen in CI as EADDRINUSE): retried."""
    code = textwrap.dedent("""
        import socket
        import asyncrl.core.net as net
        taken = socket.socket(); taken.bind(("127.0.0.1", 0)); taken.listen(1)
        port = taken.getsockname()[1]
        real, calls = net.free_port, []
        def first_taken(host="127.0.0.1"):
            calls.append(1)
            return port if len(calls) == 1 else real(host)
        net.free_port = first_taken
        from trainer.engine import init_distributed
        import os
        print("ranks", init_distributed(), len(calls), os.environ["MASTER_PORT"] != str(port), flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ranks (0, 1) 2 True" in proc.stdout
