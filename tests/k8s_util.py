"""Reading rendered Kubernetes objects, a CRD schema made strict, a Secret volume laid out as
the kubelet does (tests/test_kubernetes.py, tests/test_kubernetes_tp.py,
tests/test_dockerfiles.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema_rs
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
ROLES = ("coordinator", "gateway", "prefill", "decode")
COMPONENT = "app.kubernetes.io/component"


def role_of(obj: dict[str, Any]) -> str:
    return str(obj["metadata"]["labels"][COMPONENT])


def deployments(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each role's Deployment, by role."""
    return {role_of(o): o for o in objects if o["kind"] == "Deployment"}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    """The role's own container (named pdserve in every Deployment)."""
    pod = deployment["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "pdserve")


def flag_values(c: dict[str, Any], flag: str) -> list[str]:
    """Every value ``--flag=VALUE`` takes in a container's args, in order."""
    return [a.split("=", 1)[1] for a in c.get("args", []) if a.startswith(f"{flag}=")]


def arg(c: dict[str, Any], flag: str) -> str | None:
    """The one value of ``flag`` (None when absent); an error when given twice."""
    values = flag_values(c, flag)
    assert len(values) <= 1, f"{flag} given {len(values)} times"
    return values[0] if values else None


def port_number(c: dict[str, Any], port: int | str) -> int:
    """A probe's or a Service's port (a number, or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    return int(next(p["containerPort"] for p in c["ports"] if p["name"] == port))


def strict(schema: Any) -> Any:
    """A CRD schema refusing unknown fields, as `kubectl apply` (server-side field validation,
    Strict) does; the API server would otherwise drop them silently."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    return [strict(v) for v in schema] if isinstance(schema, list) else schema


def crd_validator(path: Path, version: str) -> Any:
    """A validator for one version of a vendored CRD (tests/data), its schema made strict.
    Read with libyaml where PyYAML has it: the LeaderWorkerSet CRD is 1.3 MB."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = next(doc for doc in yaml.load_all(path.read_text(), Loader=loader) if doc)
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return jsonschema_rs.validator_for(strict(served["schema"]["openAPIV3Schema"]))


def schema_errors(validator: Any, obj: dict[str, Any]) -> list[str]:
    return [f"{list(e.instance_path)}: {e.message}" for e in validator.iter_errors(obj)]


def mount_secret(root: Path, files: dict[str, bytes]) -> None:
    """Files as the kubelet lays out a Secret volume: in a timestamped directory that
    ``..data`` links to, each top-level name a link into ``..data``, 0440 (fsGroup)."""
    stamped = root / "..2026_01_01_00_00_00.000000000"
    for path, content in files.items():
        (stamped / path).parent.mkdir(parents=True, exist_ok=True)
        (stamped / path).write_bytes(content)
        (stamped / path).chmod(0o440)
    (root / "..data").symlink_to(stamped.name)
    for top in {path.split("/")[0] for path in files}:
        (root / top).symlink_to(Path("..data") / top)
