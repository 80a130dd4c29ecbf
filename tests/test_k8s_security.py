"""configs/k8s, hardened: pod security, network policies, limits, secrets — on the manifests
as real kustomize renders them (``kubectl kustomize``, :func:`tests.test_k8s.render`).

* every pod runs as a non-root user with a RuntimeDefault seccomp profile; every container
  has ``allowPrivilegeEscalation: false``, a read-only root filesystem (writable emptyDir
  volumes where the process writes) and drops ALL capabilities;
* every container has CPU and memory requests and limits;
* NetworkPolicies, evaluated here with the Kubernetes semantics (a pod selected by a policy
  accepts only what some rule of a policy selecting it allows; rules are ORed; ``from`` peers
  are ORed; ``ports`` limit a rule): Redis only from the asyncrl roles, the trainer's
  rendezvous only from trainer pods, every metrics port only from Prometheus (and, for the
  rollout servers whose API shares the port, the roles that drive them);
* Grafana's admin password comes from the Secret (a file), Prometheus has no
  ``--web.enable-lifecycle``, the Redis probe has no password on its argv;
* the ``http`` weight transport binds the trainer pod's IP on the port the policy opens to
  rollout servers.
"""

from __future__ import annotations

import pytest

from tests.test_k8s import ALL, K8S, OVERLAYS, _by, _containers, _env, _pod_spec, render

PROMETHEUS = {"app.kubernetes.io/name": "prometheus", "app.kubernetes.io/part-of": "asyncrl"}
GRAFANA = {"app.kubernetes.io/name": "grafana", "app.kubernetes.io/part-of": "asyncrl"}
STRANGER = {"app": "something-else"}


def _role(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "asyncrl", "app.kubernetes.io/instance": "asyncrl",
            "app.kubernetes.io/component": component}


@pytest.fixture(scope="module", params=sorted(ALL))
def rendered(request):
    path, restrict = ALL[request.param]
    return request.param, render(path, restrict)


# ----------------------------------------------------------------------------------------------
# pod security


def test_every_pod_runs_unprivileged(rendered):
    name, objs = rendered
    pods = [o for o in objs if _pod_spec(o) is not None]
    assert pods
    for o in pods:
        where = f"{name}: {o['kind']}/{o['metadata']['name']}"
        psc = _pod_spec(o).get("securityContext", {})
        assert psc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"
        assert psc.get("runAsUser", 0) > 0, f"{where}: a numeric non-root runAsUser (runAsNonRoot cannot check a name)"
        assert psc.get("seccompProfile") == {"type": "RuntimeDefault"}, f"{where}: seccomp RuntimeDefault"
        for c in _containers(o):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, f"{where}/{c['name']}: allowPrivilegeEscalation"
            assert sc.get("readOnlyRootFilesystem") is True, f"{where}/{c['name']}: readOnlyRootFilesystem"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}/{c['name']}: drop ALL"
            assert not sc.get("capabilities", {}).get("add"), f"{where}/{c['name']}: adds capabilities"
            assert not sc.get("privileged"), where
            assert "runAsUser" not in sc or sc["runAsUser"] > 0, where


#: Paths each image's process writes (with a read-only root filesystem these must be volumes).
WRITES = {
    "asyncrl": ["/tmp", "/home/asyncrl/.cache"],
    "redis": ["/data"],
    "prometheus": ["/prometheus"],
    "grafana": ["/var/lib/grafana", "/tmp"],
}


def test_writable_paths_are_volumes(rendered):
    name, objs = rendered
    for o in objs:
        for c in _containers(o):
            image = c["image"].rsplit("/", 1)[-1].split(":")[0]
            writes = WRITES["asyncrl" if image == "asyncrl" else image]
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            for path in writes:
                assert path in mounts and not mounts[path].get("readOnly"), \
                    f"{name}: {o['metadata']['name']}/{c['name']} writes {path}: needs a writable volume there"


def test_every_container_has_cpu_and_memory_limits(rendered):
    name, objs = rendered
    for o in objs:
        for c in _containers(o):
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(kind, {})), \
                    f"{name}: {o['metadata']['name']}/{c['name']} has no cpu and memory {kind}"


# ----------------------------------------------------------------------------------------------
# network policies


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions, ANDed)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        present = e["key"] in labels
        op = e["operator"]
        if op == "In" and not (present and labels[e["key"]] in e["values"]):
            return False
        if op == "NotIn" and present and labels[e["key"]] in e["values"]:
            return False
        if op == "Exists" and not present or op == "DoesNotExist" and present:
            return False
    return True


def _ingress_allowed(objs: list[dict], src: dict[str, str], dst: dict[str, str], port: int) -> bool:
    """May a pod labelled ``src`` open TCP ``port`` on a pod labelled ``dst`` (same namespace)?"""
    policies = [p for p in objs if p["kind"] == "NetworkPolicy" and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and _selects(p["spec"]["podSelector"], dst)]
    if not policies:
        return True  # not isolated
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            peers = rule.get("from")
            peer_ok = peers is None or any("podSelector" in peer and "namespaceSelector" not in peer
                                           and _selects(peer["podSelector"], src) for peer in peers)
            ports = rule.get("ports")
            port_ok = ports is None or any(pp.get("protocol", "TCP") == "TCP" and pp.get("port") == port for pp in ports)
            if peer_ok and port_ok:
                return True
    return False


def test_the_policy_evaluator_follows_kubernetes_semantics():
    """The evaluator must be able to say no: a policy without rules isolates; a rule's ports and
    peers both have to match; an unselected pod is open."""
    deny = {"kind": "NetworkPolicy", "spec": {"podSelector": {"matchLabels": {"a": "1"}}, "policyTypes": ["Ingress"]}}
    allow = {"kind": "NetworkPolicy", "spec": {"podSelector": {"matchLabels": {"a": "1"}}, "ingress": [
        {"from": [{"podSelector": {"matchExpressions": [{"key": "b", "operator": "In", "values": ["x"]}]}}],
         "ports": [{"port": 80}]}]}}
    assert _ingress_allowed([deny], {"b": "x"}, {"a": "2"}, 80)
    assert not _ingress_allowed([deny], {"b": "x"}, {"a": "1"}, 80)
    assert _ingress_allowed([deny, allow], {"b": "x"}, {"a": "1"}, 80)
    assert not _ingress_allowed([deny, allow], {"b": "x"}, {"a": "1"}, 81)
    assert not _ingress_allowed([deny, allow], {"b": "y"}, {"a": "1"}, 80)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(overlay):
    objs = render(K8S / overlay)
    roles = ("rollout", "trainer", "controller")
    # every asyncrl pod is isolated (a policy selects it)
    for o in objs:
        spec = _pod_spec(o)
        if spec is not None:
            labels = o["spec"]["template"]["metadata"]["labels"]
            assert any(p["kind"] == "NetworkPolicy" and _selects(p["spec"]["podSelector"], labels) for p in objs), \
                f"{o['metadata']['name']} accepts any ingress"
    # Redis: only the asyncrl roles
    for r in roles:
        assert _ingress_allowed(objs, _role(r), _role("redis"), 6379), r
    for outsider in (PROMETHEUS, GRAFANA, STRANGER):
        assert not _ingress_allowed(objs, outsider, _role("redis"), 6379), outsider
    # trainer rendezvous (and the process group's further ports) only between trainer pods
    env = _env(_by(objs, "Job", "asyncrl-trainer")["spec"]["template"]["spec"]["containers"][0])
    master = int(env["MASTER_PORT"]["value"])
    assert _ingress_allowed(objs, _role("trainer"), _role("trainer"), master)
    assert _ingress_allowed(objs, _role("trainer"), _role("trainer"), 41234)  # gloo/NCCL pick ports
    for other in ("rollout", "controller", "redis"):
        assert not _ingress_allowed(objs, _role(other), _role("trainer"), master), other
    assert not _ingress_allowed(objs, PROMETHEUS, _role("trainer"), master)
    assert not _ingress_allowed(objs, STRANGER, _role("trainer"), master)
    # metrics only from Prometheus
    for component, port in (("trainer", 9401), ("controller", 9400)):
        assert _ingress_allowed(objs, PROMETHEUS, _role(component), port)
        for other in ("rollout", "redis", *(["trainer"] if component == "controller" else ["controller"])):
            assert not _ingress_allowed(objs, _role(other), _role(component), port), (other, component)
        assert not _ingress_allowed(objs, STRANGER, _role(component), port)
    # the rollout servers' API (and /metrics on the same port): the roles that drive them, Prometheus
    for src in (_role("controller"), _role("trainer"), PROMETHEUS):
        assert _ingress_allowed(objs, src, _role("rollout"), 30000), src
    for src in (STRANGER, GRAFANA, _role("redis")):
        assert not _ingress_allowed(objs, src, _role("rollout"), 30000), src
    # the reward model: its clients (rollout workers, the controller's evaluation) and Prometheus
    for src in (_role("rollout"), _role("controller"), PROMETHEUS):
        assert _ingress_allowed(objs, src, _role("reward-model"), 30500), src
    for src in (STRANGER, _role("trainer"), _role("redis")):
        assert not _ingress_allowed(objs, src, _role("reward-model"), 30500), src
    # the trainer, controller and rollout servers write the shared volume
    for kind, n in (("StatefulSet", "asyncrl-rollout"), ("Job", "asyncrl-trainer"), ("Job", "asyncrl-controller")):
        (c,) = _by(objs, kind, n)["spec"]["template"]["spec"]["containers"]
        assert any(m["mountPath"] == "/shared" and not m.get("readOnly") for m in c["volumeMounts"]), n


def test_monitoring_network_policies():
    objs = render(K8S / "monitoring", restrict=False)
    assert _ingress_allowed(objs, GRAFANA, PROMETHEUS, 9090)
    assert not _ingress_allowed(objs, STRANGER, PROMETHEUS, 9090)
    assert not _ingress_allowed(objs, _role("rollout"), PROMETHEUS, 9090)
    assert _ingress_allowed(objs, STRANGER, GRAFANA, 3000)
    assert not _ingress_allowed(objs, STRANGER, GRAFANA, 3001)


# ----------------------------------------------------------------------------------------------
# secrets and admin surfaces


def test_grafana_admin_password_comes_from_the_secret():
    objs = render(K8S / "monitoring", restrict=False)
    pod = _by(objs, "Deployment", "asyncrl-grafana")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = _env(c)
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env, "a literal admin password (or Grafana's admin/admin default)"
    path = env["GF_SECURITY_ADMIN_PASSWORD__FILE"]["value"]
    directory, fname = path.rsplit("/", 1)
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == directory]
    assert mount.get("readOnly") is True
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert vol["secret"]["secretName"] == "asyncrl-secrets"
    assert {"key": "grafana-admin-password", "path": fname} in vol["secret"]["items"]
    assert vol["secret"]["defaultMode"] & 0o007 == 0, "the password file is not world-readable"


def test_prometheus_has_no_lifecycle_api():
    objs = render(K8S / "monitoring", restrict=False)
    (c,) = _by(objs, "Deployment", "asyncrl-prometheus")["spec"]["template"]["spec"]["containers"]
    assert not any("enable-lifecycle" in a for a in c.get("args", []) + c.get("command", []))


def test_redis_probe_keeps_the_password_off_its_argv():
    objs = render(K8S / "overlays/cpu")
    (c,) = _by(objs, "StatefulSet", "asyncrl-redis")["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        argv = " ".join(c.get(probe, {}).get("exec", {}).get("command", []))
        assert "PASSWORD" not in argv and " -a " not in argv and "--pass" not in argv, f"{probe}: {argv}"
    assert "redis-cli" in " ".join(c["readinessProbe"]["exec"]["command"])
    ref = _env(c)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "asyncrl-secrets", "key": "redis-password"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_http_weight_transport_binds_the_pod_ip(overlay, tmp_path):
    from asyncrl.core.config import load_config
    from tests.test_k8s import _pod_environ

    objs = render(K8S / overlay)
    (c,) = _by(objs, "Job", "asyncrl-trainer")["spec"]["template"]["spec"]["containers"]
    env = _env(c)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    cfg_path = tmp_path / "train.yaml"
    cfg_path.write_text(_by(objs, "ConfigMap", "asyncrl-config")["data"]["train.yaml"])
    environ = {**_pod_environ(c), "POD_IP": "10.1.2.3"}
    environ["ASYNCRL_WEIGHT_SYNC__HTTP_HOST"] = env["ASYNCRL_WEIGHT_SYNC__HTTP_HOST"]["value"].replace("$(POD_IP)", "10.1.2.3")
    cfg = load_config([], config_path=cfg_path, environ=environ)
    assert cfg.weight_sync.http_host == "10.1.2.3"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["weights"] == cfg.weight_sync.http_port != 0
    assert _ingress_allowed(objs, _role("rollout"), _role("trainer"), cfg.weight_sync.http_port)
    assert not _ingress_allowed(objs, STRANGER, _role("trainer"), cfg.weight_sync.http_port)
