"""CURVE on every internal socket, worker ids bound to keys, bounded numbers, capped sockets.

The attacks of issue 13, from real processes on loopback: a process without the cluster's keys
(or with another cluster's) cannot register, heartbeat or inject tokens; an insider key cannot
take over another key's live worker id or report impossible numbers."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.coordinator.main import GATEWAY_IDLE_S, _Outbox
from pdserve.engine.tokenizer import Tokenizer
from pdserve.launch.keygen import keygen
from pdserve.protocol import messages as m
from pdserve.protocol.control import (
    Heartbeat,
    KVLayout,
    Register,
    StepCounters,
    WorkerCounters,
    WorkerLoad,
)
from pdserve.runtime.security import KeysError, SecureContext, Security
from pdserve.runtime.sockets import bound_address, make_socket, recv_from, send_msg
from tests.e2e_util import PDSERVE, ServedCluster
from tests.engine_util import greedy, make_engine
from tests.gateway_util import wait_for

LAYOUT = KVLayout(block_size=16, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    # w1 is a gateway too: its hellos ask for the cluster's state after its own messages
    decode, gateway = frozenset({"decode"}), frozenset({"gateway"})
    identities = {"coord": frozenset({"coordinator"}), "w1": decode | gateway, "w2": decode}
    return keygen(tmp_path / "keys", identities)


def register(worker_id: str, num_blocks: int = 64, address: str = "tcp://127.0.0.1:1") -> Register:
    return Register(
        role="decode",
        worker_id=worker_id,
        model="tiny",
        control_address=address,
        transfer_address=address,
        transfer_backend="zmq",
        layout=LAYOUT,
        num_blocks=num_blocks,
    )


def heartbeat(worker_id: str, used: int, total: int = 64, queued: int = 0) -> Heartbeat:
    load = WorkerLoad(
        free_blocks=total - used,
        used_blocks=used,
        total_blocks=total,
        running=0,
        waiting=0,
        queued_prompt_tokens=queued,
    )
    return Heartbeat(worker_id=worker_id, load=load)


def attempt(sock: zmq.Socket, msg: m.Message) -> None:
    """Send as an attacker would: zmq takes nothing while the handshake keeps failing."""
    with contextlib.suppress(zmq.Again):
        send_msg(sock, msg, flags=zmq.NOBLOCK)


# A plain socket meeting a CURVE one: whichever side notices the mismatch first says why.
MISMATCH = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


def monitored_push(ctx: zmq.Context, address: str) -> tuple[zmq.Socket, zmq.Socket]:
    """A PUSH socket and its event monitor, made before it connects: a refused handshake may
    be its only one (zmq gives up when it is the side that finds the mismatch)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket()
    sock.connect(address)
    return sock, monitor


def wait_events(monitor: zmq.Socket, done: Callable[[set[int]], bool], what: str) -> None:
    """Take events from ``monitor`` (a socket's event monitor) until ``done(events seen)``:
    the event itself, not a pause, proves a connection was refused."""
    seen: set[int] = set()
    deadline = time.monotonic() + 60
    while not done(seen):
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0 and monitor.poll(left_ms), f"{what}: not within 60 s"
        seen.add(recv_monitor_message(monitor)["event"])


# ---- keys -----------------------------------------------------------------------------------


def test_keygen_writes_private_files_and_load_refuses_readable_ones(keys: Path) -> None:
    assert (keys.stat().st_mode & 0o777) == 0o700
    secrets = sorted(p.name for p in keys.glob("*.key_secret"))
    assert secrets == ["coord.key_secret", "server.key_secret", "w1.key_secret", "w2.key_secret"]
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in keys.glob("*.key_secret"))
    w1 = Security.load(keys, "w1")
    assert w1.public in w1.authorized and len(w1.authorized) == 3
    with pytest.raises(KeysError, match="choose one with --key-name"):
        Security.load(keys)
    os.chmod(keys / "w2.key_secret", 0o644)
    with pytest.raises(KeysError, match="readable by others"):
        Security.load(keys, "w2")


def test_a_role_without_keys_refuses_to_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    out = subprocess.run(
        [*PDSERVE, "coordinator"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "no cluster keys: pass --keys DIR" in out.stderr


# ---- sockets --------------------------------------------------------------------------------


def test_only_authorized_keys_get_through_and_each_message_names_its_sender(
    keys: Path, tmp_path: Path
) -> None:
    w1 = Security.load(keys, "w1")
    # a key of its own, and the server's public key (public: anyone may know it)
    other = Security.load(keygen(tmp_path / "other", {"x": frozenset({"decode"})}), "x")
    other = dataclasses.replace(other, server_public=w1.server_public)
    server, plain = SecureContext(Security.load(keys, "coord")), zmq.Context()
    clients = [SecureContext(w1), SecureContext(other)]
    try:
        inbox = make_socket(server, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
        monitor = inbox.get_monitor_socket()  # before any peer: no refusal goes unseen
        address = bound_address(inbox)
        pushes = [make_socket(ctx, zmq.PUSH, address, bind=False) for ctx in [*clients, plain]]
        send_msg(pushes[0], m.Abort("r0", "x"))
        for i, push in enumerate(pushes[1:], 1):  # refused: their pipes may already be gone
            attempt(push, m.Abort(f"r{i}", "x"))
        assert recv_from(inbox, 60_000) == (w1.user_id, m.Abort("r0", "x"))
        # the foreign key and the plain socket: refused at the handshake, so nothing of theirs
        # is delivered, ever
        wait_events(
            monitor,
            lambda seen: zmq.EVENT_HANDSHAKE_FAILED_AUTH in seen and bool(seen & MISMATCH),
            "both refused",
        )
        assert not inbox.poll(0)
    finally:
        for ctx in [server, *clients, plain]:
            ctx.destroy(linger=0)


def test_frames_over_the_cap_never_arrive() -> None:
    ctx = zmq.Context()
    try:
        inbox = make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True, max_msg_bytes=1000)
        assert inbox.getsockopt(zmq.MAXMSGSIZE) == 1000
        monitor = inbox.get_monitor_socket()
        big = make_socket(ctx, zmq.PUSH, bound_address(inbox), bind=False)
        big.send(b"x" * 1001)
        # the inbox drops the connection that brought it, delivering nothing
        wait_events(monitor, lambda seen: zmq.EVENT_DISCONNECTED in seen, "big dropped")
        assert not inbox.poll(0)
        small = make_socket(ctx, zmq.PUSH, bound_address(inbox), bind=False)
        small.send(b"x" * 1000)
        assert inbox.poll(60_000) and inbox.recv() == b"x" * 1000
    finally:
        ctx.destroy(linger=0)


def test_the_coordinator_serves_a_bounded_number_of_gateways() -> None:
    ctx = zmq.Context()
    outbox = _Outbox(ctx, max_gateways=2)
    try:
        for port in (5001, 5002, 5003):
            outbox.to_gateway(f"tcp://127.0.0.1:{port}", m.Abort("r", "x"))
        assert sorted(outbox.gateways) == ["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"]
        assert len(outbox._socks) == 2
        outbox.expire_gateways(time.monotonic() + GATEWAY_IDLE_S + 1)
        assert outbox.gateways == {} and outbox._socks == {}
    finally:
        outbox.close()
        ctx.destroy(linger=0)


# ---- the coordinator, from processes with and without keys -----------------------------------


def test_worker_ids_are_bound_to_keys_and_numbers_are_bounded(keys: Path, tmp_path: Path) -> None:
    address_file = tmp_path / "coordinator"
    log = open(tmp_path / "coordinator.log", "w+")  # noqa: SIM115 (read back at the end)
    cmd = [*PDSERVE, "coordinator", f"--keys={keys}", "--key-name=coord"]
    proc = subprocess.Popen(
        [*cmd, "--bind=tcp://127.0.0.1:0", f"--address-file={address_file}"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    w1, w2 = SecureContext(Security.load(keys, "w1")), SecureContext(Security.load(keys, "w2"))
    plain = zmq.Context()
    try:
        deadline = time.monotonic() + 120
        while not address_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        coordinator = address_file.read_text()
        as_w1, as_w2, keyless = (
            make_socket(ctx, zmq.PUSH, coordinator, bind=False) for ctx in (w1, w2, plain)
        )
        state_inbox = make_socket(w1, zmq.PULL, "tcp://127.0.0.1:0", bind=True)

        def workers() -> dict[str, tuple[int, int]]:
            """worker id -> (used, total) blocks, as the coordinator tells a gateway."""
            send_msg(as_w1, m.GatewayHello(bound_address(state_inbox)))
            got = recv_from(state_inbox, 60_000)
            assert got is not None and isinstance(got[1], m.ClusterState)
            return {w.worker_id: (w.load.used_blocks, w.load.total_blocks) for w in got[1].workers}

        w1_key, w2_key = Security.load(keys, "w1").user_id, Security.load(keys, "w2").user_id

        def refused(*lines: str) -> bool:
            """Wait until the coordinator has logged each of ``lines``: it judged those messages."""
            logged = tmp_path / "coordinator.log"
            return wait_for(lambda: all(x in logged.read_text() for x in lines))

        # one socket's messages arrive in order: the state asked for on as_w1 follows its own
        send_msg(as_w1, register("d1"))
        send_msg(as_w1, heartbeat("d1", used=7))
        attempt(keyless, register("fake", num_blocks=1 << 30))  # no key: never heard
        send_msg(as_w2, register("huge", num_blocks=1 << 40))  # a key, impossible numbers
        assert refused("refusing worker huge: num_blocks=1099511627776 is outside [1, ")
        assert workers() == {"d1": (7, 64)}
        # another key re-registers d1 and heartbeats for it; d1 itself lies about its numbers
        send_msg(as_w2, register("d1", address="tcp://127.0.0.1:2"))
        send_msg(as_w2, heartbeat("d1", used=0))
        send_msg(as_w1, heartbeat("d1", used=1, queued=-(10**9)))
        send_msg(as_w1, heartbeat("d1", used=1, total=1 << 30))
        steps = StepCounters(tpot_target_s=float("nan"))  # /metrics figures no worker sends
        send_msg(
            as_w1,
            dataclasses.replace(heartbeat("d1", used=2), counters=WorkerCounters(steps=steps)),
        )
        assert refused(
            f"refused Register of live worker d1 from key {w2_key}: it registered with key ",
            f"refused Heartbeat for worker d1 from key {w2_key}",
            "refused a heartbeat of d1: queued_prompt_tokens=-1000000000",
            "refused a heartbeat of d1: total_blocks=1073741824, registered 64",
            "refused a heartbeat of d1: tpot_target_s=nan is outside [0, 10000]",
        )
        assert workers() == {"d1": (7, 64)}
        send_msg(as_w1, heartbeat("d1", used=3))  # its own, true figures still count
        assert workers() == {"d1": (3, 64)}
    finally:
        for ctx in (w1, w2, plain):
            ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(10)
    log.seek(0)
    out = log.read()
    assert f"from key {w1_key}" not in out  # d1's own key is never refused
    assert "fake" not in out


def test_a_process_without_keys_cannot_register_or_inject(tiny_dir: Path) -> None:
    """``pdserve serve`` as shipped, attacked from this (keyless) process: a fake decode
    worker with a billion blocks, a forged drain of the real one, forged tokens and a forged
    ``stop`` into a streaming victim. The victim's tokens equal the engine's."""
    cluster = ServedCluster(tiny_dir, "--num-kv-blocks=256")
    ctx = zmq.Context()
    try:
        out = cluster.output()
        coordinator = re.search(r"coordinator inbox: (\S+)", out).group(1)
        stream = re.search(r"token stream at (\S+)", out).group(1)
        to_coordinator, coordinator_events = monitored_push(ctx, coordinator)
        to_gateway, gateway_events = monitored_push(ctx, stream)
        fake = register("fake", num_blocks=1 << 30, address="tcp://127.0.0.1:9")
        forged = [
            fake,
            heartbeat("fake", used=0, total=1 << 30),
            Heartbeat(
                worker_id="decode-1", load=dataclasses.replace(WorkerLoad.idle(0), draining=True)
            ),
        ]
        for msg in forged:
            attempt(to_coordinator, msg)
        for monitor in (coordinator_events, gateway_events):
            wait_events(monitor, lambda seen: bool(seen & MISMATCH), "the handshake refused")
        for msg in forged:  # and once refused
            attempt(to_coordinator, msg)
        expected = make_engine(tiny_dir).generate([[1, 2, 3, 4]], greedy(24))[0].new_token_ids
        body = {
            "model": cluster.model_name,
            "prompt": [1, 2, 3, 4],
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        texts, request_id = [], None
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                if request_id is None:
                    request_id = chunk["id"]
                    for i in range(1, 30):  # what a forger would write into the stream
                        attempt(
                            to_gateway,
                            m.TokenBatch(
                                [
                                    m.TokenChunk(
                                        request_id=request_id,
                                        choice=0,
                                        index=i,
                                        token_ids=[7],
                                        logprobs=None,
                                        finished=i == 29,
                                        finish_reason="stop",
                                        num_prompt_tokens=4,
                                        num_cached_tokens=0,
                                    )
                                ]
                            ),
                        )
                texts.append(chunk["choices"][0]["text"])
        assert "".join(texts) == Tokenizer.from_dir(tiny_dir).decode(expected)
        workers = cluster.kv_blocks_used()
        assert sorted(workers) == ["decode-1", "prefill-0"]
    finally:
        ctx.destroy(linger=0)
        log = cluster.stop()
    assert "fake" not in log
