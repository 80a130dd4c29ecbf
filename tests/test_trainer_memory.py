"""The trainer's heap (trainer/memory.py): freed activations go back to the system.

Each trainer runs in a fresh interpreter: the malloc setting is process-wide, and glibc's dynamic
threshold must start from its default. Assertions are on glibc's own accounting (bytes in mmapped
blocks, ``mallinfo2().hblkhd``), never on resident memory or time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.core.config import ConfigError, load_config
from trainer.memory import fix_mmap_threshold, malloc_stats

ROOT = Path(__file__).resolve().parent.parent
glibc_only = pytest.mark.skipif(malloc_stats() is None, reason="the C library is not glibc")

# A real trainer (tiny model, DeepSpeed on CPU) trains one step, after glibc's dynamic threshold was
# raised to 16 MiB by freeing a mapped 16 MiB block; then a 2 MiB tensor is allocated. Printed:
# the step's loss and how many bytes of that tensor are a mapping of its own.
CHILD = """
import json, sys, tempfile
import torch
from tests.test_trainer import make_cfg, make_groups
from trainer.loop import ListBatchSource, train_loop
from trainer.memory import malloc_stats
from trainer.trainer import Trainer
big = torch.empty(16 << 20, dtype=torch.uint8); big.fill_(1); del big
extra = json.loads(sys.argv[2])
cfg = make_cfg(tempfile.mkdtemp(), sys.argv[1], **extra)
trainer = Trainer(cfg)
records = []
train_loop(trainer, ListBatchSource([make_groups(2, trainer.model_config.vocab_size)]), max_steps=1,
           on_step=records.append)
trainer.close()
before = malloc_stats().hblkhd
t = torch.empty(2 << 20, dtype=torch.uint8)
print("RESULT " + json.dumps({"mapped": malloc_stats().hblkhd - before, "loss": records[0]["loss"]}))
"""


def _child(model_dir: Path, **trainer) -> dict:
    # not this process's rendezvous: an in-process trainer test leaves WORLD_SIZE and a MASTER_PORT
    # that is still bound here, and a child that inherits them cannot listen on it
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous}, "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), json.dumps(trainer)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@glibc_only
@pytest.mark.slow
def test_trainer_maps_large_blocks_and_trains_the_same(tiny_model_dir):
    fixed = _child(tiny_model_dir, heap_mmap_threshold_bytes=1 << 20)
    dynamic = _child(tiny_model_dir)  # the default: glibc's dynamic threshold
    # with the trainer's setting, a 2 MiB block is its own mapping (returned to the system on free)
    assert fixed["mapped"] >= 2 << 20
    # glibc's default after a 16 MiB mapped block was freed: the heap serves it (and keeps it)
    assert dynamic["mapped"] == 0
    # where memory comes from does not change the maths
    assert fixed["loss"] == pytest.approx(dynamic["loss"], abs=1e-6)


def test_threshold_out_of_range_is_refused():
    with pytest.raises(ValueError, match="4096"):
        fix_mmap_threshold(1024)
    with pytest.raises(ValueError, match="mallopt"):
        fix_mmap_threshold(64 << 20)
    for bad in (100, 64 << 20):
        with pytest.raises(ConfigError, match="heap_mmap_threshold_bytes"):
            load_config([], environ={}, overrides={"trainer": {"heap_mmap_threshold_bytes": bad}})
    assert load_config([], environ={}).trainer.heap_mmap_threshold_bytes is None


def _fresh_interpreter(code: str) -> str:
    """Run ``code`` in a new Python process (this repo importable); its stdout. Fails on a non-zero exit."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@glibc_only
def test_malloc_stats_reads_glibc():
    # in a fresh interpreter: in a long-lived one (the whole suite) the heap may hold a free chunk of
    # 64 MiB, and malloc serves a request from the heap before it considers a mapping
    code = ("from trainer.memory import malloc_stats\n"
            "before = malloc_stats().hblkhd\n"
            "block = bytearray(64 << 20)  # above any threshold glibc allows: a mapping in a fresh heap\n"
            "print(malloc_stats().hblkhd - before)\n")
    assert int(_fresh_interpreter(code).split()[-1]) >= 64 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc/self/status and clear_refs")
def test_resident_memory_and_its_peak_follow_a_real_allocation():
    # in a fresh interpreter: 300 MB written (so resident, not lazily mapped), freed, then the peak reset
    code = ("import json\n"
            "from trainer.memory import reset_peak_resident, resident_memory\n"
            "assert reset_peak_resident()\n"
            "rss0, _ = resident_memory()\n"
            "block = b'x' * 300_000_000\n"
            "rss1, peak1 = resident_memory()\n"
            "del block\n"
            "rss2, peak2 = resident_memory()\n"
            "reset_peak_resident()\n"
            "rss3, peak3 = resident_memory()\n"
            "print(json.dumps([rss0, rss1, peak1, rss2, peak2, rss3, peak3]))\n")
    rss0, rss1, peak1, rss2, peak2, rss3, peak3 = json.loads(_fresh_interpreter(code).splitlines()[-1])
    # the kernel folds per-thread page counts into VmHWM lazily: a few MB of slack
    slack = 0.01
    assert rss1 - rss0 >= 0.29 and peak1 >= rss1 - slack   # the block is resident and in the peak
    assert rss2 < rss1 - 0.25 and peak2 >= rss1 - slack    # freed (its own mapping): gone, the peak stays
    assert peak3 < peak2 - 0.25 and peak3 >= rss3 - slack  # the reset brings the peak down to now
