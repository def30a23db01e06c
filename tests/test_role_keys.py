"""Role-bound keys (issue 26): each key holds roles, and every receiver refuses (and logs) a
message its sender's roles do not send: the table (``protocol.roles``), keygen's metadata, the
role commands' start-up check, each receiver on real sockets, and ``pdserve serve`` attacked
with a worker's own key."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import zmq
from zmq.auth import create_certificates

from pdserve import envs
from pdserve.decode.main import add_decode_args, run_decode
from pdserve.gateway.zmq_backend import ZmqBackend
from pdserve.kvtransfer import gpu_wire as w
from pdserve.kvtransfer import make_receiver, make_sender
from pdserve.kvtransfer.base import KVPoll, TransferSpec
from pdserve.kvtransfer.common import check_host_layers, layout_of
from pdserve.kvtransfer.gpu_receiver import GpuKVReceiver
from pdserve.launch import cli
from pdserve.launch.keygen import keygen
from pdserve.protocol import messages as m
from pdserve.protocol.codec import registered
from pdserve.protocol.control import Heartbeat, KVLayout, Register, WorkerLoad
from pdserve.protocol.roles import SENDERS, Receiver, refusal
from pdserve.runtime.gate import RoleGate
from pdserve.runtime.keyfiles import read_roles
from pdserve.runtime.security import KeysError, SecureContext, Security
from pdserve.runtime.sockets import bound_address, make_socket, recv_from, send_msg
from pdserve.worker import process
from tests.cluster_util import Cluster
from tests.e2e_util import PDSERVE, ServedCluster
from tests.engine_util import make_engine
from tests.gateway_util import served_model, wait_for

COORD, GW, PRE, DEC = (frozenset({r}) for r in ("coordinator", "gateway", "prefill", "decode"))
BOTH = PRE | DEC
IDENTITIES = {"coord": COORD, "gw": GW, "pre": PRE, "dec": DEC, "both": BOTH}
LAYOUT = KVLayout(block_size=16, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8)
GREEDY = m.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return keygen(tmp_path_factory.mktemp("roles") / "keys", IDENTITIES)


@pytest.fixture
def contexts(keys: Path) -> Iterator[dict[str, SecureContext]]:
    """A secure context per identity (name -> context), destroyed after the test."""
    made = {name: SecureContext(Security.load(keys, name)) for name in IDENTITIES}
    yield made
    for ctx in made.values():
        ctx.destroy(linger=0)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No keys, --insecure or coordinator from the environment; what the test sets is undone."""
    for name in (envs.KEYS, envs.KEY_NAME, envs.INSECURE, "PDSERVE_COORDINATOR"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def user(keys: Path, name: str) -> str:
    return Security.load(keys, name).user_id


def register(worker_id: str, role: str = "decode") -> Register:
    return Register(
        role=role,  # type: ignore[arg-type]
        worker_id=worker_id,
        model="tiny",
        control_address="tcp://127.0.0.1:1",
        transfer_address="tcp://127.0.0.1:1",
        transfer_backend="zmq",
        layout=LAYOUT,
        num_blocks=64,
    )


def generate(request_id: str, stream_address: str, model: str = "tiny") -> m.Generate:
    return m.Generate(
        request_id=request_id,
        model=model,
        prompt_token_ids=[1, 2, 3],
        sampling=GREEDY,
        n=1,
        stream_address=stream_address,
    )


# ---- the table -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("receiver", "msg", "roles", "why"),
    [
        (Receiver.COORDINATOR, "generate", GW, None),
        (Receiver.COORDINATOR, "generate", DEC, "only gateway keys send generate"),
        (Receiver.COORDINATOR, "abort", BOTH, "only gateway keys send abort"),
        (Receiver.COORDINATOR, "register", GW, "only prefill/decode keys send register"),
        (Receiver.COORDINATOR, "reserved", PRE, "only decode keys send reserved"),
        (Receiver.COORDINATOR, "transfer_done", DEC, "only prefill keys send transfer_done"),
        (Receiver.COORDINATOR, "request_error", PRE, None),
        (Receiver.COORDINATOR, "token_batch", DEC, "no role sends token_batch"),
        (Receiver.WORKER, "reserve", DEC, "only coordinator keys send reserve"),
        (Receiver.WORKER, "transfer_done", PRE, "only coordinator keys send transfer_done"),
        (Receiver.WORKER, "abort", COORD, None),
        (Receiver.GATEWAY, "token_batch", PRE, None),
        (Receiver.GATEWAY, "cluster_state", DEC, "only coordinator keys send cluster_state"),
        (Receiver.GATEWAY, "request_error", COORD, None),
        (Receiver.KV, "kv_header", DEC, "only prefill keys send kv_header"),
        (Receiver.KV, "gpu_hello", GW, "only prefill keys send gpu_hello"),
    ],
)
def test_the_table(receiver: Receiver, msg: str, roles: frozenset[str], why: str | None) -> None:
    got = refusal(receiver, msg, roles)
    assert got == (None if why is None else f"{why} to the {receiver}")


@pytest.mark.parametrize(
    ("role", "roles", "allowed"),
    [("decode", DEC, True), ("both", DEC, False), ("both", BOTH, True), ("decode", PRE, False)],
)
def test_a_worker_registers_only_as_what_its_key_holds(role, roles, allowed) -> None:
    got = refusal(Receiver.COORDINATOR, "register", roles, register("w", role))
    needs = "prefill+decode" if role == "both" else role
    assert got == (None if allowed else f"registering as {role} needs a key of role {needs}")


def test_the_table_names_every_message_and_no_other() -> None:
    """A new message type must be placed in the table (or it is refused everywhere)."""
    listed = {tag for table in SENDERS.values() for tag in table}
    gpu = {w.TAGS[t] for t in (w.Hello, w.Begin, w.Done)}  # what a nccl sender sends
    assert set(registered()) - listed == {"kv_ack"}  # a NIXL notification, on no keyed socket
    assert listed - set(registered()) == gpu


class Tagged:
    """An outbox that records (sender roles, receiver, tag) of everything sent through it."""

    def __init__(self, inner, roles: frozenset[str], seen: set) -> None:
        self.inner, self.roles, self.seen = inner, roles, seen

    def _saw(self, receiver: Receiver, msg: m.Message) -> None:
        self.seen.add((self.roles, receiver, msg.TYPE))

    def to_coordinator(self, msg: m.Message) -> None:
        self._saw(Receiver.COORDINATOR, msg)
        self.inner.to_coordinator(msg)

    def to_gateway(self, address: str, msg: m.Message) -> None:
        self._saw(Receiver.GATEWAY, msg)
        self.inner.to_gateway(address, msg)

    def to_worker(self, worker_id: str, address: str, msg: m.Message) -> None:
        self._saw(Receiver.WORKER, msg)
        self.inner.to_worker(worker_id, address, msg)

    def forget_worker(self, worker_id: str) -> None:
        self.inner.forget_worker(worker_id)


def tagged(cluster: Cluster, seen: set, colocated: bool) -> Cluster:
    shared = cluster.coordinator.shared
    shared.outbox = Tagged(shared.outbox, COORD, seen)  # type: ignore[assignment]
    for wid, worker in cluster.workers.items():
        roles = BOTH if colocated else PRE if wid.startswith("p") else DEC
        worker.outbox = worker.tokens.outbox = Tagged(worker.outbox, roles, seen)
    return cluster


def test_what_the_cluster_really_sends_is_what_the_table_allows(tiny_dir: Path) -> None:
    """The real coordinator and workers, in process, through finished, aborted, token-0-ended
    and failed requests, disaggregated and colocated: every message each part sends is one
    the table lets its role send there."""
    seen: set = set()
    disagg = tagged(Cluster([make_engine(tiny_dir)], [make_engine(tiny_dir)]), seen, False)
    coloc = tagged(Cluster([], [make_engine(tiny_dir)], colocated=True), seen, True)
    try:
        for c in (disagg, coloc):
            c.submit("done", [1, 2, 3, 4, 5], GREEDY, n=2)
            c.submit("one", [1, 2, 3], m.SamplingParams(max_tokens=1, temperature=0.0))
            c.submit("cut", [5, 6, 7], m.SamplingParams(max_tokens=400, ignore_eos=True))
            for _ in range(4):
                c.pump_round()
            c.coordinator.handle(m.Abort("cut", "gateway"), time.monotonic())
            c.coordinator.handle(m.GatewayHello("gw"), time.monotonic())
            c.pump()
        # a prompt only the prefill worker refuses (the decode worker took its reservation):
        # it answers the job with a RequestError
        requests = disagg.workers["p0"].engine.requests
        requests.max_model_len = 3 + GREEDY.max_tokens - 1
        disagg.submit("turned", [1, 2, 3], GREEDY)
        disagg.pump()
        assert {e.request_id for e in disagg.errors()} >= {"turned"}
    finally:
        disagg.close()
        coloc.close()
    refused = [(r, rec, t) for r, rec, t in seen if refusal(rec, t, r) is not None]
    assert refused == []
    sent = {(rec, t) for _, rec, t in seen}
    assert sent == {
        (Receiver.COORDINATOR, t)
        for t in ("reserved", "transfer_done", "finished", "request_error")
    } | {(Receiver.WORKER, t) for t in ("reserve", "prefill_job", "transfer_done", "abort")} | {
        (Receiver.GATEWAY, t) for t in ("token_batch", "accepted", "request_error", "cluster_state")
    }


# ---- keys ------------------------------------------------------------------------------------


def test_keygen_writes_each_nodes_roles_and_every_node_reads_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "keys"
    nodes = ["a:coordinator+gateway", "b:prefill", "c:decode+prefill", "d:all"]
    assert cli.main(["keygen", f"--out={out}", "--nodes", *nodes]) == 0
    assert f"{out / 'c'}: copy to node c (prefill+decode)" in capsys.readouterr().out
    expected = {"a": COORD | GW, "b": PRE, "c": BOTH, "d": COORD | GW | BOTH}
    for node in expected:
        security = Security.load(out / node)
        assert security.own_roles == expected[node]
        got = {name: security.roles_of(user(out / name, name)) for name in expected}
        assert got == expected
        assert read_roles(out / node / f"{node}.key_secret") == expected[node]
    assert Security.load(out / "a").roles_of("not a key") == frozenset()


@pytest.mark.parametrize(
    ("nodes", "error"),
    [
        (["a:gateway", "b"], "node 'b' has no roles: write b:ROLE[+ROLE...] with roles from "),
        (["a:prefil"], "node 'a': unknown role 'prefil' in 'prefil': roles are coordinator, "),
        (["a:gateway", "a:decode"], "keygen needs distinct identity names"),
    ],
)
def test_keygen_requires_known_roles_for_every_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nodes: list[str], error: str
) -> None:
    assert cli.main(["keygen", f"--out={tmp_path / 'keys'}", "--nodes", *nodes]) == 1
    assert capsys.readouterr().err.startswith(f"pdserve keygen: {error}")
    assert not (tmp_path / "keys").exists()


def test_keys_made_before_roles_refuse_to_load(tmp_path: Path) -> None:
    """A key file with no roles would let its holder send anything: it is not loaded, and the
    message says how to make keys that work."""
    root = tmp_path / "old"
    (root / "authorized").mkdir(parents=True)
    for name in ("server", "w1"):  # the layout keygen wrote before roles existed
        public, secret = create_certificates(root, name)
        os.chmod(secret, 0o600)
        os.replace(public, root / "authorized" / f"{name}.key")
    with pytest.raises(KeysError) as e:
        Security.load(root, "w1")
    assert str(e.value).startswith(f"{root / 'authorized' / 'server.key'} names no roles: ")
    assert "pdserve keygen --out DIR --nodes NAME:ROLE[+ROLE...]" in str(e.value)


@pytest.mark.parametrize(
    ("argv", "name", "missing"),
    [
        (["prefill"], "gw", "prefill"),
        (["decode", "--colocated"], "dec", "prefill"),
        (["coordinator"], "both", "coordinator"),
        (["gateway"], "coord", "gateway"),
    ],
)
def test_a_role_refuses_to_start_with_a_key_of_other_roles(
    env: pytest.MonkeyPatch, keys: Path, capsys, argv: list[str], name: str, missing: str
) -> None:
    flags = [] if argv[0] == "coordinator" else ["--coordinator=tcp://127.0.0.1:1"]
    flags += ["--model=/nonexistent/never-read"] if argv[0] in ("prefill", "decode") else []
    assert cli.main([*argv, *flags, f"--keys={keys}", f"--key-name={name}"]) == 2
    err = capsys.readouterr().err
    held = "+".join(
        r for r in ("coordinator", "gateway", "prefill", "decode") if r in IDENTITIES[name]
    )
    assert err.startswith(
        f"pdserve {argv[0]}: identity {name!r} holds the roles {held}, not {missing}: every "
        "receiver would refuse what this process sends"
    )


@pytest.mark.parametrize(
    ("flags", "workers"),
    [
        (["--prefill=2", "--decode=1"], {"prefill-0": PRE, "prefill-1": PRE, "decode-2": DEC}),
        (["--mode=colocated"], {"decode-0": BOTH, "decode-1": BOTH}),
        (["--autoscale", "--max-workers=2"], {"worker-0": BOTH, "worker-1": BOTH}),  # slots turn
    ],
)
def test_serve_gives_each_process_a_key_of_its_own_role(flags, workers) -> None:
    from pdserve.launch.serve import add_serve_args
    from pdserve.launch.serve_keys import identities as _identities

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert _identities(parser.parse_args(flags)) == {"coordinator": COORD, "gateway": GW, **workers}


def test_a_gate_logs_a_refusal_once_a_while_and_counts_each(
    keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = RoleGate(Security.load(keys, "coord"), Receiver.COORDINATOR)
    dec, gw = user(keys, "dec"), user(keys, "gw")
    for _ in range(3):
        assert not gate.admit(generate("r", "x"), dec)
    assert gate.admit(generate("r", "x"), gw)
    assert not gate.admit(generate("r", "x"), "")  # no key at all (an unknown one)
    assert gate.refused == {"generate": 4}
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.runtime.gate"]
    assert lines == [
        f"refused generate from key {dec} (roles: decode) at the coordinator: only gateway keys "
        "send generate to the coordinator",
        "refused generate from key (none) (roles: none) at the coordinator: only gateway keys "
        "send generate to the coordinator",
    ]
    insecure = RoleGate(None, Receiver.COORDINATOR)  # --insecure: no keys, no checks
    assert insecure.admit(generate("r", "x"), "") and insecure.refused == {}


# ---- each receiver, on real sockets ----------------------------------------------------------


def test_the_coordinator_takes_each_message_from_its_senders_role_only(
    keys: Path, contexts: dict[str, SecureContext], tmp_path: Path
) -> None:
    address_file, logged = tmp_path / "coordinator", tmp_path / "coordinator.log"
    with open(logged, "w") as log:
        proc = subprocess.Popen(
            [
                *PDSERVE,
                "coordinator",
                f"--keys={keys}",
                "--key-name=coord",
                "--bind=tcp://127.0.0.1:0",
                f"--address-file={address_file}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        assert wait_for(address_file.exists, 120)
        to = {
            name: make_socket(ctx, zmq.PUSH, address_file.read_text(), bind=False)
            for name, ctx in contexts.items()
        }
        state = make_socket(contexts["gw"], zmq.PULL, "tcp://127.0.0.1:0", bind=True)
        send_msg(to["dec"], generate("forged", bound_address(state)))  # a worker's Generate
        send_msg(to["gw"], register("g0"))  # a gateway posing as a worker
        send_msg(to["dec"], register("d-both", "both"))  # a decode key claiming to prefill
        send_msg(to["pre"], m.Reserved(request_id="x", worker_id="p1", block_ids=[],
                                       transfer_address=""))  # fmt: skip
        for name, worker_id, role in [("dec", "d1", "decode"), ("pre", "p1", "prefill"),
                                      ("both", "c1", "both")]:  # fmt: skip
            send_msg(to[name], register(worker_id, role))

        def workers() -> list[str]:
            send_msg(to["gw"], m.GatewayHello(bound_address(state)))
            got = recv_from(state, 60_000)
            assert got is not None and isinstance(got[1], m.ClusterState), got
            return sorted(w.worker_id for w in got[1].workers)

        assert wait_for(lambda: workers() == ["c1", "d1", "p1"])
        why = {
            ("generate", "dec", "decode"): "only gateway keys send generate",
            ("register", "gw", "gateway"): "only prefill/decode keys send register",
            ("register", "dec", "decode"): "registering as both needs a key of role prefill+decode",
            ("reserved", "pre", "prefill"): "only decode keys send reserved",
        }
        lines = [
            f"refused {tag} from key {user(keys, name)} (roles: {roles}) at the coordinator: "
            f"{reason}"
            for (tag, name, roles), reason in why.items()
        ]
        assert wait_for(lambda: all(line in logged.read_text() for line in lines))
        while state.poll(0):  # the forged Generate got no answer (no Accepted, no error)
            assert isinstance(recv_from(state, 0)[1], m.ClusterState)  # type: ignore[index]
    finally:
        proc.terminate()
        proc.wait(30)
    assert logged.read_text().count("refused ") == len(why)


class LoopReceiver(GpuKVReceiver):
    """The nccl backend's control machinery on CPU (as tests/test_gpu_kvtransfer.py)."""

    backend = "loop"
    status = staticmethod(lambda: (True, "test"))

    def _check_layers(self, kv_layers):
        return check_host_layers(kv_layers)

    def _side_stream(self):
        return None

    def _on_hello(self, identity, hello):
        return w.NcclUniqueId(self.session, [])


def kv_cache(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((10, 2, 4, 2, 8), generator=g) for _ in range(3)]


def test_kv_receivers_take_kv_from_prefill_keys_only(contexts: dict[str, SecureContext]) -> None:
    src, dst = kv_cache(1), kv_cache(2)
    before = [t.clone() for t in dst]
    receiver = make_receiver("zmq", dst, ctx=contexts["dec"])
    senders = {name: make_sender("zmq", ctx=contexts[name]) for name in ("gw", "both", "pre")}
    loop = LoopReceiver(kv_cache(3), ctx=contexts["dec"])
    try:
        secret = receiver.expect("r1", [4, 5])
        spec = TransferSpec("r1", [0, 1], [4, 5], receiver.address, secret=secret)
        senders["gw"].send(spec, src)  # the reservation's own secret, from a gateway's key
        assert wait_for(lambda: receiver.gate.refused == {"kv_header": 1})
        assert receiver.poll("r1") is KVPoll.PENDING
        assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))
        senders["both"].send(spec, src)  # prefill+decode (a colocated or autoscaled worker)
        assert wait_for(lambda: receiver.poll("r1") is KVPoll.DONE)
        assert all(torch.equal(d[[4, 5]], s[[0, 1]]) for d, s in zip(dst, src, strict=True))
        # nccl's control channel: a Hello from a decode key gets no answer, a prefill key's does
        hello = w.encode(w.Hello("loop", layout_of(kv_cache(4)), os.getpid(), ""))
        dealers = {n: make_socket(contexts[n], zmq.DEALER, loop.address, bind=False)
                   for n in ("dec", "pre")}  # fmt: skip
        dealers["dec"].send(hello)
        assert wait_for(lambda: loop.gate.refused == {"gpu_hello": 1})
        dealers["pre"].send(hello)
        assert dealers["pre"].poll(60_000)
        assert isinstance(w.decode(dealers["pre"].recv()), w.NcclUniqueId)
        assert not dealers["dec"].poll(0) and loop.gate.refused == {"gpu_hello": 1}
    finally:
        for sender in senders.values():
            sender.close()
        receiver.close()
        loop.close()


def test_the_gateway_stream_takes_tokens_from_workers_and_state_from_the_coordinator(
    env: pytest.MonkeyPatch, keys: Path, contexts: dict[str, SecureContext]
) -> None:
    env.setenv(envs.KEYS, str(keys))
    env.setenv(envs.KEY_NAME, "gw")
    state = m.ClusterState(models=[served_model("tiny", 64)], workers=[])
    tokens = m.TokenBatch([])

    async def attack() -> None:
        backend = ZmqBackend("tcp://127.0.0.1:1")  # no coordinator: its hellos go nowhere
        await backend.start()
        try:
            to = {
                name: make_socket(ctx, zmq.PUSH, backend.stream_address, bind=False)
                for name, ctx in contexts.items()
            }
            send_msg(to["dec"], state)  # a worker posing as the coordinator
            send_msg(to["coord"], tokens)  # the coordinator's key writing tokens
            send_msg(to["gw"], tokens)  # a gateway's key writing another gateway's tokens
            for _ in range(6000):
                if backend.gate.refused == {"cluster_state": 1, "token_batch": 2}:
                    break
                await asyncio.sleep(0.01)
            assert backend.gate.refused == {"cluster_state": 1, "token_batch": 2}
            assert backend.models() == []
            send_msg(to["pre"], tokens)
            send_msg(to["coord"], state)
            for _ in range(6000):
                if backend.models():
                    break
                await asyncio.sleep(0.01)
            assert [s.name for s in backend.models()] == ["tiny"]
            assert backend.gate.refused == {"cluster_state": 1, "token_batch": 2}
        finally:
            await backend.close()

    asyncio.run(attack())


def test_a_worker_takes_orders_from_the_coordinator_key_only(
    env: pytest.MonkeyPatch,
    keys: Path,
    contexts: dict[str, SecureContext],
    tiny_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real decode worker (``run_decode``, its keys from the environment as the command
    exports them): a Reserve from a decode key or a gateway key is refused and logged; the
    coordinator's is answered."""
    caplog.set_level(logging.INFO)
    inbox = make_socket(contexts["coord"], zmq.PULL, "tcp://127.0.0.1:0", bind=True)
    env.setenv(envs.KEYS, str(keys))
    env.setenv(envs.KEY_NAME, "dec")
    stop = threading.Event()
    env.setattr(process, "stop_on_signals", lambda: stop)
    parser = argparse.ArgumentParser()
    add_decode_args(parser)
    engine = [f"--model={tiny_dir}", "--num-kv-blocks=64", "--block-size=8", "--max-step-time=0"]
    args = parser.parse_args([*engine, f"--coordinator={bound_address(inbox)}", "--worker-id=d7"])
    worker = threading.Thread(target=run_decode, args=(args,))
    worker.start()

    def next_msg(kind: type) -> m.Message:
        while True:
            got = recv_from(inbox, 60_000)
            assert got is not None, f"no {kind.__name__} from the worker"
            if isinstance(got[1], kind):
                return got[1]

    try:
        control = next_msg(Register).control_address  # type: ignore[attr-defined]
        to = {name: make_socket(contexts[name], zmq.PUSH, control, bind=False)
              for name in ("dec", "gw", "coord")}  # fmt: skip

        def reserve(rid: str) -> m.Reserve:
            return m.Reserve(request_id=rid, prompt_token_ids=[1, 2, 3], sampling=GREEDY, n=1,
                             stream_address="tcp://127.0.0.1:1")  # fmt: skip

        send_msg(to["dec"], reserve("forged-by-a-peer"))
        send_msg(to["gw"], reserve("forged-by-a-gateway"))
        refused = [
            f"refused reserve from key {user(keys, name)} (roles: {role}) at the worker: only "
            "coordinator keys send reserve to the worker"
            for name, role in (("dec", "decode"), ("gw", "gateway"))
        ]
        assert wait_for(lambda: all(x in caplog.text for x in refused))
        send_msg(to["coord"], reserve("real"))
        reserved = next_msg(m.Reserved)
        assert (reserved.request_id, reserved.error) == ("real", None)  # type: ignore[attr-defined]
        send_msg(to["coord"], m.Abort("real", "done"))  # its blocks back, so the drain is quick
    finally:
        stop.set()
        worker.join(120)
        inbox.close()
    assert not worker.is_alive()
    assert "refused reserve from key " + user(keys, "coord") not in caplog.text


# ---- pdserve serve, attacked with its own worker's key -----------------------------------------


def child_keys(pid: int) -> Path:
    """The keys directory ``pdserve serve`` (process ``pid``) gave its children."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        found = [a.split("=", 1)[1] for a in argv if a.startswith("--keys=")]
        if ppid == pid and found:
            return Path(found[0])
    raise AssertionError(f"no child of {pid} has --keys")


def test_a_workers_key_cannot_drive_the_cluster(tiny_dir: Path) -> None:
    """``pdserve serve`` as shipped; this process holds a decode worker's own key (read from
    the run directory) and pushes a ``Generate`` to the coordinator and a ``ClusterState`` to
    the gateway's token stream: both are refused and logged, once however often sent, and
    requests keep being served."""
    cluster = ServedCluster(tiny_dir, "--num-kv-blocks=256")
    out = cluster.output()
    coordinator = re.search(r"coordinator inbox: (\S+)", out).group(1)  # type: ignore[union-attr]
    stream = re.search(r"token stream at (\S+)", out).group(1)  # type: ignore[union-attr]
    keys = child_keys(cluster.proc.pid)
    security = Security.load(keys, "decode-1")
    ctx = SecureContext(security)
    try:
        to_coordinator = make_socket(ctx, zmq.PUSH, coordinator, bind=False)
        to_gateway = make_socket(ctx, zmq.PUSH, stream, bind=False)
        answers = make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
        for i in range(3):
            send_msg(
                to_coordinator, generate(f"forged-{i}", bound_address(answers), cluster.model_name)
            )
            send_msg(to_gateway, m.ClusterState(models=[], workers=[]))
        # a message this key may send, after them on the same socket: once the coordinator
        # has judged it (it refuses these figures), it has judged the three Generates
        send_msg(to_coordinator, Heartbeat(worker_id="decode-1", load=WorkerLoad.idle(1)))
        assert wait_for(lambda: "refused a heartbeat of decode-1" in cluster.output())
        key = security.user_id
        refused = [
            f"refused generate from key {key} (roles: decode) at the coordinator: only gateway "
            "keys send generate to the coordinator",
            f"refused cluster_state from key {key} (roles: decode) at the gateway: only "
            "coordinator keys send cluster_state to the gateway",
        ]
        assert wait_for(lambda: all(line in cluster.output() for line in refused))
        assert not answers.poll(0)  # no Accepted, no error, no token for a forged request
        r = httpx.post(
            f"{cluster.url}/v1/completions",
            json={
                "model": cluster.model_name,
                "prompt": [1, 2, 3],
                "max_tokens": 6,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        assert httpx.get(f"{cluster.url}/health").status_code == 200  # its state still true
    finally:
        ctx.destroy(linger=0)
        log = cluster.stop()
    assert [log.count(line) for line in refused] == [1, 1]
    assert log.count("refused ") == 3  # those two and the heartbeat: nothing legitimate
