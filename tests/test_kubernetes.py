"""deploy/kubernetes rendered as a user renders it and every object checked. No cluster runs
here: each overlay goes through `kubectl kustomize` (after `pdserve keygen` and a tenants file,
made in a copy), every Kubernetes object is validated against the Kubernetes schemas of
``K8S_VERSION`` (PyPI kubernetes-validate, strict: an unknown field fails), each ScaledObject
against KEDA's CRD schema (tests/data, made as strict as the API server's field validation).
Then what the schemas cannot say: probes on the roles' real endpoints, resources, non-root
security contexts, one Secret per role whose keys pdserve loads, the grace period covering the
drain, addresses other pods can dial, and the autoscaling on the planner's metric."""

from __future__ import annotations

import base64
import copy
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate  # the test extra's (with PyYAML)
import pytest
import yaml

from tests.k8s_util import (
    DEPLOY,
    ROLES,
    arg,
    container,
    crd_validator,
    deployments,
    flag_values,
    mount_secret,
    port_number,
    role_of,
    schema_errors,
)

KUBECTL = shutil.which("kubectl")


@pytest.fixture(autouse=True)
def _kubectl() -> None:
    """Never skipped: `make test` installs kubectl (apt package kubectl) where it is missing."""
    if KUBECTL is None:
        pytest.fail("kubectl is not installed: nothing can render the overlays (make test)")


K8S_VERSION = "1.32"
KEDA_CRD = Path(__file__).parent / "data" / "keda.sh_scaledobjects.yaml"
KINDS = {"Secret": 5, "Service": 2, "Deployment": 4, "PodDisruptionBudget": 3, "ScaledObject": 2}
PDSERVE = [sys.executable, "-m", "pdserve.launch.cli"]


@dataclass(frozen=True)
class Render:
    overlay: str
    tree: Path  # the copy rendered, with the files the user made
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]


def user_tree(parent: Path) -> Path:
    """deploy/kubernetes copied under ``parent`` with what the README has the user make: keys
    and a tenants file."""
    root = parent / "kubernetes"
    shutil.copytree(DEPLOY, root, ignore=shutil.ignore_patterns("keys", "tenants.toml"))
    base = root / "base"
    nodes = [f"{role}:{role}" for role in ROLES]
    subprocess.run([*PDSERVE, "keygen", "--out", str(base / "keys"), "--nodes", *nodes], check=True)
    shutil.copy(base / "tenants.example.toml", base / "tenants.toml")
    add = [*PDSERVE, "keys", "add", "example", "--tenants", str(base / "tenants.toml")]
    subprocess.run(add, check=True, capture_output=True)
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return user_tree(tmp_path_factory.mktemp("deploy"))


def render(tree: Path, overlay: str) -> Render:
    assert KUBECTL is not None
    done = subprocess.run(
        [KUBECTL, "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return Render(overlay, tree, [doc for doc in yaml.safe_load_all(done.stdout) if doc])


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def rendered(request: pytest.FixtureRequest, tree: Path) -> Render:
    return render(tree, request.param)


# ---- schemas ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keda() -> Any:
    return crd_validator(KEDA_CRD, "v1alpha1")


def keda_errors(validator: Any, obj: dict[str, Any]) -> list[str]:
    errors = schema_errors(validator, obj)
    spec = obj["spec"]  # the CRD's one x-kubernetes-validations rule (CEL), by hand
    if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
        errors.append("minReplicaCount must be less than or equal to maxReplicaCount")
    return errors


def test_every_object_validates(rendered: Render, keda: Any) -> None:
    kinds: dict[str, int] = {}
    for obj in rendered.objects:
        kinds[obj["kind"]] = kinds.get(obj["kind"], 0) + 1
        if obj["kind"] == "ScaledObject":
            assert obj["apiVersion"] == "keda.sh/v1alpha1"
            assert keda_errors(keda, obj) == [], obj["metadata"]["name"]
        else:  # raises on a schema error, or for a kind it has no schema of
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert kinds == KINDS


def test_the_validators_refuse_what_a_cluster_would(rendered: Render, keda: Any) -> None:
    """Each validator fails on a misspelled field, so passing means something."""
    deployment = copy.deepcopy(rendered.of_kind("Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    scaled = copy.deepcopy(rendered.of_kind("ScaledObject")[0])
    scaled["spec"]["minReplicas"] = 1
    assert len(keda_errors(keda, scaled)) == 1
    scaled = copy.deepcopy(rendered.of_kind("ScaledObject")[0])
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 1  # a string, in KEDA's schema
    assert len(keda_errors(keda, scaled)) == 1
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = "1"
    scaled["spec"]["minReplicaCount"] = 9
    assert keda_errors(keda, scaled) == [
        "minReplicaCount must be less than or equal to maxReplicaCount"
    ]


# ---- what every pod must have -------------------------------------------------------------------


def test_deployments_are_probed_bounded_and_unprivileged(rendered: Render) -> None:
    found = deployments(rendered.objects)
    assert sorted(found) == sorted(ROLES)
    for role, d in found.items():
        pod = d["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, role
        assert pod["enableServiceLinks"] is False, role
        pod_security = pod["securityContext"]
        assert pod_security["runAsUser"] > 0 and pod_security["runAsGroup"] > 0, role
        assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}, role
        assert [c["name"] for c in pod["containers"]] == ["pdserve"], role
        for c in pod["containers"]:
            assert c["readinessProbe"]["httpGet"] and c["livenessProbe"]["httpGet"], role
        for c in pod["containers"] + pod.get("initContainers", []):
            where = f"{role}/{c['name']}"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), where
            security = c["securityContext"]
            assert security["runAsNonRoot"] is True, where
            assert security.get("runAsUser", pod_security["runAsUser"]) != 0, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"] == {"drop": ["ALL"]}, where


def test_probes_ask_the_roles_real_endpoints(rendered: Render) -> None:
    from pdserve.gateway.app import router
    from pdserve.runtime.health_http import LIVEZ, READYZ

    gateway_paths = {getattr(r, "path", None) for r in router.routes}
    for role, d in deployments(rendered.objects).items():
        c = container(d)
        ready, live = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
        if role == "gateway":
            assert (ready["path"], live["path"]) == ("/health", "/version")
            assert {"/health", "/version"} <= gateway_paths
            served = int(arg(c, "--port"))
        else:
            assert (ready["path"], live["path"]) == (READYZ, LIVEZ), role
            assert arg(c, "--health-host") == "0.0.0.0", role  # the kubelet dials the pod IP
            served = int(arg(c, "--health-port"))
        assert port_number(c, ready["port"]) == port_number(c, live["port"]) == served, role


def test_the_grace_period_covers_the_drain(rendered: Render) -> None:
    for role, d in deployments(rendered.objects).items():
        pod = d["spec"]["template"]["spec"]
        c = container(d)
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        sleep = float(pre_stop[1]) if pre_stop else 0.0
        if role == "coordinator":  # stops at once: nothing to drain
            assert pre_stop is None and arg(c, "--drain-timeout") is None
            continue
        if role == "gateway":  # the Service lets go of the pod before the drain begins
            assert pre_stop[0] == "sleep" and sleep >= 5
        drain = float(arg(c, "--drain-timeout"))
        assert pod["terminationGracePeriodSeconds"] >= sleep + drain + 10, role


def test_addresses_other_pods_dial(rendered: Render) -> None:
    found = deployments(rendered.objects)
    services = {s["metadata"]["name"]: s for s in rendered.of_kind("Service")}
    coordinator = container(found["coordinator"])
    assert arg(coordinator, "--bind") == "tcp://0.0.0.0:5550"
    inbox = services["pdserve-coordinator"]["spec"]["ports"][0]
    assert port_number(coordinator, inbox["targetPort"]) == 5550
    for role, d in found.items():
        c = container(d)
        env = {e["name"]: e for e in c["env"]}
        for var in re.findall(r"\$\((\w+)\)", " ".join(c["command"] + c["args"])):
            assert var in env, f"{role}: $({var}) is not in its env"  # else it stays literal
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["PDSERVE_KEY_NAME"]["value"] == role
        if role == "coordinator":
            continue
        assert env["PDSERVE_COORDINATOR"]["value"] == f"tcp://pdserve-coordinator:{inbox['port']}"
        if role == "gateway":
            assert arg(c, "--stream-bind") == "tcp://$(POD_IP):5570"
        else:
            assert arg(c, "--advertise-host") == "$(POD_IP)", role
            assert arg(c, "--control-bind").startswith("tcp://0.0.0.0:"), role


def test_services_and_budgets_select_their_pods(rendered: Render) -> None:
    found = deployments(rendered.objects)

    def selected(selector: dict[str, str]) -> list[str]:
        return sorted(
            role
            for role, d in found.items()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        )

    services = rendered.of_kind("Service")
    assert sorted(selected(s["spec"]["selector"])[0] for s in services) == [
        "coordinator",
        "gateway",
    ]
    assert all(len(selected(s["spec"]["selector"])) == 1 for s in services)
    budgets = rendered.of_kind("PodDisruptionBudget")
    assert sorted(selected(b["spec"]["selector"]["matchLabels"])[0] for b in budgets) == [
        "decode",
        "gateway",
        "prefill",
    ]
    assert all(b["spec"]["maxUnavailable"] == 1 for b in budgets)
    assert found["coordinator"]["spec"]["strategy"] == {"type": "Recreate"}


# ---- Secrets ------------------------------------------------------------------------------------


def files_of(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_one_secret_per_role_and_pdserve_loads_it(rendered: Render, tmp_path: Path) -> None:
    """Each role's pod gets exactly its keygen directory: the volume's files, put where the
    init container copies them from, copied by its own command, load as that role's keys."""
    from pdserve.runtime.security import KeysError, Security

    secrets = {s["metadata"]["name"]: s for s in rendered.of_kind("Secret")}
    keys_secrets = sorted(n.rsplit("-", 1)[0] for n in secrets if n.startswith("pdserve-keys-"))
    assert keys_secrets == sorted(f"pdserve-keys-{role}" for role in ROLES)
    for role, d in deployments(rendered.objects).items():
        pod = d["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "keys-secret")["secret"]
        assert volume["secretName"].rsplit("-", 1)[0] == f"pdserve-keys-{role}"
        data = secrets[volume["secretName"]]["data"]
        assert sorted(i["key"] for i in volume["items"]) == sorted(data)  # every key, once
        mounted = {i["path"]: base64.b64decode(data[i["key"]]) for i in volume["items"]}
        assert mounted == files_of(rendered.tree / "base" / "keys" / role), role
        # the init container's own command, run on the volume's files here
        init = next(c for c in pod["initContainers"] if c["name"] == "keys")
        mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        secret_dir, keys_dir = tmp_path / role / "secret", tmp_path / role / "keys"
        mount_secret(secret_dir, mounted)
        with pytest.raises(KeysError, match="readable by others"):  # hence the copy
            Security.load(secret_dir, role)
        script = init["command"][2].replace(mounts["keys-secret"], str(secret_dir))
        script = script.replace(mounts["keys"], str(keys_dir))
        subprocess.run([*init["command"][:2], script], check=True)
        env = {e["name"]: e.get("value") for e in container(d)["env"]}
        assert env["PDSERVE_KEYS"] == mounts["keys"]
        keys = Security.load(keys_dir, env["PDSERVE_KEY_NAME"])
        assert keys.own_roles == {role}
        assert sorted(sorted(r) for r in keys.roles.values()) == sorted([r] for r in ROLES)
    tenants = next(n for n in secrets if n.startswith("pdserve-tenants-"))
    text = base64.b64decode(secrets[tenants]["data"]["tenants.toml"])
    assert text == (rendered.tree / "base" / "tenants.toml").read_bytes()
    gateway = deployments(rendered.objects)["gateway"]
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tenants"]["secret"]["secretName"] == tenants
    mount = next(m for m in container(gateway)["volumeMounts"] if m["name"] == "tenants")
    assert arg(container(gateway), "--tenants") == f"{mount['mountPath']}/tenants.toml"


# ---- autoscaling and the overlays -----------------------------------------------------------


def test_workers_scale_on_the_planners_metric(rendered: Render) -> None:
    from pdserve.gateway.observe.planning import PlannerMetrics
    from pdserve.gateway.observe.prometheus import Registry

    desired = PlannerMetrics(Registry()).desired
    assert desired.labelnames == ("model", "role")
    found = deployments(rendered.objects)
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in rendered.of_kind("ScaledObject")}
    assert sorted(scaled) == ["pdserve-decode", "pdserve-prefill"]
    for name, s in scaled.items():
        role = role_of(s)
        assert found[role]["metadata"]["name"] == name
        assert "replicas" not in found[role]["spec"]  # apply must not fight the autoscaler
        (trigger,) = s["spec"]["triggers"]
        assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
        assert trigger["metadata"]["threshold"] == "1"  # replicas = the metric
        model = arg(container(found[role]), "--model")
        want = f'max({desired.name}{{model="{model}",role="{role}"}})'
        assert trigger["metadata"]["query"] == want


def test_gpu_only_in_the_gpu_overlay(rendered: Render) -> None:
    gpu = rendered.overlay == "gpu"
    for role, d in deployments(rendered.objects).items():
        pod = d["spec"]["template"]["spec"]
        c = container(d)
        worker = role in ("prefill", "decode")
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        assert (gpus is not None) == (gpu and worker), role
        if gpu and worker:  # each a tensor-parallel group on one pod: a GPU per rank
            assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus, role
            assert gpus == int(arg(c, "--tensor-parallel-size")), role
        else:
            assert arg(c, "--tensor-parallel-size") is None, role
        assert (flag_values(c, "--device") == ["cuda"]) == (gpu and worker), role
        assert ("nodeSelector" in pod) == (gpu and worker), role
        assert c["image"] == ("pdserve:cuda" if gpu and worker else "pdserve:cpu"), role
        init = next(i for i in pod["initContainers"] if i["name"] == "keys")
        assert init["image"] == c["image"], role  # one image to pull per pod
        if gpu and worker:
            toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            assert pod["tolerations"] == [toleration]
