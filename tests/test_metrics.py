"""The metric catalogue (asyncrl/metrics/) against Prometheus' own tools and naming rules.

Each role's real registry is driven once through every metric (``drive_role``) and its
exposition is checked by ``promtool check metrics`` (Debian's prometheus package) and by the
pure-Python lint :func:`asyncrl.metrics.lint_exposition` (which also catches what promtool 2.42
misses: ``_gib``, ``_percent``, high-cardinality labels). The serving helpers are checked over
real HTTP (aiohttp and prometheus_client's threaded server).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from asyncrl import metrics as M

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")


def drive_role(role: str):
    """A fresh registry of ``role`` with every metric updated once; returns ``(registry, metrics)``."""
    reg, m = M.role_registry(role)
    if role == "rollout":
        m.request_finished("stop", duration_seconds=2.0, generated_tokens=64, prompt_tokens=32)
        m.request_finished("budget", duration_seconds=40.0, generated_tokens=128)
        m.sample_completed("stop", duration_seconds=95.0, response_tokens=192)
        m.parked("budget")
        m.resumed()
        m.scored(1.0, "correct")
        m.inflight_requests.set(4)
        m.weights_loaded(3, "disk", duration_seconds=1.5, lag_seconds=2.0)
        m.engine_profile({"decode_forward": 2.5, "idle": 1.0})
        m.engine_prefill(120, 3, 2)
        m.worker_time("scoring", 0.25)
        m.idle.set_idle(False)
    elif role == "buffer":
        m.set_state(samples={"queued": 8, "generating": 4, "partial": 2}, groups={"in_flight": 3, "ready": 1})
        m.set_clock(policy_version=3, lineage=1)
        m.set_bounds(max_staleness=2, group_capacity=16)
        m.sample_staleness.observe(1)
        m.groups_admitted.inc()
        m.admission_wait.observe(0.5)
        m.admission_blocked.inc()
        m.groups_trained.inc(2)
        m.dropped("stale", samples=1, groups=1)
        m.restarted("stale", samples=2, groups=1)
        m.reclaimed.inc()
    elif role == "trainer":
        for phase in M.TRAINER_PHASES:
            with m.phase(phase):
                pass
        m.step_done(
            1,
            tokens=1000,
            response_tokens=600,
            samples=16,
            stats={
                "loss": -0.01,
                "reward_mean": 0.4,
                "accuracy": 0.4,
                "clip_ratio": 0.02,
                "importance_weight_mean": 1.01,
                "importance_weight_max": 3.2,
                "importance_weight_capped_ratio": 0.001,
                "behaviour_kl": 0.0004,
                "entropy": 1.2,
                "grad_norm": 0.8,
                "learning_rate": 1e-6,
                "staleness_max": 1,
                "value_loss": 0.12,
                "explained_variance": 0.4,
                "kl_ctl": 0.05,
            },
        )
        m.published(1, "disk", duration_seconds=0.8, nbytes=540_000_000, lineage=0)
        m.checkpoint_duration.observe(12.0)
        m.checkpoints.labels("ok").inc()
    elif role == "controller":
        m.prompts_fed.inc(16)
        m.dataset_epoch.set(0)
        m.role_processes.labels("rollout").set(2)
        m.restarted("rollout", "exit")
        m.eval_accuracy.set(0.3)
        m.eval_duration.observe(30.0)
        m.run_progress.set(0.1)
    elif role == "reward_model":
        m.request_done("ok", duration_seconds=0.05)
        m.request_done("bad_request")
        m.batch_done(texts=8, tokens=900, duration_seconds=0.02)
        m.queue_texts.set(3)
    elif role == "env_server":
        m.call_done("calculate", "ok", duration_seconds=1.8, latency_seconds=1.7, replay=True)
        m.call_done("calculate", "draining")
        m.in_flight.set(4)
    return reg, m


def families(reg) -> dict:
    text = M.exposition(reg)[0].decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("role", M.ROLES)
def test_every_metric_is_driven_and_exposed(role):
    """The drive helper touches every metric, so the checks below see every series."""
    reg, _ = drive_role(role)
    fams = families(reg)
    empty = sorted(n for n, f in fams.items() if not f.samples)
    assert not empty, f"metrics without a sample after driving {role}: {empty}"
    assert fams["asyncrl_build_info"].samples[0].labels["role"] == role


@needs_promtool
@pytest.mark.parametrize("role", M.ROLES)
def test_promtool_check_metrics(role):
    reg, _ = drive_role(role)
    body, _ = M.exposition(reg)
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (r.stdout + r.stderr).decode()


@needs_promtool
def test_promtool_catches_what_it_should():
    """The promtool check above can fail: a colon name and a counter without _total are reported."""
    bad = b"# HELP x:y bad\n# TYPE x:y counter\nx:y 1\n"
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=bad, capture_output=True, timeout=30)
    assert r.returncode != 0


@pytest.mark.parametrize("role", M.ROLES)
def test_lint_each_role(role):
    reg, _ = drive_role(role)
    assert M.lint_exposition(M.exposition(reg)[0].decode()) == []


def test_lint_catches_bad_names_units_labels():
    reg = CollectorRegistry()
    Gauge("asyncrl_memory_gib", "mem", registry=reg).set(1)
    Gauge("asyncrl_trainer_mfu_percent", "mfu", registry=reg).set(40)
    Histogram("asyncrl_latency_ms", "lat", registry=reg).observe(3)
    Counter("asyncrl_requests", "req", ["request_id"], registry=reg).labels("r-123").inc()
    Gauge("asyncrl_accuracy_ratio", "acc", registry=reg).set(40)
    Gauge("other_thing", "not ours", registry=reg).set(1)
    Gauge("asyncrl_no_help", "", registry=reg).set(1)
    problems = "\n".join(M.lint_exposition(M.exposition(reg)[0].decode()))
    for expected in (
        "asyncrl_memory_gib: use base units",
        "asyncrl_trainer_mfu_percent: use base units",
        "asyncrl_latency_ms: use base units",
        "asyncrl_requests_total: high-cardinality label(s) ['request_id']",
        "ratio 40.0 outside 0..1",
        "other_thing: name must start with asyncrl_",
        "asyncrl_no_help: no help text",
    ):
        assert expected in problems, problems
    assert "sglang" not in M.lint_exposition("# HELP sglang:num_running_reqs x\n# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 1\n")


def test_no_created_series_and_counter_suffix():
    reg, _ = drive_role("rollout")
    text = M.exposition(reg)[0].decode()
    assert "_created" not in text
    assert "asyncrl_rollout_generated_tokens_total 192.0" in text
    assert 'asyncrl_rollout_requests_total{finish_reason="budget"} 1.0' in text


def test_histogram_buckets_fit_minutes_long_rollouts():
    assert max(M.ROLLOUT_DURATION_BUCKETS_SECONDS) >= 1800
    assert max(M.REQUEST_DURATION_BUCKETS_SECONDS) >= 600
    assert max(M.PHASE_DURATION_BUCKETS_SECONDS) >= 1800
    reg, _ = drive_role("rollout")
    buckets = [
        s.labels["le"]
        for s in families(reg)["asyncrl_rollout_duration_seconds"].samples
        if s.name.endswith("_bucket")
    ]
    assert "1800.0" in buckets and "+Inf" in buckets
    assert M.exponential_buckets(1, 2, 4) == (1.0, 2.0, 4.0, 8.0)
    with pytest.raises(ValueError, match="factor > 1"):
        M.exponential_buckets(1, 1, 4)


def test_labels_are_closed_sets():
    reg, m = M.role_registry("rollout")
    with pytest.raises(ValueError, match="unknown finish_reason 'eos'"):
        m.request_finished("eos", 1.0, 1)
    with pytest.raises(ValueError, match="park reason"):
        m.parked("because")
    with pytest.raises(ValueError, match="transport"):
        m.weights_loaded(1, "ftp", 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        m.request_finished("stop", -1.0, 1)
    with pytest.raises(ValueError, match="sample finish_reason"):
        m.sample_completed("abort", 1.0, 3)
    with pytest.raises(ValueError, match="engine component"):
        m.engine_profile({"decode_forward": 1.0, "gpu_time": 1.0})
    with pytest.raises(ValueError, match="worker component"):
        m.worker_time("sleeping", 1.0)
    with pytest.raises(ValueError, match="prompt cache hits must be >= 0"):
        m.engine_prefill(10, -1)
    with pytest.raises(ValueError, match=">= 0"):
        m.worker_time("claim", -1.0)
    with pytest.raises(ValueError, match="generated_tokens must be >= 0"):
        m.request_finished("stop", 1.0, -5)
    text = M.exposition(reg)[0].decode()  # nothing half-applied: the pre-created series stay at 0
    assert re.findall(r"^asyncrl_rollout_requests_total\{[^}]*\} (\S+)$", text, re.M) == ["0.0"] * len(M.FINISH_REASONS)
    assert re.search(r"^asyncrl_rollout_generated_tokens_total 0\.0$", text, re.M)
    assert "asyncrl_rollout_duration_seconds_bucket{" not in M.exposition(reg)[0].decode()

    breg, b = M.role_registry("buffer")
    with pytest.raises(ValueError, match="sample state"):
        b.set_state(samples={"queued": 1, "bogus": 2})
    assert "asyncrl_buffer_samples{" not in M.exposition(breg)[0].decode()
    with pytest.raises(ValueError, match="drop reason"):
        b.dropped("whim", samples=1)
    with pytest.raises(ValueError, match="restart reason"):
        b.restarted("whim", samples=1)

    _, t = M.role_registry("trainer")
    with pytest.raises(ValueError, match="trainer phase"):
        with t.phase("backward"):
            pass
    with pytest.raises(ValueError, match="unknown trainer stats"):
        t.step_done(1, 1, 1, 1, {"los": 1.0})
    assert t.steps._value.get() == 0

    _, c = M.role_registry("controller")
    with pytest.raises(ValueError, match="role"):
        c.restarted("gpu", "exit")
    with pytest.raises(ValueError, match="role"):
        M.role_registry("janitor")
    with pytest.raises(ValueError, match="role"):
        M.build_info(CollectorRegistry(), "janitor")


def test_idle_tracker_counts_live_during_a_long_idle_spell():
    now = [100.0]
    reg = CollectorRegistry()
    idle = M.IdleTracker(reg, "rollout", "test", clock=lambda: now[0])
    now[0] += 10  # idle from creation
    idle.set_idle(False)
    now[0] += 30  # busy
    idle.set_idle(True)
    now[0] += 20  # idle, no transition yet: the scrape must see it
    fams = families(reg)
    assert fams["asyncrl_rollout_idle_seconds"].samples[0].value == pytest.approx(30.0)
    assert fams["asyncrl_rollout_idle_ratio"].samples[0].value == pytest.approx(0.5)
    with idle.idle():
        now[0] += 5
    now[0] += 5
    assert idle.idle_seconds() == pytest.approx(35.0)


def test_trainer_wait_batch_counts_as_idle():
    _, t = M.role_registry("trainer")
    t.idle.set_idle(False)
    before = t.idle.idle_seconds()
    import time

    t0 = time.monotonic()
    with t.phase("wait_batch"):
        time.sleep(0.05)
    t1 = time.monotonic()
    with t.phase("forward_backward"):
        time.sleep(0.05)
    gained = t.idle.idle_seconds() - before
    assert 0.05 <= gained <= (t1 - t0) + 1e-3  # the wait, not the forward_backward time


def test_git_sha_and_build_info(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCRL_GIT_SHA", "abc123")
    reg = CollectorRegistry()
    M.build_info(reg, "trainer")
    assert 'asyncrl_build_info{git_sha="abc123",role="trainer",version="0.1.0"} 1.0' in M.exposition(reg)[0].decode()
    monkeypatch.delenv("ASYNCRL_GIT_SHA")
    (tmp_path / ".git" / "refs" / "heads").mkdir(parents=True)
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / ".git" / "packed-refs").write_text("# pack-refs\n" + "f" * 40 + " refs/heads/main\n")
    assert M.git_sha(tmp_path) == "f" * 40
    (tmp_path / ".git" / "refs" / "heads" / "main").write_text("e" * 40 + "\n")
    assert M.git_sha(tmp_path) == "e" * 40
    assert M.git_sha(tmp_path / "nowhere") == "unknown"


#: What Prometheus 2.42 sends when it scrapes.
PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def _registry_with_sglang_names():
    from prometheus_client.core import GaugeMetricFamily

    class Engine:
        def describe(self):
            return []

        def collect(self):
            g = GaugeMetricFamily("sglang:num_running_reqs", "Running requests.", labels=["model_name"])
            g.add_metric(["tiny"], 3.0)
            yield g

    reg, m = drive_role("rollout")
    reg.register(Engine())
    return reg


async def test_metrics_app_handler_over_real_http():
    """aiohttp serves the registry with the charset in the header (no ValueError), in the
    classic text format even when Prometheus 2 asks for OpenMetrics, so SGLang-named series
    keep their colons (prometheus_client's OpenMetrics encoder would rename them)."""
    import aiohttp
    from aiohttp import web

    reg = _registry_with_sglang_names()
    app = web.Application()
    app.router.add_get("/metrics", M.metrics_app_handler(reg))
    from rollout_server.testing import serve_app

    async with serve_app(app) as port, aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            text = await r.text()
    assert "asyncrl_rollout_partial_resumes_total 1.0" in text
    assert 'sglang:num_running_reqs{model_name="tiny"} 3.0' in text
    # the trap this avoids, shown on the client library itself:
    from prometheus_client.exposition import choose_encoder

    encoder, content_type = choose_encoder(PROMETHEUS_2_ACCEPT)
    assert "openmetrics" in content_type and "sglang_num_running_reqs{" in encoder(reg).decode()


def test_start_metrics_server_serves_and_reports_port_conflicts():
    reg, _ = drive_role("trainer")
    port = M.start_metrics_server(reg, 0)
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            text = r.read().decode()
        assert "asyncrl_trainer_steps_total 1.0" in text
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            M.start_metrics_server(reg, port)
    finally:
        M.stop_metrics_server(port)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    M.stop_metrics_server(port)  # second stop is a no-op


def test_docs_list_every_metric_and_nothing_else():
    """docs/metrics.md names every metric with its type; it names no metric that does not exist."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    exposed = set()
    for role in M.ROLES:
        reg, _ = drive_role(role)
        for fam in text_string_to_metric_families(M.exposition(reg)[0].decode()):
            name = fam.name + ("_total" if fam.type == "counter" else "")
            exposed.add(name)
            row = re.search(rf"^\| `{re.escape(name)}` \| (\w+) \|", doc, re.M)
            assert row, f"docs/metrics.md has no table row for {name}"
            assert row.group(1) == fam.type, f"{name}: documented as {row.group(1)}, is {fam.type}"
    documented = set(re.findall(r"^\| `(asyncrl_[a-z0-9_]+)`", doc, re.M))
    assert documented <= exposed, f"documented but not defined: {sorted(documented - exposed)}"
    for name in M.SGLANG_ENGINE_METRICS:
        assert f"`{name}`" in doc, name
