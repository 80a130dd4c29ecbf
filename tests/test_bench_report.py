"""bench/_report.py: benchmark records name paths portably (no absolute path of the measuring machine)."""

from __future__ import annotations

from conftest import load_bench

R = load_bench("_report")


def test_record_path_names_run_files_models_and_other_paths(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "async-s1"
    (run / "weights" / "v000050").mkdir(parents=True)
    (run / "run_state.json").write_text("{}")
    assert R.record_path(run / "weights" / "v000050") == "async-s1/weights/v000050"
    assert R.record_path(str(run)) == "async-s1"
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    assert R.record_path(tmp_path / "cache" / "models" / "smollm2-135m-instruct") == "smollm2-135m-instruct"
    (tmp_path / "opsd-eval-model").mkdir()
    assert R.record_path(tmp_path / "opsd-eval-model") == "opsd-eval-model"
    for given in ("base", "smollm2-135m-instruct", "nccl://host:1/v3"):
        assert R.record_path(given) == given


def test_portable_rewrites_paths_under_the_roots_only():
    roots = {"/srv/repo": "", "/srv/repo/.venv/bin/python": "python", "/tmp/work_1": "<work>", "/home/u": "~"}
    record = {"argv": ["/srv/repo/.venv/bin/python", "/srv/repo/bench/x.py", "--out=/tmp/work_1/runs", "/srv/repo"],
              "log": "/srv/repo-other/a.log", "n": 3, "note": "see /home/u/notes and '/tmp/work_1'",
              "/srv/repo/key": "/tmp/work_10/x"}
    assert R.portable(record, roots) == {
        "argv": ["python", "bench/x.py", "--out=<work>/runs", "."],
        "log": "/srv/repo-other/a.log", "n": 3, "note": "see ~/notes and '<work>'",
        "/srv/repo/key": "/tmp/work_10/x"}
    assert R.portable(record, {}) == record
