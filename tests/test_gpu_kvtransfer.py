"""The nccl backend's control protocol on CPU: its wire messages, the device checksum, and the
sender/receiver machinery around NCCL (handshake, grants, layer and checksum checks, faults)
driven end to end over real ZMQ by a loopback backend whose only stand-in is the transfer
itself (a CPU index copy instead of NCCL's sends and recvs)."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
import zmq

from pdserve.kvtransfer import common
from pdserve.kvtransfer import gpu_wire as w
from pdserve.kvtransfer.base import KVPoll, TransferError, TransferSpec
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.kvtransfer.gpu_receiver import GpuKVReceiver
from pdserve.kvtransfer.gpu_sender import Flight, GpuKVSender, Job, Peer, round_trip, sender_hello
from pdserve.protocol.checks import ProtocolError
from pdserve.protocol.control import KVLayout
from tests.gateway_util import wait_for

# the transfer secret each receiver returned from ``expect``, by request id
SECRETS: dict[str, bytes] = {}

SHAPE = (8, 2, 4, 2, 8)  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
LAYOUT = KVLayout(block_size=4, dtype="bfloat16", num_layers=3, num_kv_heads=2, head_dim=8)


def cache(seed: int, layers: int = 3, shape=SHAPE) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]


# ---- wire ----------------------------------------------------------------------------------------

MESSAGES = [
    w.Hello("nccl", LAYOUT, 42, "GPU-1234"),
    w.NcclUniqueId("s1", list(range(-64, 64))),
    w.Refused("no"),
    w.Begin("r1", [3, 1, 4]),
    w.BeginReply("r1", "s1", False, "not expected"),
    w.Done("r1", 3, b"\x00" * 16),
    w.Done("r1", 2, None),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_wire_round_trip(msg) -> None:
    assert w.decode(w.encode(msg)) == msg


def test_wire_rejects_malformed() -> None:
    good = msgpack.unpackb(w.encode(w.Begin("r1", [1])))
    cases = {
        b"\xc1": "not valid msgpack",
        msgpack.packb([1, 2]): "a GPU control message is a map, got list",
        msgpack.packb({**good, "type": "register"}): "unknown GPU control message type",
        msgpack.packb({**good, "type": [1]}): "unknown GPU control message type",
        msgpack.packb({**good, "v": 2}): "Begin: wire version is not 1",
        msgpack.packb({**good, "v": True}): "Begin: wire version is not 1",
        msgpack.packb({k: v for k, v in good.items() if k != "dst_block_ids"}): "missing field",
        msgpack.packb({**good, "extra": 1}): "unexpected field 'extra'",
        msgpack.packb({**good, "dst_block_ids": ["1"]}): r"dst_block_ids[0]: expected int",
    }
    for frame, message in cases.items():
        with pytest.raises(ProtocolError) as info:
            w.decode(frame)
        assert message in str(info.value)
    with pytest.raises(ProtocolError, match=r"Begin\.dst_block_ids\[0\]: expected int"):
        w.encode(w.Begin("r1", ["x"]))  # type: ignore[list-item]


def test_device_checksum() -> None:
    digest = w.DeviceChecksum()
    a = cache(0)
    b = [t.clone() for t in a]
    for t in b:  # blocks 1, 3 of a are blocks 6, 2 of b
        t[[6, 2]] = t[[1, 3]]
    assert digest(a, [1, 3]) == digest(b, [6, 2])
    assert len(digest(a, [1, 3])) == 16
    assert digest(a, [1, 3]) != digest(a, [3, 1])  # order matters
    assert digest(a, [1, 3]) != digest(a[::-1], [1, 3])  # so do layers
    b[2][2].view(-1)[5] += 1
    assert digest(a, [1, 3]) != digest(b, [6, 2])
    f32 = [t.float() for t in a]
    assert digest(f32, [0, 1]) != digest(f32, [1, 0])


# ---- the shared machinery, over a loopback backend -------------------------------------------


class _Finished:
    def query(self) -> bool:
        return True


class LoopReceiver(GpuKVReceiver):
    backend = "loop"
    status = staticmethod(lambda: (True, "test"))

    def _check_layers(self, kv_layers):
        return common.check_host_layers(kv_layers)

    def _side_stream(self):
        return None

    def _on_hello(self, identity, hello):
        return w.NcclUniqueId(self.session, [])


def copy_blocks(src_layers, dst_layers, src_ids, dst_ids) -> None:
    """dst[l][dst_ids] = src[l][src_ids] for every layer given (what NCCL's transfer lands)."""
    for src, dst in zip(src_layers, dst_layers, strict=False):
        dst[dst_ids] = src[src_ids]


class LoopSender(GpuKVSender):
    """Copies straight into the receiver's tensors, where NCCL would send them."""

    backend = "loop"
    status = staticmethod(lambda: (True, "test"))

    def __init__(self, targets: dict[str, list[torch.Tensor]], **kw) -> None:
        self.targets = targets
        self.hellos = 0
        super().__init__(**kw)

    def _check_layers(self, kv_layers):
        return common.check_host_layers(kv_layers)

    def _ready_event(self, device):
        return _Finished()

    def _connect(self, address: str, job: Job, deadline: float) -> Peer:
        self.hellos += 1
        sock = self._dealer(address)
        reply = round_trip(sock, sender_hello(self.backend, job), w.NcclUniqueId, deadline)
        return Peer(address, sock, reply.session, data=self.targets[address])

    def _launch(self, peer: Peer, job: Job) -> Flight:
        digest = self._source_digest(job)
        count = len(job.layers) - (job.fault == "truncate")
        dst_ids = job.spec.dst_block_ids
        copy_blocks(job.layers[:count], peer.data, job.spec.src_block_ids, dst_ids)
        if job.fault == "corrupt":
            peer.data[0][dst_ids[0]].view(-1).view(torch.uint8)[:1].bitwise_xor_(0xFF)
        return Flight(peer, _Finished(), count, digest)


def wait(poll, timeout_s: float = 60.0) -> KVPoll:
    """Poll until the transfer finished (or a deadline that only catches a hang passed)."""
    deadline = time.monotonic() + timeout_s
    while not (state := poll()).finished and time.monotonic() < deadline:
        time.sleep(0.002)
    return state


@pytest.fixture
def pair(request):
    """(receiver, its layers, sender, source layers); options via indirect params."""
    opts = getattr(request, "param", {})
    dst = cache(1)
    receiver = LoopReceiver(dst, require_checksum=opts.get("require_checksum", True))
    sender = LoopSender(
        {receiver.address: dst}, checksum=opts.get("checksum", True), fault=opts.get("fault")
    )
    yield receiver, dst, sender, cache(2)
    sender.close()
    receiver.close()


def transfer(pair, rid="r1", src_ids=(1, 4), dst_ids=(6, 0), expect=True, timeout_s=60.0):
    receiver, dst, sender, src = pair
    before = [t.clone() for t in dst]
    if expect:
        SECRETS[rid] = receiver.expect(rid, list(dst_ids), timeout_s)
    sender.send(
        TransferSpec(
            rid, list(src_ids), list(dst_ids), receiver.address, 60.0, secret=SECRETS.get(rid, b"")
        ),
        src,
    )
    sent = wait(lambda: sender.poll(rid))
    got = wait(lambda: receiver.poll(rid)) if expect else None
    return sent, got, before


def test_blocks_land_exactly(pair) -> None:
    _, dst, sender, src = pair
    sent, got, before = transfer(pair)
    assert (sent, got) == (KVPoll.DONE, KVPoll.DONE)
    untouched = [b for b in range(SHAPE[0]) if b not in (6, 0)]
    for s, d, b in zip(src, dst, before, strict=True):
        assert torch.equal(d[[6, 0]], s[[1, 4]])
        assert torch.equal(d[untouched], b[untouched])
    assert transfer(pair, "r2", (2,), (3,))[:2] == (KVPoll.DONE, KVPoll.DONE)
    assert sender.hellos == 1  # one handshake per receiver


def test_grants_only_what_was_reserved(pair) -> None:
    receiver, dst, sender, _ = pair
    sent, _, before = transfer(pair, "r1", expect=False)
    assert sent is KVPoll.FAILED
    assert sender.failure_reason("r1") == (
        f"{receiver.address}: receiver declined: request 'r1' not expected"
    )
    SECRETS["r2"] = receiver.expect("r2", [5, 7])
    transfer(pair, "r2", (1, 4), (5, 6), expect=False)
    assert sender.failure_reason("r2").endswith("destination blocks differ from the reserved ones")
    assert receiver.poll("r2") is KVPoll.PENDING
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))


@pytest.mark.parametrize(
    ("pair", "reason"),
    [
        ({"fault": FaultPlan("corrupt")}, "checksum mismatch"),
        ({"fault": FaultPlan("truncate")}, "2 of 3 layers written"),
        ({"checksum": False}, "no checksum sent, one is required"),
    ],
    indirect=["pair"],
)
def test_receiver_checks_what_landed(pair, reason) -> None:
    receiver = pair[0]
    sent, got, _ = transfer(pair)
    assert (sent, got) == (KVPoll.DONE, KVPoll.FAILED)
    assert receiver.failure_reason("r1") == reason


@pytest.mark.parametrize("pair", [{"fault": FaultPlan("drop")}], indirect=True)
def test_dropped_transfer_times_out(pair) -> None:
    receiver, dst, _, _ = pair
    sent, got, before = transfer(pair, timeout_s=0.3)
    assert (sent, got) == (KVPoll.DONE, KVPoll.FAILED)
    assert receiver.failure_reason("r1") == "timed out"
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))


def test_handshake_refusals_and_garbage(pair) -> None:
    receiver = pair[0]
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as raw:
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(receiver.address)
        raw.send(b"\xc1garbage")  # dropped, the receiver lives on
        deadline = time.monotonic() + 60
        other = KVLayout(block_size=16, dtype="bfloat16", num_layers=3, num_kv_heads=2, head_dim=8)
        refused = r"receiver refused: KV layouts of sender and receiver differ: block_size "
        with pytest.raises(TransferError, match=refused + r"sender=16 receiver=4$"):
            round_trip(raw, w.Hello("loop", other, 1, ""), w.NcclUniqueId, deadline)
        with pytest.raises(TransferError, match=r"refused: this receiver speaks loop, not nccl$"):
            round_trip(raw, w.Hello("nccl", LAYOUT, 1, ""), w.NcclUniqueId, deadline)
    assert transfer(pair)[:2] == (KVPoll.DONE, KVPoll.DONE)


def test_restarted_receiver_is_handshaken_again(pair) -> None:
    receiver, _, sender, _ = pair
    assert transfer(pair, "r1")[:2] == (KVPoll.DONE, KVPoll.DONE)
    receiver.session = "restarted"
    sent, _, _ = transfer(pair, "r2", expect=False)
    assert sent is KVPoll.FAILED
    assert sender.failure_reason("r2").endswith("the receiver restarted; its communicator is stale")
    assert transfer(pair, "r3")[:2] == (KVPoll.DONE, KVPoll.DONE)
    assert sender.hellos == 2


class StagingReceiver(LoopReceiver):
    """Like nccl: a granted transfer lands in staging, scattered into the blocks by ``finish``."""

    def __init__(self, *args, **kw) -> None:
        self.scattered: list[str] = []
        super().__init__(*args, **kw)

    def _on_begin(self, identity, begin, incoming):
        incoming.finish = lambda: self.scattered.append(begin.request_id)
        return None


def test_a_released_grant_is_never_scattered() -> None:
    receiver = StagingReceiver(cache(1))
    ctx = zmq.Context.instance()
    try:
        with ctx.socket(zmq.DEALER) as raw:
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(receiver.address)
            deadline = time.monotonic() + 60
            round_trip(raw, w.Hello("loop", LAYOUT, 1, ""), w.NcclUniqueId, deadline)
            for rid, blocks in (("r1", [2, 3]), ("r2", [4])):
                begin = w.Begin(rid, blocks, receiver.expect(rid, blocks, 60.0))
                reply = round_trip(raw, begin, w.BeginReply, deadline, key=rid)
                assert reply.ok and receiver.poll(rid) is KVPoll.TRANSFERRING
            receiver.release("r1")  # granted, its bytes on the way: they must land nowhere
            raw.send(w.encode(w.Done("r1", 3, None)))
            raw.send(w.encode(w.Done("r2", 3, None)))
            assert wait(lambda: receiver.poll("r2")) is KVPoll.DONE
        assert receiver.scattered == ["r2"]
        with pytest.raises(TransferError, match=r"unknown request id 'r1'"):
            receiver.poll("r1")
        # nothing is kept for the released transfer (once the receiver thread has seen it go)
        assert wait_for(lambda: receiver._incoming == {}), receiver._incoming
    finally:
        receiver.close()
