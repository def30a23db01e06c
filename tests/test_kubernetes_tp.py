"""Tensor-parallel worker groups in deploy/kubernetes, rendered with `kubectl kustomize` as
tests/test_kubernetes.py renders them (it checks what every overlay shares). overlays/gpu: each
pool a group of its own size on one pod, one GPU per rank. overlays/gpu-multinode
(components/lws): decode groups as a LeaderWorkerSet, one rank and one GPU per pod, validated
against the LeaderWorkerSet CRD schema (kubernetes-sigs/lws v0.10.0, tests/data, made strict;
the admission webhook's checks that apply, by hand) and its pod templates against the
Kubernetes schemas; rank 0 the decode Deployment's own pod plus the rendezvous; every rank's
engine flags rank 0's; each rank's command line parsed by pdserve's own parser; the rendezvous
and collective ports closed by the NetworkPolicy to all but the groups' pods."""

from __future__ import annotations

import argparse
import copy
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from tests.k8s_util import (
    arg,
    container,
    crd_validator,
    deployments,
    schema_errors,
)
from tests.test_kubernetes import (
    K8S_VERSION,
    KEDA_CRD,
    Render,
    keda_errors,
    render,
    user_tree,
)

LWS_CRD = Path(__file__).parent / "data" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
LWS_API = "leaderworkerset.x-k8s.io/v1"
# What the LeaderWorkerSet controller adds to every pod of a set (label) and sets in every
# container (env), at v0.10.0: api/leaderworkerset/v1/leaderworkerset_types.go
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}
# Values standing in for the kubelet's $(VAR) expansion, to parse a command line as run
LWS_VALUES = {
    "POD_IP": "10.1.2.3",
    "LWS_LEADER_ADDRESS": "pdserve-decode-0.pdserve-decode.pdserve",
    "LWS_WORKER_INDEX": "1",
}
TP_FLAGS = ("--tensor-parallel-size", "--tp", "--tp-rendezvous", "--tp-rank")  # a rank's place
# SmolLM2-135M-Instruct's config.json as `pdserve pull` writes it (the shape that matters)
MODELS = {
    "smollm2-135m-instruct": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
    }
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return user_tree(tmp_path_factory.mktemp("deploy"))


@pytest.fixture(scope="module")
def gpu(tree: Path) -> Render:
    return render(tree, "gpu")


@pytest.fixture(scope="module")
def multinode(tree: Path) -> Render:
    return render(tree, "gpu-multinode")


@pytest.fixture(scope="module")
def lws_schema() -> Any:
    return crd_validator(LWS_CRD, "v1")


# ---- reading a group ------------------------------------------------------------------------


def the_lws(r: Render) -> dict[str, Any]:
    (lws,) = r.of_kind("LeaderWorkerSet")
    return lws


def templates(lws: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The leader's (rank 0's) and the workers' (the other ranks') pod templates."""
    t = lws["spec"]["leaderWorkerTemplate"]
    return t["leaderTemplate"], t["workerTemplate"]


def main_container(template: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in template["spec"]["containers"] if c["name"] == "pdserve")


def pod_labels(lws: dict[str, Any], template: dict[str, Any]) -> dict[str, str]:
    """A group pod's labels: its template's and the set's name, which the controller adds."""
    return {**template["metadata"]["labels"], LWS_NAME_LABEL: lws["metadata"]["name"]}


def tp_size(c: dict[str, Any]) -> int:
    assert not any(a.startswith("--tp=") for a in c["args"])  # the alias: one spelling only
    return int(arg(c, "--tensor-parallel-size") or 1)


def gpus(c: dict[str, Any]) -> int:
    """A container's GPUs; the same in requests and limits (an extended resource must be)."""
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert requests.get("nvidia.com/gpu") == limits.get("nvidia.com/gpu"), c["name"]
    return int(limits.get("nvidia.com/gpu", 0))


def engine_flags() -> set[str]:
    """Every engine flag (pdserve's add_engine_args), the group's own among them."""
    from pdserve.engine.cli_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return {s for a in parser._actions for s in a.option_strings}


def engine_args(c: dict[str, Any]) -> dict[str, str]:
    """The container's engine flags by name, but those saying where a rank is (TP_FLAGS)."""
    engine = engine_flags() - set(TP_FLAGS)
    pairs = [a.split("=", 1) if "=" in a else [a, ""] for a in c["args"]]
    assert all(flag.startswith("--") for flag, _ in pairs), c["args"]  # --flag=value only
    found = {flag: value for flag, value in pairs if flag in engine}
    assert len(found) == len([flag for flag, _ in pairs if flag in engine]), "a flag twice"
    return found


def expand(text: str, values: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it, with ``values`` standing in for the environment."""
    return re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], text)


def rendezvous_port(c: dict[str, Any]) -> int:
    port = urlsplit(arg(c, "--tp-rendezvous")).port
    assert port is not None
    return port


# ---- overlays/gpu: a group on one pod per worker --------------------------------------------


def test_each_pool_is_a_group_on_one_pod(gpu: Render) -> None:
    sizes = {}
    for role in ("prefill", "decode"):
        c = container(deployments(gpu.objects)[role])
        sizes[role] = tp_size(c)
        assert arg(c, "--tensor-parallel-size") is not None, role  # said, not defaulted
        assert gpus(c) == sizes[role], role  # one GPU a rank
        assert arg(c, "--tp-rendezvous") is None, role  # rank 0 starts the others itself
        threads = int(arg(c, "--threads"))  # each rank's torch threads, on cores of its own
        cpu = c["resources"]["limits"]["cpu"]
        assert int(c["resources"]["requests"]["cpu"]) == int(cpu) >= sizes[role] * threads
    assert sizes["decode"] > 1  # the overlay runs a group of several GPUs


def test_every_group_size_splits_its_model(gpu: Render, multinode: Render) -> None:
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.tp.layout import check_tp_size

    found = [container(d) for d in deployments(gpu.objects).values()]
    found += [main_container(t) for t in templates(the_lws(multinode))]
    for c in found:
        if arg(c, "--tensor-parallel-size") is None:
            continue
        model = arg(c, "--model")
        assert model in MODELS, f"{model}: add its config.json's shape to MODELS"
        check_tp_size(ModelConfig.from_dict(MODELS[model]), tp_size(c))  # ConfigError: no


# ---- overlays/gpu-multinode: a LeaderWorkerSet, one rank a pod ------------------------------


def lws_errors(validator: Any, lws: dict[str, Any]) -> list[str]:
    """The CRD schema's errors and the admission webhook's checks that apply here
    (pkg/webhooks/leaderworkerset_webhook.go, generalValidate), by hand."""
    errors = schema_errors(validator, lws)
    name, spec = lws["metadata"]["name"], lws["spec"]
    if not (len(name) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)):
        errors.append(f"{name}: not a DNS-1035 label (it names the set's headless Service)")
    size = spec["leaderWorkerTemplate"].get("size", 1)
    if size < 1:
        errors.append("size must be equal or greater than 1")
    sub = spec["leaderWorkerTemplate"].get("subGroupPolicy", {}).get("subGroupSize")
    if sub is not None and (sub < 1 or sub > size or (size % sub and (size - 1) % sub)):
        errors.append("size or size - 1 must be divisible by subGroupSize, at most size")
    return errors


def pod_template_errors(template: dict[str, Any]) -> None:
    """Raises where a pod template breaks the Kubernetes schemas (as a core PodTemplate)."""
    obj = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
    kubernetes_validate.validate({**obj, "template": template}, K8S_VERSION, strict=True)


def test_every_object_validates(multinode: Render, lws_schema: Any) -> None:
    keda = crd_validator(KEDA_CRD, "v1alpha1")
    kinds: dict[str, int] = {}
    for obj in multinode.objects:
        kinds[obj["kind"]] = kinds.get(obj["kind"], 0) + 1
        if obj["kind"] == "LeaderWorkerSet":
            assert obj["apiVersion"] == LWS_API
            assert lws_errors(lws_schema, obj) == []
            for template in templates(obj):
                pod_template_errors(template)
        elif obj["kind"] == "ScaledObject":
            assert keda_errors(keda, obj) == [], obj["metadata"]["name"]
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert kinds == {
        "Secret": 5,
        "Service": 2,
        "Deployment": 3,  # decode's is the LeaderWorkerSet now
        "PodDisruptionBudget": 3,
        "ScaledObject": 2,
        "LeaderWorkerSet": 1,
        "NetworkPolicy": 1,
    }


def test_the_lws_validators_refuse_what_a_cluster_would(multinode: Render, lws_schema: Any) -> None:
    lws = the_lws(multinode)
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["sizes"] = 3
    assert len(lws_errors(lws_schema, bad)) == 1
    bad = copy.deepcopy(lws)  # the schema reaches into the pod templates
    main_container(templates(bad)[1])["readinesProbe"] = {}
    assert len(lws_errors(lws_schema, bad)) == 1
    with pytest.raises(kubernetes_validate.ValidationError):
        pod_template_errors(templates(bad)[1])
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["size"] = 0
    assert lws_errors(lws_schema, bad) == ["size must be equal or greater than 1"]
    bad["spec"]["leaderWorkerTemplate"]["size"] = 8
    bad["spec"]["leaderWorkerTemplate"]["subGroupPolicy"] = {"subGroupSize": 3}
    assert len(lws_errors(lws_schema, bad)) == 1
    bad["spec"]["leaderWorkerTemplate"]["subGroupPolicy"] = {"subGroupSize": 4}  # 2 nodes of 4
    assert lws_errors(lws_schema, bad) == []  # (leaderworkerset.yaml's recipe for 8 ranks)


def without(template: dict[str, Any], *fields: str) -> dict[str, Any]:
    """A pod template, its main container lacking ``fields``."""
    out = copy.deepcopy(template)
    for field in fields:
        main_container(out).pop(field)
    return out


def test_rank0_is_the_decode_deployments_pod(gpu: Render, multinode: Render) -> None:
    """The leader's pod is the gpu overlay's decode pod (keys, probes, drain, security, GPU
    nodes: what tests/test_kubernetes.py checks there), plus the rendezvous, with one GPU."""
    decode = deployments(gpu.objects)["decode"]["spec"]["template"]
    leader = templates(the_lws(multinode))[0]
    c, want = main_container(leader), main_container(decode)
    port = rendezvous_port(c)
    assert c["args"][: len(want["args"])] == want["args"]
    added = c["args"][len(want["args"]) :]
    assert f"--tp-rendezvous=tcp://0.0.0.0:{port}" in added  # rank 0 serves it, all addresses
    assert {a.split("=")[0] for a in added} <= engine_flags()  # no worker flag changes
    assert c["ports"] == [*want["ports"], {"name": "tp-rendezvous", "containerPort": port}]
    assert gpus(c) == 1 and gpus(want) == tp_size(want) == tp_size(c)
    same = ("args", "ports", "resources")
    assert without(leader, *same) == without(decode, *same)
    # its Secret by its rendered name, the hash suffixed (components/lws/kustomizeconfig.yaml)
    secrets = {s["metadata"]["name"] for s in multinode.of_kind("Secret")}
    named = [v["secret"]["secretName"] for v in leader["spec"]["volumes"] if "secret" in v]
    assert named and set(named) <= secrets


def test_a_group_is_its_size_of_pods_of_one_gpu(multinode: Render) -> None:
    lws = the_lws(multinode)
    spec, (leader_t, worker_t) = lws["spec"], templates(lws)
    leader, worker = main_container(leader_t), main_container(worker_t)
    size = spec["leaderWorkerTemplate"]["size"]
    assert tp_size(leader) == tp_size(worker) == size  # one rank a pod
    assert gpus(leader) == gpus(worker) == 1  # one GPU a rank
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(worker["resources"][kind])
    assert int(worker["resources"]["limits"]["cpu"]) >= int(arg(worker, "--threads"))
    assert spec["startupPolicy"] == "LeaderCreated"  # rank 0 is ready only once ranks join
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # a group is one decode worker: KEDA sets the groups (no replicas to fight it over)
    assert "replicas" not in spec and "decode" not in deployments(multinode.objects)
    scaled = {s["metadata"]["name"]: s for s in multinode.of_kind("ScaledObject")}
    target = {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "name": lws["metadata"]["name"]}
    assert scaled["pdserve-decode"]["spec"]["scaleTargetRef"] == target
    budgets = {b["metadata"]["name"]: b for b in multinode.of_kind("PodDisruptionBudget")}
    selector = budgets["pdserve-decode"]["spec"]["selector"]["matchLabels"]
    for template in (leader_t, worker_t):  # every pod of the groups, one evicted at a time
        assert selector.items() <= pod_labels(lws, template).items()


def test_ranks_run_rank0s_engine_flags(multinode: Render) -> None:
    lws = the_lws(multinode)
    leader_t, worker_t = templates(lws)
    leader, worker = main_container(leader_t), main_container(worker_t)
    assert (leader["command"], worker["command"]) == (["pdserve", "decode"], ["pdserve", "tp-rank"])
    assert engine_args(worker) == engine_args(leader)  # the same flags, the same values
    assert float(arg(worker, "--tp-timeout")) >= 300  # pods on other nodes start in minutes
    port = rendezvous_port(leader)
    tp = {flag: arg(worker, flag) for flag in TP_FLAGS if flag != "--tp"}  # (tp_size: no --tp)
    assert tp == {
        "--tensor-parallel-size": str(tp_size(leader)),
        "--tp-rendezvous": f"tcp://$(LWS_LEADER_ADDRESS):{port}",
        "--tp-rank": "$(LWS_WORKER_INDEX)",  # 1..size-1: the leader is 0
    }
    assert len(worker["args"]) == len(engine_args(worker)) + len(tp)  # nothing else
    for c in (leader, worker):  # every $(VAR) is set (LWS's by its webhook), else literal
        env = {e["name"] for e in c["env"]} | LWS_ENV
        for var in re.findall(r"\$\((\w+)\)", " ".join(c["command"] + c["args"])):
            assert var in env, f"{c['name']}: $({var})"
    # a rank runs as rank 0 does, where it does, from its image; it holds no key
    pod, rank0 = worker_t["spec"], leader_t["spec"]
    for field in ("securityContext", "nodeSelector", "tolerations"):
        assert pod[field] == rank0[field], field
    for field in ("image", "securityContext"):
        assert worker[field] == leader[field], field
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert not any("secret" in v for v in pod["volumes"]) and "initContainers" not in pod
    assert not {"PDSERVE_KEYS", "PDSERVE_KEY_NAME"} & {e["name"] for e in worker["env"]}
    mounts = {m["mountPath"] for m in worker["volumeMounts"]}
    assert {"/tmp", "/dev/shm"} <= mounts  # writable HOME (read-only root), NCCL's memory


def parse(command: str, args: list[str], **values: str) -> argparse.Namespace:
    """A command line as pdserve's own parser reads it, $(VAR)s expanded (LWS_VALUES, or
    ``values``)."""
    from pdserve.launch.cli import COMMANDS

    parser = argparse.ArgumentParser(prog="pdserve")
    COMMANDS[command](parser.add_subparsers(dest="command", required=True))
    env = {**LWS_VALUES, **values}
    return parser.parse_args([command, *(expand(a, env) for a in args)])


def test_each_command_line_parses(gpu: Render, multinode: Render) -> None:
    for role in ("prefill", "decode"):
        c = container(deployments(gpu.objects)[role])
        args = parse(role, c["args"])
        assert (args.tensor_parallel_size, args.tp_rendezvous) == (tp_size(c), ""), role
    lws = the_lws(multinode)
    leader, worker = (main_container(t) for t in templates(lws))
    size, port = lws["spec"]["leaderWorkerTemplate"]["size"], rendezvous_port(leader)
    args = parse("decode", leader["args"], LWS_GROUP_SIZE=str(size))
    assert (args.tensor_parallel_size, args.tp_rendezvous) == (size, f"tcp://0.0.0.0:{port}")
    leader_address = LWS_VALUES["LWS_LEADER_ADDRESS"]
    for index in range(1, size):  # the worker indices LWS gives the group's other pods
        args = parse(
            "tp-rank", worker["args"], LWS_WORKER_INDEX=str(index), LWS_GROUP_SIZE=str(size)
        )
        assert args.tp_rank == index and args.tensor_parallel_size == size
        assert args.tp_rendezvous == f"tcp://{leader_address}:{port}"


# ---- the network: the rendezvous and the collectives only from the group --------------------


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # (no matchExpressions to evaluate)
    return bool(selector.get("matchLabels", {}).items() <= labels.items())


def port_matches(rule_port: dict[str, Any], port: int, named: dict[str, int]) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    if "port" not in rule_port:
        return True
    want = rule_port["port"]
    if isinstance(want, str):  # a container port's name, on the pod reached
        return named.get(want) == port
    return bool(want <= port <= rule_port.get("endPort", want))


def admits(
    policy: dict[str, Any], named: dict[str, int], port: int, source: dict[str, str] | None
) -> bool:
    """Whether ``policy`` lets a pod with the labels ``source`` in its namespace (None:
    anything else, another namespace or an address) reach ``port`` on a pod it selects,
    whose ports ``named`` are. A namespaceSelector or ipBlock peer counts as anything."""
    for rule in policy["spec"].get("ingress", []):
        if not any(port_matches(p, port, named) for p in rule.get("ports") or [{}]):
            continue
        for peer in rule.get("from") or [None]:
            if peer is None or set(peer) != {"podSelector"}:
                return True
            if source is not None and selects(peer["podSelector"], source):
                return True
    return False


def test_only_the_group_reaches_the_rendezvous(multinode: Render) -> None:
    (policy,) = multinode.of_kind("NetworkPolicy")
    lws = the_lws(multinode)
    group = [pod_labels(lws, t) for t in templates(lws)]
    found = deployments(multinode.objects)
    others = {role: d["spec"]["template"]["metadata"]["labels"] for role, d in found.items()}
    spec = policy["spec"]
    assert "Ingress" in spec["policyTypes"]
    assert all(selects(spec["podSelector"], labels) for labels in group)
    assert not any(selects(spec["podSelector"], labels) for labels in others.values())
    leader = main_container(templates(lws)[0])
    named = {p["name"]: p["containerPort"] for p in leader["ports"]}
    health = int(arg(leader, "--health-port"))  # a rank's preStop asks it
    assert all(admits(policy, named, health, labels) for labels in group)
    for port in (rendezvous_port(leader), 45678):  # the store; a port NCCL or gloo opens
        for labels in group:
            assert admits(policy, named, port, labels), port
        for labels in [*others.values(), {}, None]:
            assert not admits(policy, named, port, labels), (port, labels)
    # rank 0 is a decode worker still: the coordinator and prefill workers reach it
    for flag in ("--control-bind", "--transfer-bind"):
        port = urlsplit(arg(leader, flag)).port
        assert port is not None and port in named.values(), flag
        for role in ("coordinator", "prefill"):
            assert admits(policy, named, port, others[role]), (role, flag)


# ---- a rank stays while rank 0 drains ----------------------------------------------------------


def test_a_rank_stays_while_rank0_drains(multinode: Render) -> None:
    """A rank runs until rank 0 stops it, but SIGTERM ends it at once: its preStop holds the
    SIGTERM while rank 0 (deleted with it) still drains, up to rank 0's --drain-timeout."""
    leader_t, worker_t = templates(the_lws(multinode))
    leader, worker = main_container(leader_t), main_container(worker_t)
    command = worker["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    script, port, wait = command[2], int(command[3]), float(command[4])
    assert port == int(arg(leader, "--health-port"))  # up until rank 0's process ends
    assert wait >= float(arg(leader, "--drain-timeout"))
    assert worker_t["spec"]["terminationGracePeriodSeconds"] >= wait + 10

    def run(port: int) -> float:
        """The hook's seconds, rank 0 at 127.0.0.1:``port``; it may wait 30 s, the run 20."""
        env = {**os.environ, "LWS_LEADER_ADDRESS": "127.0.0.1"}
        start = time.monotonic()
        argv = [sys.executable, "-c", script, str(port), "30"]
        subprocess.run(argv, env=env, check=True, timeout=20)
        return time.monotonic() - start

    with socket.socket() as gone:  # rank 0 gone, nothing listens: it returns at once
        gone.bind(("127.0.0.1", 0))
        closed = gone.getsockname()[1]
    run(closed)
    with socket.create_server(("127.0.0.1", 0)) as up:  # rank 0 there, then gone
        accepted = []

        def serve_once() -> None:
            conn, _ = up.accept()
            conn.close()
            accepted.append(1)
            up.close()

        thread = threading.Thread(target=serve_once, daemon=True)
        thread.start()
        waited = run(up.getsockname()[1])
        thread.join(5)
    assert accepted and waited >= 1  # it asked, waited a second, found rank 0 gone, returned
