"""bench/gpu_check.sh on a machine without a GPU: argument handling, --dry-run, the JSON it writes,
and a failing stage that is recorded while the check goes on (issue 28 item 5).

Every test runs the real script (the shell wrapper and bench/gpu_check.py) as a subprocess; no
stage that needs torch is started, so the file takes a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.sh"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


gc = _module()


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def reports(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("gpu_check-*.json"))


@pytest.mark.parametrize("args, message", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--only", "warp_drive"], "invalid choice: 'warp_drive'"),
    (["--budget-seconds", "-1"], "--budget-seconds must be >= 0"),
    (["--wheels", "/nonexistent/wheels"], "not a directory"),
    (["--main-job-steps", "0"], "--main-job-steps must be >= 1"),
])
def test_usage_errors_exit_2_and_write_nothing(tmp_path, args, message):
    p = run(*args, "--out-dir", str(tmp_path))
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert "usage: bench/gpu_check.sh" in p.stderr
    assert reports(tmp_path) == []


def test_help_lists_every_stage():
    p = run("--help")
    assert p.returncode == 0
    for name in gc.STAGE_NAMES:
        assert name in p.stdout


def test_dry_run_prints_the_plan_and_writes_a_dry_run_report(tmp_path):
    p = run("--dry-run", "--out-dir", str(tmp_path))
    assert p.returncode == 0, p.stderr
    for stage in gc.STAGES:
        assert f"{stage.name}" in p.stdout and f"timeout {stage.timeout:4.0f} s" in p.stdout
    assert "bench/rollout_bench.py" in p.stdout and "--device cuda" in p.stdout
    assert "asyncrl.cli train" in p.stdout and "--run.total_steps 20" in p.stdout and "-m gpu" in p.stdout
    [path] = reports(tmp_path)
    assert path.name.endswith("-dry-run.json")
    rep = json.loads(path.read_text())
    assert gc.validate_report(rep) == []
    assert rep["dry_run"] is True and rep["schema"] == gc.SCHEMA
    assert list(rep["stages"]) == gc.STAGE_NAMES
    for name, s in rep["stages"].items():
        assert s["ran"] is False and s["why"] == "dry run", name
        assert s["timeout_seconds"] > 0 and s["command"]
    # the stages' own timeouts fit the budget (wheels aside: the budget then cuts the last one)
    assert sum(s.timeout for s in gc.STAGES if s.name != "wheels") <= gc.DEFAULT_BUDGET_SECONDS < 12 * 60
    assert not any(tmp_path.glob("logs-*")), "a dry run writes no logs"
    # no path of this machine in the report: the repository, the report's folder, the work
    # directory, the interpreter and the home directory are named by their role
    text = path.read_text()
    for local in (str(REPO), str(tmp_path), "/tmp/", sys.executable, str(Path.home()) + "/"):
        assert local not in text, local
    assert "<work>/runs" in text and "bench/rollout_bench.py" in text
    # a rerun adds a report, never overwrites one
    assert run("--dry-run", "--out-dir", str(tmp_path)).returncode == 0
    assert len(reports(tmp_path)) == 2


def test_failing_stage_is_recorded_and_the_check_goes_on(tmp_path):
    """A wheel that is not a zip: pip fails (no network is touched: --no-index), the stage records
    the exit status and pip's message, and the next stage is still evaluated."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "bogus-0.0-py3-none-any.whl").write_bytes(b"this is not a zip file")
    out = tmp_path / "out"
    p = run("--only", "wheels", "sglang", "--wheels", str(wheels), "--out-dir", str(out), timeout=120)
    assert p.returncode == 0, p.stderr
    assert "FAILED" in p.stdout
    [path] = reports(out)
    rep = json.loads(path.read_text())
    assert gc.validate_report(rep) == []
    w = rep["stages"]["wheels"]
    assert w["ran"] is True and w["ok"] is False and w["returncode"] not in (0, None)
    assert "exit status" in w["error"] and w["command"][1:4] == ["-m", "pip", "install"]
    assert (out / w["log"]).is_file() and w["log_tail"]  # relative to the report's folder
    assert "bogus-0.0-py3-none-any.whl" in w["command"][-1]
    assert w["command"][0] == "python" and w["command"][-1] == "<wheels>/bogus-0.0-py3-none-any.whl"
    assert str(tmp_path) not in path.read_text()
    s = rep["stages"]["sglang"]
    if importlib.util.find_spec("sglang") is None:
        assert s == {"ran": False, "why": "python module 'sglang' is not importable"}
        assert rep["summary"]["sglang"].startswith("not run: python module 'sglang'")
    else:  # pragma: no cover - a machine with SGLang
        assert s["ran"] is True
    for name in ("environment", "model", "decode", "trainer", "main_job", "gpu_tests"):
        assert rep["stages"][name] == {"ran": False, "why": "not selected (--only/--skip)"}


def test_missing_requirements_and_spent_budget_are_said(tmp_path):
    """Without the model stage the GPU stages are not run and say why; with no budget left a
    stage whose requirements are met is not started."""
    p = run("--only", "decode", "trainer", "main_job", "wheels", "--wheels", str(tmp_path), "--budget-seconds", "0",
            "--out-dir", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    rep = json.loads(reports(tmp_path / "out")[0].read_text())
    assert gc.validate_report(rep) == []
    for name in ("decode", "trainer", "main_job"):
        assert "stage 'model' did not succeed" in rep["stages"][name]["why"], name
    if importlib.util.find_spec("pip") is not None:
        assert rep["stages"]["wheels"]["why"].startswith("budget spent")
    assert rep["summary"]["decode_tokens_per_second_by_batch"] is None and rep["summary"]["mfu"] is None


def test_gpu_tests_stage_collects_only_the_files_with_gpu_marks():
    files = [Path(f).name for f in gc.gpu_test_files()]
    assert "test_rollout_launch.py" in files and "test_gpu_check.py" not in files


def test_validate_report_rejects_a_bad_shape():
    good = {"schema": gc.SCHEMA, "dry_run": False, "started": "t", "finished": "t", "wall_seconds": 1.0, "argv": [],
            "budget_seconds": 690.0, "git": {}, "summary": {},
            "stages": {n: {"ran": False, "why": "x"} for n in gc.STAGE_NAMES}}
    assert gc.validate_report(good) == []
    bad = json.loads(json.dumps(good))
    bad["stages"]["decode"] = {"ran": True, "ok": False, "seconds": 1.0, "timeout_seconds": 9, "error": None, "result": None}
    bad["stages"]["trainer"] = {"ran": False}
    del bad["stages"]["sglang"]
    errs = gc.validate_report(bad)
    assert any("decode: failed without an error" in e for e in errs)
    assert any("trainer: not run but no 'why'" in e for e in errs)
    assert any(e.startswith("stages are") for e in errs)


def test_mfu_uses_the_datasheet_peak_of_the_device():
    assert gc.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert gc.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert gc.peak_tflops("NVIDIA H200", "fp32") == 66.9
    assert gc.peak_tflops("Some Future GPU", "bf16") is None
    # 6 N FLOPs per token: 135M parameters at 100k tokens/s on 989.4 TFLOPS
    assert gc.mfu(1e5, 135_000_000, 989.4) == pytest.approx(6 * 135e6 * 1e5 / 989.4e12)
    assert gc.mfu(1e5, 135_000_000, None) is None


def test_summary_of_stage_results_has_units_in_its_keys():
    stages = {n: {"ran": False, "why": "x"} for n in gc.STAGE_NAMES}
    stages["decode"] = {"ran": True, "ok": True, "result": {"rows": [
        {"concurrency": 1, "ceiling_tokens_per_second": 150.0}, {"concurrency": 64, "ceiling_tokens_per_second": 9000.0}]}}
    stages["trainer"] = {"ran": True, "ok": True, "result": {"trainer_tokens_per_second": 5e4, "mfu": 0.04,
                                                             "publish_seconds": 0.9, "load_seconds": 0.2}}
    s = gc.summarize(stages)
    assert s["decode_tokens_per_second_by_batch"] == {"1": 150.0, "64": 9000.0}
    assert s["trainer_tokens_per_second"] == 5e4 and s["mfu"] == 0.04 and s["load_seconds"] == 0.2
    assert s["main_job_ok"] is None and s["sglang"] == "not run: x"
