"""monitoring/ checked with the real tools: promtool (rules, rule unit tests, configs) and a
real Prometheus server scraping real /metrics endpoints.

Also holds :class:`PrometheusServer` (used by the ``prometheus_server`` fixture in
conftest.py): a real ``prometheus`` process with 1 s scrapes and asyncrl's rule files, so an
end-to-end test of ``asyncrl train`` only has to name its targets and call
:meth:`PrometheusServer.assert_dashboard_has_data`.

Grafana itself is not available offline (no Debian/PyPI server); the dashboard is checked as
JSON (hygiene, every expression parsed by promtool, every metric name exists) and its queries
are evaluated against the real Prometheus server.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from asyncrl import metrics as M

REPO = Path(__file__).resolve().parent.parent
MON = REPO / "monitoring"
RULES = sorted((MON / "prometheus" / "rules").glob("*.yml"))
ALERTS = MON / "prometheus" / "rules" / "asyncrl-alerts.yml"
RULE_TESTS = MON / "prometheus" / "tests" / "asyncrl-rules-test.yml"
DASHBOARDS = sorted((MON / "grafana" / "dashboards").glob("*.json"))
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus server (Debian package prometheus)")

#: Grafana macros -> PromQL durations. ``$__rate_interval`` is at least 4 scrape intervals.
MACROS = {"$__rate_interval": "5m", "$__interval": "5m", "$__range": "5m"}


def promtool(*args: str, input: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], input=input, capture_output=True, timeout=60)


# ----------------------------------------------------------------------------------------------
# dashboard helpers


def dashboard_targets(path: Path = MON / "grafana" / "dashboards" / "asyncrl-overview.json") -> list[tuple[str, str]]:
    """``(panel title, expr)`` for every query target of a dashboard, in panel order."""
    dash = json.loads(path.read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def expand(expr: str, rate_interval: str = "5m", run: str = ".*") -> str:
    """Replace Grafana macros and template variables so the expression is plain PromQL."""
    for macro in MACROS:
        expr = expr.replace(macro, rate_interval)
    return expr.replace("$run", run)


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (asyncrl_*, sglang:*, run:* recordings, up)."""
    return set(re.findall(r"\b(asyncrl_[a-z0-9_]+|sglang:[a-z0-9_]+|run(?:_phase)?:[a-z0-9_:]+)", expr)) | (
        {"up"} if re.search(r"\bup\{", expr) else set()
    )


def exposed_sample_names() -> set[str]:
    """Every sample name asyncrl's registries expose (``_total``, ``_bucket`` ... included)."""
    from prometheus_client.parser import text_string_to_metric_families

    from test_metrics import drive_role

    names: set[str] = set()
    for role in M.ROLES:
        reg, _ = drive_role(role)
        for fam in text_string_to_metric_families(M.exposition(reg)[0].decode()):
            names |= {s.name for s in fam.samples}
    return names


def sglang_sample_names() -> set[str]:
    """Sample names of the SGLang engine metrics asyncrl's dashboard may use."""
    out = set()
    for name, kind in M.SGLANG_ENGINE_METRICS.items():
        out |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return out


# ----------------------------------------------------------------------------------------------
# real Prometheus server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    """A real ``prometheus`` process scraping the given targets every second.

    Args:
        workdir: directory for the config and the TSDB.
        targets: ``component -> ["host:port", ...]`` (component: rollout/trainer/controller);
            each target gets the labels ``run`` and ``component`` as in monitoring/prometheus.yml.
        run: the ``run`` target label.
        rule_files: rule files to load (default: asyncrl's recording and alert rules).

    Raises:
        RuntimeError: the server did not become ready within 30 s (with its log).
    """

    def __init__(self, workdir: Path, targets: dict[str, list[str]], run: str = "test", rule_files: list[Path] | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in (RULES if rule_files is None else rule_files)],
            "scrape_configs": [
                {
                    "job_name": f"asyncrl-{component}",
                    "static_configs": [{"targets": list(addrs), "labels": {"run": run, "component": component}}],
                }
                for component, addrs in targets.items()
            ],
        }
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = self.workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "PrometheusServer":
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus not ready after 30 s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _get(self, path: str, **params: str) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:  # 400/422 carry the PromQL error
            body = json.load(exc)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; returns the result vector (``[{"metric": {...}, "value": [t, "v"]}, ...]``).

        Raises:
            AssertionError: the query failed (bad PromQL), with Prometheus' message.
        """
        return self._get("/api/v1/query", query=expr)["result"]

    def wait_for(self, expr: str, timeout: float = 30.0, predicate=lambda result: bool(result)) -> list[dict]:
        """Poll ``expr`` until ``predicate(result)`` holds; returns the result.

        Raises:
            AssertionError: the timeout passed (with the last result and the targets' health).
        """
        deadline = time.monotonic() + timeout
        result: list[dict] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if predicate(result):
                return result
            time.sleep(0.5)
        targets = self._get("/api/v1/targets")["activeTargets"]
        health = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
        raise AssertionError(f"{expr!r} still {result!r} after {timeout} s; targets: {health}")

    def rule_health(self) -> list[tuple[str, str, str]]:
        """``(rule name, health, last error)`` of every loaded rule."""
        groups = self._get("/api/v1/rules")["groups"]
        return [(r["name"], r["health"], r.get("lastError", "")) for g in groups for r in g["rules"]]

    def assert_dashboard_has_data(self, skip=lambda title, expr: False, rate_interval: str = "10s",
                                  timeout: float = 0.0) -> dict[str, float]:
        """Evaluate every dashboard query; each must succeed and return at least one sample.

        ``skip(title, expr)`` excludes queries whose source is not running (e.g. ``sglang:``
        names without an engine). Queries still empty are re-evaluated every second for up to
        ``timeout`` seconds (a ``rate()`` needs two scrapes with a change: on a fast machine a live
        run can reach the check before every window has them). Returns ``{expr: first value}``.

        Raises:
            AssertionError: a query failed, or some returned nothing by the deadline (listing them).
        """
        pending = [(title, expr) for title, expr in dashboard_targets() if not skip(title, expr)]
        values: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while True:
            empty = []
            for title, expr in pending:
                result = self.query(expand(expr, rate_interval))
                if result:
                    values[expr] = float(result[0]["value"][1])
                else:
                    empty.append((title, expr))
            pending = empty
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        assert not pending, "dashboard queries without data:\n  " + "\n  ".join(f"{t}: {e}" for t, e in pending)
        return values


# ----------------------------------------------------------------------------------------------
# rules


@needs_promtool
def test_promtool_check_rules():
    r = promtool("check", "rules", *map(str, RULES))
    assert r.returncode == 0, (r.stdout + r.stderr).decode()


@needs_promtool
def test_promtool_rule_unit_tests_pass():
    r = promtool("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0 and b"SUCCESS" in r.stdout, (r.stdout + r.stderr).decode()


def test_every_alert_has_a_firing_and_a_quiet_case():
    alerts = [r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r]
    required = {"TrainerStalled", "StalenessAboveBound", "BufferStarved", "BufferOverflowing", "RolloutServerDown", "RewardCollapse"}
    assert required <= {a.removeprefix("AsyncRL") for a in alerts}
    cases = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    for alert in alerts:
        mine = [c for c in cases if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in mine), f"{alert}: no case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{alert}: no case where it must stay quiet"
        for c in mine:
            for a in c["exp_alerts"]:
                assert a["exp_labels"].get("run") != "good", f"{alert}: the good run must not fire"


@needs_promtool
def test_rule_unit_tests_can_fail(tmp_path):
    """A mutated threshold makes `promtool test rules` fail: the unit tests check something."""
    rules = tmp_path / "rules"
    rules.mkdir()
    for p in RULES:
        (rules / p.name).write_text(p.read_text().replace("> 900", "> 90000").replace("> 0.9", "> 1.5"))
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    r = promtool("test", "rules", str(tests / RULE_TESTS.name))
    out = (r.stdout + r.stderr).decode()
    assert r.returncode != 0 and "AsyncRLTrainerStalled" in out and "AsyncRLBufferStarved" in out, out


def test_rules_reference_existing_metrics():
    exposed = exposed_sample_names()
    recorded = {r["record"] for p in RULES for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"] if "record" in r}
    for p in RULES:
        for g in yaml.safe_load(p.read_text())["groups"]:
            for rule in g["rules"]:
                for name in metric_names(rule["expr"]) - {"up"}:
                    assert name in exposed or name in recorded, f"{p.name}: {rule.get('alert') or rule.get('record')} uses unknown {name}"
    for name in recorded:
        assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", name), f"{name}: recording rules are level:metric:operations"


# ----------------------------------------------------------------------------------------------
# scrape configs


@needs_promtool
def test_promtool_check_single_machine_config():
    r = promtool("check", "config", str(MON / "prometheus" / "prometheus.yml"))
    assert r.returncode == 0, (r.stdout + r.stderr).decode()


@needs_promtool
def test_kubernetes_scrape_config(tmp_path):
    """Debian's prometheus (2.42) is built without Kubernetes service discovery and predates
    ``scrape_protocols``, so promtool rejects both outright; we check them here and let
    promtool check everything else (relabel regexes, rule files) with the SD block swapped
    for a static target."""
    src = MON / "prometheus" / "prometheus-kubernetes.yml"
    cfg = yaml.safe_load(src.read_text())
    job = cfg["scrape_configs"][0]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"own_namespace": True}}]
    drop = next(r for r in job["relabel_configs"] if r["action"] == "drop" and "trainer" in r["regex"])
    sep = ";"
    assert re.fullmatch(drop["regex"], f"trainer{sep}1") and re.fullmatch(drop["regex"], f"trainer{sep}12")
    assert not re.fullmatch(drop["regex"], f"trainer{sep}0") and not re.fullmatch(drop["regex"], f"rollout{sep}1")
    relabel = {(tuple(r.get("source_labels", [])), r.get("target_label")) for r in job["relabel_configs"]}
    assert (("__meta_kubernetes_pod_label_app_kubernetes_io_instance",), "run") in relabel
    assert (("__meta_kubernetes_pod_label_app_kubernetes_io_component",), "component") in relabel
    keep = job["relabel_configs"][0]
    assert keep["action"] == "keep" and keep["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    port_rule = next(r for r in job["relabel_configs"] if r.get("target_label") == "__address__")
    assert re.fullmatch(port_rule["regex"], "10.0.0.7:8080;9400") and re.sub(
        port_rule["regex"], port_rule["replacement"].replace("$", "\\"), "10.0.0.7:8080;9400"
    ) == "10.0.0.7:9400"
    assert job["scrape_protocols"] == ["PrometheusText0.0.4"]  # keeps sglang: colons (see the config)
    del job["scrape_protocols"]  # unknown to promtool 2.42 (added in Prometheus 2.49)
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [{"targets": ["127.0.0.1:9400"]}]
    (tmp_path / "rules").symlink_to(MON / "prometheus" / "rules")
    (tmp_path / "prom.yml").write_text(yaml.safe_dump(cfg))
    r = promtool("check", "config", str(tmp_path / "prom.yml"))
    assert r.returncode == 0, (r.stdout + r.stderr).decode()


# ----------------------------------------------------------------------------------------------
# dashboards and provisioning


def test_dashboard_json_hygiene():
    assert DASHBOARDS, "no dashboards in monitoring/grafana/dashboards"
    uids = []
    for path in DASHBOARDS:
        text = path.read_text()
        assert "<<<<<<<" not in text and ">>>>>>>" not in text
        dash = json.loads(text)
        uids.append(dash["uid"])
        assert dash["id"] is None, f"{path.name}: id must be null (Grafana assigns it)"
        assert "__inputs" not in dash and "DS_PROMETHEUS" not in text, f"{path.name}: __inputs only work for UI import"
        assert dash["schemaVersion"] >= 36
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert "run" in variables
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids))
        for p in dash["panels"]:
            if p["type"] == "row":
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}", p["title"]
                assert 'run=~"$run"' in t["expr"] or "asyncrl_build_info" in t["expr"], f"{p['title']}: filter by $run"
            gp = p["gridPos"]
            assert 0 <= gp["x"] and gp["x"] + gp["w"] <= 24
    assert len(uids) == len(set(uids)), f"duplicate dashboard uids: {uids}"


def test_dashboard_is_the_generator_output():
    """The committed JSON is what monitoring/grafana/build_dashboard.py renders (no drift)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_dashboard", MON / "grafana" / "build_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (MON / "grafana" / "dashboards" / "asyncrl-overview.json").read_text() == mod.render(), (
        "run `python monitoring/grafana/build_dashboard.py` and commit the JSON"
    )


def test_dashboard_covers_the_run_overview():
    exprs = " ".join(e for _, e in dashboard_targets())
    for needed in (
        "asyncrl_rollout_generated_tokens_total",  # throughput
        "asyncrl_buffer_policy_version",  # versions
        "asyncrl_buffer_sample_staleness_bucket",  # staleness
        "asyncrl_rollout_partial_resumes_total",  # partial ratio
        "asyncrl_buffer_samples",  # buffer depth
        "asyncrl_trainer_reward_mean",
        "asyncrl_trainer_accuracy_ratio",
        "asyncrl_trainer_step_duration_seconds_sum",  # trainer phases
        "asyncrl_trainer_weight_publish_duration_seconds_bucket",  # weight sync
        "sglang:num_running_reqs",  # engine load
    ):
        assert needed in exprs, needed


@needs_promtool
def test_every_dashboard_expression_parses(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}:check", "expr": expand(expr)} for i, (_, expr) in enumerate(dashboard_targets())
    ]}]}
    f = tmp_path / "dashboard-rules.yml"
    f.write_text(yaml.safe_dump(rules))
    r = promtool("check", "rules", str(f))
    assert r.returncode == 0, (r.stdout + r.stderr).decode()
    # and the check can fail: an unclosed parenthesis is reported
    rules["groups"][0]["rules"][0]["expr"] = "sum(rate(asyncrl_trainer_steps_total[5m])"
    f.write_text(yaml.safe_dump(rules))
    bad = promtool("check", "rules", str(f))
    assert bad.returncode != 0 and b"unclosed left parenthesis" in bad.stdout + bad.stderr


def test_every_dashboard_metric_exists():
    """Every asyncrl_ name is exposed by a registry; every sglang: name is one the embedded
    engine exports (cross-checked against rollout_server's source when it names them)."""
    exposed = exposed_sample_names()
    sglang = sglang_sample_names()
    server_src = "".join(p.read_text() for p in (REPO / "rollout_server").glob("*.py"))
    for title, expr in dashboard_targets():
        for name in metric_names(expr):
            if name.startswith("sglang:"):
                assert name in sglang, f"{title}: {name} is not in asyncrl.metrics.SGLANG_ENGINE_METRICS"
                base = re.sub(r"_(bucket|sum|count|total)$", "", name)
                if "sglang:" in server_src:
                    assert base in server_src or base.split(":", 1)[1] in server_src, f"{title}: embedded engine does not export {name}"
            else:
                assert name in exposed, f"{title}: {name} is not exposed by any asyncrl registry"


def test_provisioning_files():
    ds = yaml.safe_load((MON / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "prometheus" and source["url"].startswith("http://prometheus")
    dash = yaml.safe_load((MON / "grafana" / "provisioning" / "dashboards" / "asyncrl.yaml").read_text())
    assert dash["apiVersion"] == 1
    (prov,) = dash["providers"]
    assert prov["type"] == "file" and prov["options"]["path"].startswith("/var/lib/grafana/dashboards")


# ----------------------------------------------------------------------------------------------
# a real Prometheus server scraping real endpoints


class _AiohttpMetrics:
    """A real aiohttp server (own thread and loop) serving a registry at /metrics."""

    def __init__(self, registry):
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_get("/metrics", M.metrics_app_handler(registry))
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        async def start():
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.integration
@pytest.mark.slow
@needs_prometheus
def test_real_prometheus_scrapes_roles_and_serves_the_dashboard(prometheus_server):
    """Prometheus (1 s scrapes, asyncrl's rules loaded) scrapes a rollout registry over aiohttp
    and trainer/controller registries over prometheus_client's server; every dashboard query
    except the engine (sglang:) ones returns data, and every rule evaluates cleanly."""
    from test_metrics import drive_role

    rollout_reg, rollout = drive_role("rollout")
    trainer_reg, _ = drive_role("trainer")
    controller_reg, _ = drive_role("controller")
    buffer_metrics = M.BufferMetrics(controller_reg)  # the controller polls the buffer
    buffer_metrics.set_state(samples={"queued": 4, "partial": 1}, groups={"in_flight": 2, "ready": 1})
    buffer_metrics.set_clock(3, 0)
    buffer_metrics.set_bounds(2, 8)
    buffer_metrics.sample_staleness.observe(1)
    buffer_metrics.groups_admitted.inc()
    buffer_metrics.admission_wait.observe(0.2)
    for reason in ("stale",):
        buffer_metrics.dropped(reason, samples=1, groups=1)
        buffer_metrics.restarted(reason, samples=1, groups=1)
    buffer_metrics.reclaimed.inc()
    buffer_metrics.admission_blocked.inc()
    aio = _AiohttpMetrics(rollout_reg)
    trainer_port = M.start_metrics_server(trainer_reg, 0)
    controller_port = M.start_metrics_server(controller_reg, 0)
    try:
        prom = prometheus_server(
            {
                "rollout": [f"127.0.0.1:{aio.port}"],
                "trainer": [f"127.0.0.1:{trainer_port}"],
                "controller": [f"127.0.0.1:{controller_port}"],
            },
            run="promtest",
        )
        prom.wait_for('count(up{run="promtest"} == 1) == 3', timeout=30)
        # counters must move between scrapes for rate() panels to be non-zero
        rollout.request_finished("stop", 1.0, generated_tokens=50)
        rollout.resumed()
        result = prom.wait_for(
            'sum(rate(asyncrl_rollout_generated_tokens_total{run="promtest"}[10s]))',
            predicate=lambda r: bool(r) and float(r[0]["value"][1]) > 0,
        )
        assert float(result[0]["value"][1]) > 0
        time.sleep(2)  # let the rules evaluate at least once
        values = prom.assert_dashboard_has_data(skip=lambda title, expr: "sglang:" in expr, timeout=30)
        assert values['max(asyncrl_buffer_policy_version{run=~"$run"})'] == 3
        bad_rules = [r for r in prom.rule_health() if r[1] == "err"]
        assert not bad_rules, bad_rules
        recorded = prom.wait_for('run:asyncrl_rollout_generated_tokens:rate1m{run="promtest"}', timeout=30)
        assert float(recorded[0]["value"][1]) > 0
        with pytest.raises(AssertionError, match="parse error"):
            prom.query("sum(rate(asyncrl_rollout_generated_tokens_total[1m])")
    finally:
        M.stop_metrics_server(trainer_port)
        M.stop_metrics_server(controller_port)
        aio.close()


# ----------------------------------------------------------------------------------------------
# the embedded engine's real /metrics


def _split_exposition(text: str) -> tuple[str, str]:
    """(asyncrl part, sglang part) of a text exposition, family by family."""
    ours, theirs, current = [], [], None
    for line in text.splitlines(keepends=True):
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            current = line.split()[2]
        name = current if line.startswith("#") else re.split(r"[{ ]", line, maxsplit=1)[0]
        (theirs if name.startswith("sglang:") else ours).append(line)
    return "".join(ours), "".join(theirs)


@pytest.fixture
def embedded_engine(tiny_model_dir, tmp_path):
    """A real embedded-engine rollout server process (rollout_server.server) on a free port."""
    import os
    import sys

    port = free_port()
    log = open(tmp_path / "engine.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_server.server", "--model-path", str(tiny_model_dir), "--port", str(port),
         "--engine-threads", "1", "--log-level", "warning"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "engine not healthy after 120 s:\n" + (tmp_path / "engine.log").read_text()
                time.sleep(0.3)
        yield url, port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.integration
@pytest.mark.slow
@needs_promtool
def test_embedded_engine_metrics_pass_promtool_and_feed_the_engine_panels(embedded_engine, prometheus_server):
    """The rollout server's real /metrics: its asyncrl_ part passes promtool and the lint, it
    exports every sglang: name the dashboard queries, and the engine-load panels get data
    from a real Prometheus scraping it."""
    url, port = embedded_engine
    req = urllib.request.Request(
        url + "/generate",
        data=json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    ours, theirs = _split_exposition(text)
    assert "asyncrl_build_info{" in ours and 'role="rollout"' in ours
    r = promtool("check", "metrics", input=ours.encode())
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), (r.stdout + r.stderr).decode()
    assert M.lint_exposition(ours) == []
    exported = {s.name for f in __import__("prometheus_client.parser", fromlist=["x"]).text_string_to_metric_families(theirs) for s in f.samples}
    used = {n for _, e in dashboard_targets() for n in metric_names(e) if n.startswith("sglang:")}
    assert used and used <= exported, f"dashboard uses sglang names the embedded engine lacks: {sorted(used - exported)}"
    assert float(re.search(r"^sglang:generation_tokens_total\{[^}]*\} (\S+)$", theirs, re.M).group(1)) > 0

    from test_metrics import PROMETHEUS_2_ACCEPT

    scrape = urllib.request.Request(url + "/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT})
    with urllib.request.urlopen(scrape, timeout=10) as r:
        as_prometheus_sees_it = r.read().decode()
    assert "sglang:num_running_reqs{" in as_prometheus_sees_it, (
        "asked the way Prometheus 2 asks, the engine's /metrics renames sglang: names (OpenMetrics "
        "escaping=underscores); serve it with asyncrl.metrics.metrics_app_handler (classic text format)"
    )

    prom = prometheus_server({"rollout": [f"127.0.0.1:{port}"]}, run="engine")
    prom.wait_for('up{run="engine"} == 1', timeout=30)
    engine_panels = [(t, e) for t, e in dashboard_targets() if "sglang:" in e]
    for title, expr in engine_panels:
        prom.wait_for(expand(expr, "10s"), timeout=30)
