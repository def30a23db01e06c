"""pdserve observed on Kubernetes: deploy/kubernetes/monitoring (the Grafana dashboard and the
Prometheus rules as ConfigMaps) and deploy/prometheus/prometheus-kubernetes.example.yml (a plain
Prometheus's scrape job for the pods the overlays make).

The ConfigMaps hold the sources byte for byte and pass the Kubernetes schemas as the overlays'
objects do (tests/test_kubernetes.py). The example passes ``promtool check config`` in a folder
laid out as the README has it mounted (the rules ConfigMap beside it). Debian's Prometheus is
built without Kubernetes discovery (its NEWS.Debian: client-go's dependencies), so where its
promtool does not know ``kubernetes_sd_configs`` the block is checked here against upstream's
fields and promtool checks the rest with a file_sd in its place. The relabelling is run here on
what Prometheus's pod discovery makes of every rendered pod template: one target per gateway pod
at the port its ``--port`` serves /metrics on, none for the roles that serve no /metrics."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema_rs
import kubernetes_validate
import pytest
import yaml

from tests.k8s_util import DEPLOY, arg, container, deployments
from tests.test_kubernetes import K8S_VERSION, KUBECTL, Render, render, user_tree

MONITORING = DEPLOY / "monitoring"
DASHBOARD = DEPLOY.parent / "grafana" / "pdserve-dashboard.json"
RULES = DEPLOY.parent / "prometheus" / "pdserve-rules.yml"
EXAMPLE = DEPLOY.parent / "prometheus" / "prometheus-kubernetes.example.yml"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir())
NAMESPACE = "pdserve"
ANNOTATIONS_LIMIT = 262144  # bytes: client-side `kubectl apply` keeps the object in one

# upstream Prometheus's kubernetes_sd_config (docs, configuration: <kubernetes_sd_config>), the
# fields this example may use; HTTP client fields (auth, TLS, proxy) are left out
KUBERNETES_SD = {
    "type": "object",
    "required": ["role"],
    "additionalProperties": False,
    "properties": {
        "role": {"enum": ["pod"]},
        "api_server": {"type": "string"},
        "kubeconfig_file": {"type": "string"},
        "namespaces": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "own_namespace": {"type": "boolean"},
                "names": {"type": "array", "items": {"type": "string"}},
            },
        },
        "selectors": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["role"],
                "additionalProperties": False,
                "properties": {
                    "role": {"enum": ["pod"]},  # a pod role's selectors select pods only
                    "label": {"type": "string"},
                    "field": {"type": "string"},
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def overlays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Render]:
    """Every overlay, rendered as tests/test_kubernetes.py renders them (keys made first)."""
    tree = user_tree(tmp_path_factory.mktemp("deploy"))
    return {overlay: render(tree, overlay) for overlay in OVERLAYS}


@pytest.fixture(scope="module")
def monitoring() -> dict[str, dict[str, Any]]:
    """deploy/kubernetes/monitoring's objects by name (it needs no files the user makes)."""
    assert KUBECTL is not None, "kubectl is not installed (make test)"
    done = subprocess.run([KUBECTL, "kustomize", str(MONITORING)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return {o["metadata"]["name"]: o for o in yaml.safe_load_all(done.stdout) if o}


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    (pdserve,) = yaml.safe_load(EXAMPLE.read_text())["scrape_configs"]
    return dict(pdserve)


# ---- the ConfigMaps ---------------------------------------------------------------------------


def test_every_overlay_renders(overlays: dict[str, Render]) -> None:
    assert {"cpu", "gpu", "gpu-multinode"} <= set(overlays)
    for overlay, r in overlays.items():
        assert "gateway" in deployments(r.objects), overlay


def test_the_configmaps_validate(monitoring: dict[str, dict[str, Any]]) -> None:
    # stable names, no hash suffix: the sidecar and a Prometheus outside this kustomization
    assert sorted(monitoring) == ["pdserve-dashboard", "pdserve-prometheus-rules"]
    for name, obj in monitoring.items():
        assert obj["kind"] == "ConfigMap", name
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert len(json.dumps(obj)) < ANNOTATIONS_LIMIT, name
    misspelled = copy.deepcopy(monitoring["pdserve-dashboard"])
    misspelled["datta"] = misspelled.pop("data")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelled, K8S_VERSION, strict=True)


def test_the_configmaps_hold_the_sources_as_they_are(monitoring: dict[str, dict[str, Any]]) -> None:
    for source in (DASHBOARD, RULES):
        kept = MONITORING / source.name
        assert kept.read_bytes() == source.read_bytes(), f"stale copy: cp {source} {kept}"
    dashboard = monitoring["pdserve-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"  # what the sidecar finds
    assert dashboard["data"] == {DASHBOARD.name: DASHBOARD.read_text()}
    loaded = json.loads(dashboard["data"][DASHBOARD.name])
    assert loaded == json.loads(DASHBOARD.read_text()) and len(loaded["panels"]) >= 16
    assert monitoring["pdserve-prometheus-rules"]["data"] == {RULES.name: RULES.read_text()}
    assert yaml.safe_load(EXAMPLE.read_text())["rule_files"] == [RULES.name]  # the key, beside it


# ---- the scrape config -------------------------------------------------------------------------


def promtool_check(folder: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool is not None, "promtool is missing: `make test` installs Debian's prometheus"
    check = [tool, "check", "config", "prometheus.yml"]
    return subprocess.run(check, cwd=folder, capture_output=True, text=True, timeout=60)


def test_the_scrape_config_passes_promtool(
    monitoring: dict[str, dict[str, Any]], job: dict[str, Any], tmp_path: Path
) -> None:
    """Checked in a folder as the pod mounts it: the example as prometheus.yml, the rules as
    the ConfigMap holds them."""
    for sd in job["kubernetes_sd_configs"]:
        assert list(jsonschema_rs.validator_for(KUBERNETES_SD).iter_errors(sd)) == []
    shutil.copy(EXAMPLE, tmp_path / "prometheus.yml")
    if "field kubernetes_sd_configs not found" in promtool_check(tmp_path).stderr:  # Debian's
        config = yaml.safe_load(EXAMPLE.read_text())
        (checked,) = config["scrape_configs"]
        del checked["kubernetes_sd_configs"]
        checked["file_sd_configs"] = [{"files": ["pods.json"]}]
        (tmp_path / "pods.json").write_text("[]")
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = promtool_check(tmp_path)  # the rules are not there yet: promtool reads them
    assert result.returncode != 0 and "pdserve-rules.yml" in result.stdout + result.stderr
    for key, text in monitoring["pdserve-prometheus-rules"]["data"].items():
        (tmp_path / key).write_text(text)
    result = promtool_check(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Checking {RULES.name}\n  SUCCESS" in result.stdout


@dataclass(frozen=True)
class Target:
    address: str
    path: str
    labels: dict[str, str]


def sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_templates(obj: Any) -> list[dict[str, Any]]:
    """Every pod template in a rendered object (a Deployment's, a LeaderWorkerSet's two)."""
    if isinstance(obj, list):
        return [t for v in obj for t in pod_templates(v)]
    if not isinstance(obj, dict):
        return []
    if "containers" in obj.get("spec", {}) and "metadata" in obj:
        return [obj]
    return [t for v in obj.values() for t in pod_templates(v)]


def discovered(template: dict[str, Any], name: str, ip: str) -> list[dict[str, str]]:
    """Prometheus's pod discovery (role: pod) of a running pod made from ``template``: a target
    per container port, one per container without ports, each with the pod's meta labels."""
    pod = {
        "__meta_kubernetes_namespace": NAMESPACE,
        "__meta_kubernetes_pod_name": name,
        "__meta_kubernetes_pod_ip": ip,
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_ready": "true",
    }
    meta = template["metadata"]
    for kind in ("label", "annotation"):
        for key, value in meta.get(f"{kind}s", {}).items():
            pod[f"__meta_kubernetes_pod_{kind}_{sanitize(key)}"] = str(value)
            pod[f"__meta_kubernetes_pod_{kind}present_{sanitize(key)}"] = "true"
    out = []
    for field, init in (("containers", "false"), ("initContainers", "true")):
        for c in template["spec"].get(field, []):
            each = {
                **pod,
                "__meta_kubernetes_pod_container_name": c["name"],
                "__meta_kubernetes_pod_container_init": init,
            }
            if not c.get("ports"):
                out.append({**each, "__address__": ip})
            for p in c.get("ports", []):
                out.append({
                    **each,
                    "__address__": f"{ip}:{p['containerPort']}",
                    "__meta_kubernetes_pod_container_port_name": p.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(p["containerPort"]),
                    "__meta_kubernetes_pod_container_port_protocol": p.get("protocol", "TCP"),
                })  # fmt: skip
    return out


def relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus's relabelling (the actions the example uses; None: the target is dropped)."""
    out = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace")
        value = rule.get("separator", ";").join(out.get(n, "") for n in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)  # anchored, as Prometheus's
        if action == "keep":
            if match is None:
                return None
        elif action == "drop":
            if match is not None:
                return None
        elif action == "keepequal":
            if value != out.get(rule["target_label"], ""):
                return None
        elif action == "replace":
            if match is None:
                continue
            replacement = re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", rule.get("replacement", "$1"))
            if result := match.expand(replacement):  # Go's $1 and ${1} as Python's \g<1>
                out[rule["target_label"]] = result
            else:
                out.pop(rule["target_label"], None)
        else:
            raise ValueError(f"relabel action {action} is not simulated here")
    return out


def targets(job: dict[str, Any], template: dict[str, Any], name: str, ip: str) -> list[Target]:
    """What the job scrapes of one pod: its discovery's selectors, then its relabelling."""
    labels = template["metadata"].get("labels", {})
    for sd in job["kubernetes_sd_configs"]:
        for selector in sd.get("selectors", []):
            pairs = dict(term.split("=", 1) for term in selector["label"].split(","))
            if not pairs.items() <= labels.items():
                return []
    found = []
    for meta in discovered(template, name, ip):
        start = {"job": job["job_name"], "__metrics_path__": job.get("metrics_path", "/metrics")}
        kept = relabel(job["relabel_configs"], {**start, **meta})
        if kept is not None:
            final = {k: v for k, v in kept.items() if not k.startswith("__")}
            final.setdefault("instance", kept["__address__"])
            found.append(Target(kept["__address__"], kept["__metrics_path__"], final))
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_job_scrapes_each_gateway_where_it_serves_metrics(
    overlays: dict[str, Render], job: dict[str, Any], overlay: str
) -> None:
    from pdserve.gateway.app import router

    rendered = overlays[overlay]
    served = {getattr(r, "path", None) for r in router.routes}
    (wanted_job,) = re.findall(r'up\{job="([^"]+)"\}', RULES.read_text())  # the gateway-down alert
    gateway = container(deployments(rendered.objects)["gateway"])
    found: dict[str, list[Target]] = {}
    templates = [t for o in rendered.objects for t in pod_templates(o)]
    for i, template in enumerate(templates):
        role = template["metadata"]["labels"]["app.kubernetes.io/component"]
        name, ip = f"pdserve-{role}-{i}", f"10.0.0.{i + 1}"
        for t in targets(job, template, name, ip):
            assert t.path in served, t
            assert t.labels == {
                "job": wanted_job,
                "instance": t.address,
                "namespace": NAMESPACE,
                "pod": name,
                "component": role,
            }
            found.setdefault(role, []).append(t)
    # the coordinator's and the workers' figures reach the gateways: only they serve /metrics
    assert {role: len(ts) for role, ts in found.items()} == {"gateway": 1}
    assert found["gateway"][0].address.endswith(f":{arg(gateway, '--port')}")


def test_the_job_follows_the_pods_annotations(
    overlays: dict[str, Render], job: dict[str, Any]
) -> None:
    """The target moves with prometheus.io/port and goes with prometheus.io/scrape: what the
    previous test found is the manifests' doing, not the example's."""
    deployment = deployments(overlays["cpu"].objects)["gateway"]
    gateway = deployment["spec"]["template"]
    (t,) = targets(job, gateway, "gw", "10.0.0.1")
    assert t.address == f"10.0.0.1:{arg(container(deployment), '--port')}"
    moved = copy.deepcopy(gateway)
    stream = next(p for p in moved["spec"]["containers"][0]["ports"] if p["name"] == "stream")
    moved["metadata"]["annotations"]["prometheus.io/port"] = str(stream["containerPort"])
    assert [t.address for t in targets(job, moved, "gw", "10.0.0.1")] == [
        f"10.0.0.1:{stream['containerPort']}"
    ]
    moved["metadata"]["annotations"]["prometheus.io/scrape"] = "false"
    assert targets(job, moved, "gw", "10.0.0.1") == []


def test_the_target_labels_leave_pdserves_own_alone(job: dict[str, Any]) -> None:
    """A target label of a name the metrics carry would rename theirs (to exported_*): the
    dashboard, rules and KEDA queries select on ``role``, so the pod's role is ``component``."""
    from pdserve.gateway.metrics import GatewayMetrics
    from pdserve.gateway.tenancy.core import TenantMetrics

    own = {
        name
        for registry in (GatewayMetrics().registry, TenantMetrics().registry)
        for metric in registry._metrics.values()  # every metric, with or without samples yet
        for name in metric.labelnames
    }
    assert "role" in own
    added = {"job", "instance"} | {
        r["target_label"] for r in job["relabel_configs"] if r.get("action", "replace") == "replace"
    }
    added = {n for n in added if not n.startswith("__")}
    assert added == {"job", "instance", "namespace", "pod", "component"}
    assert added & own == set()
