"""kvtransfer: exact bytes land in exactly the listed blocks, over every host backend; bad,
late, unexpected and corrupted transfers FAIL (or are dropped) without touching a block."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import pytest
import torch
import zmq

from pdserve.kvtransfer import backends, make_receiver, make_sender
from pdserve.kvtransfer.base import (
    KVLayout,
    KVPoll,
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    TransferError,
    TransferSpec,
    check_layouts,
)
from pdserve.kvtransfer.common import layout_of
from pdserve.runtime.sockets import free_port, ipc_address
from tests.gateway_util import wait_for

# the transfer secret each receiver returned from ``expect``, by request id
SECRETS: dict[str, bytes] = {}

BACKENDS = ["zmq"]  # nixl (pull, peers loaded from regions): tests/test_kvtransfer_nixl.py
SHAPE = (10, 2, 4, 2, 8)  # [num_blocks, 2, block_size, num_kv_heads, head_dim]


def cache(seed: int, dtype: torch.dtype = torch.float32, shape=SHAPE, layers: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(layers)]


def wait(poll: Callable[[], KVPoll], timeout_s: float = 60.0) -> KVPoll:
    deadline = time.monotonic() + timeout_s
    while not (state := poll()).finished and time.monotonic() < deadline:
        time.sleep(0.002)
    return state


@pytest.fixture
def make(request: pytest.FixtureRequest):
    """make.receiver(layers, **kw) / make.sender(**kw) for the test's backend; all closed after."""
    backend = request.node.callspec.params["backend"]
    made: list[KVSender | KVReceiver] = []

    class Make:
        def receiver(self, layers, **kw) -> KVReceiver:
            made.append(make_receiver(backend, layers, **kw))
            return made[-1]

        def sender(self, **kw) -> KVSender:
            made.append(make_sender(backend, **kw))
            return made[-1]

    yield Make()
    for obj in made:
        obj.close()


def assert_landed(dst, before, src, src_ids, dst_ids) -> None:
    untouched = [b for b in range(dst[0].shape[0]) if b not in dst_ids]
    for layer in range(len(dst)):
        assert torch.equal(dst[layer][dst_ids], src[layer][src_ids])
        assert torch.equal(dst[layer][untouched], before[layer][untouched])


# ---- happy paths -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "checksum"), [(torch.float32, False), (torch.bfloat16, True)])
def test_exact_bytes_in_listed_blocks_only(make, backend, dtype, checksum) -> None:
    src, dst = cache(1, dtype), cache(2, dtype)
    before = [t.clone() for t in dst]
    receiver = make.receiver(dst, require_checksum=checksum)
    sender = make.sender(checksum=checksum)
    src_ids, dst_ids = [5, 0, 3], [2, 9, 4]
    SECRETS["r1"] = receiver.expect("r1", dst_ids, timeout_s=60)
    assert receiver.poll("r1") is KVPoll.PENDING
    sender.send(
        TransferSpec("r1", src_ids, dst_ids, receiver.address, secret=SECRETS.get("r1", b"")), src
    )
    assert wait(lambda: receiver.poll("r1")) is KVPoll.DONE
    assert wait(lambda: sender.poll("r1")) is KVPoll.DONE
    assert receiver.failure_reason("r1") is None
    assert_landed(dst, before, src, src_ids, dst_ids)
    receiver.release("r1")
    sender.release("r1")
    with pytest.raises(TransferError, match=r"unknown request id 'r1'"):
        receiver.poll("r1")


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_transfers_to_two_receivers(make, backend) -> None:
    src, dst_a, dst_b = cache(1), cache(2), cache(3)
    before_a, before_b = [t.clone() for t in dst_a], [t.clone() for t in dst_b]
    a, b = make.receiver(dst_a), make.receiver(dst_b)
    sender = make.sender(checksum=True)
    jobs = [("r1", a, [0, 1], [7, 8]), ("r2", a, [2], [3]), ("r3", b, [9, 4, 6], [0, 5, 1])]
    for rid, receiver, _, dst_ids in jobs:
        SECRETS[rid] = receiver.expect(rid, dst_ids)
    for rid, receiver, src_ids, dst_ids in jobs:
        sender.send(
            TransferSpec(rid, src_ids, dst_ids, receiver.address, secret=SECRETS.get(rid, b"")), src
        )
    for rid, receiver, _, _ in jobs:
        assert wait(lambda r=receiver, i=rid: r.poll(i)) is KVPoll.DONE
        assert wait(lambda i=rid: sender.poll(i)) is KVPoll.DONE
    assert_landed(dst_a, before_a, src, [0, 1, 2], [7, 8, 3])
    assert_landed(dst_b, before_b, src, [9, 4, 6], [0, 5, 1])


def test_zmq_over_ipc(tmp_path) -> None:
    src, dst = cache(1), cache(2)
    receiver = make_receiver("zmq", dst, ipc_address(tmp_path, "kv-d0"))
    sender = make_sender("zmq")
    try:
        assert receiver.address == f"ipc://{tmp_path}/kv-d0.sock"
        SECRETS["r1"] = receiver.expect("r1", [1])
        sender.send(
            TransferSpec("r1", [4], [1], receiver.address, secret=SECRETS.get("r1", b"")), src
        )
        assert wait(lambda: receiver.poll("r1")) is KVPoll.DONE
        assert torch.equal(dst[2][1], src[2][4])
    finally:
        sender.close()
        receiver.close()


# ---- failures --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_checksum_mismatch_fails_and_writes_nothing(make, backend, monkeypatch) -> None:
    src, dst = cache(1), cache(2)
    before = [t.clone() for t in dst]
    receiver = make.receiver(dst)
    sender = make.sender(checksum=True)
    honest = sender._header
    monkeypatch.setattr(
        sender, "_header", lambda *a: dataclasses.replace(honest(*a), checksum=bytes(16))
    )
    SECRETS["r1"] = receiver.expect("r1", [2, 3])
    sender.send(
        TransferSpec("r1", [0, 1], [2, 3], receiver.address, secret=SECRETS.get("r1", b"")), src
    )
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert receiver.failure_reason("r1") == "checksum mismatch"
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_required_checksum_fails(make, backend) -> None:
    receiver = make.receiver(cache(2), require_checksum=True)
    sender = make.sender(checksum=False)
    SECRETS["r1"] = receiver.expect("r1", [2])
    sender.send(
        TransferSpec("r1", [0], [2], receiver.address, secret=SECRETS.get("r1", b"")), cache(1)
    )
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert receiver.failure_reason("r1") == "no checksum sent, one is required"


@pytest.mark.parametrize("backend", BACKENDS)
def test_timeout_fails_and_a_late_transfer_is_dropped(make, backend) -> None:
    src, dst = cache(1), cache(2)
    before = [t.clone() for t in dst]
    receiver = make.receiver(dst)
    SECRETS["r1"] = receiver.expect("r1", [4], timeout_s=0.1)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert receiver.failure_reason("r1") == "timed out"
    sender = make.sender()
    sender.send(TransferSpec("r1", [0], [4], receiver.address, secret=SECRETS.get("r1", b"")), src)
    SECRETS["r2"] = receiver.expect(
        "r2", [5]
    )  # the receiver keeps working after dropping the late one
    sender.send(TransferSpec("r2", [1], [5], receiver.address, secret=SECRETS.get("r2", b"")), src)
    assert wait(lambda: receiver.poll("r2")) is KVPoll.DONE
    assert receiver.poll("r1") is KVPoll.FAILED
    assert torch.equal(dst[0][4], before[0][4]) and torch.equal(dst[0][5], src[0][1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_fails_when_nobody_receives(make, backend) -> None:
    sender = make.sender()
    address = f"tcp://127.0.0.1:{free_port()}"
    sender.send(
        TransferSpec("r1", [0], [0], address, timeout_s=0.3, secret=SECRETS.get("r1", b"")),
        cache(1),
    )
    assert wait(lambda: sender.poll("r1")) is KVPoll.FAILED
    assert sender.failure_reason("r1") == "timed out"  # zmq keeps trying until the deadline


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("release_first", [False, True])
def test_unexpected_or_released_transfer_is_dropped(make, backend, release_first) -> None:
    src, dst = cache(1), cache(2)
    before = [t.clone() for t in dst]
    receiver = make.receiver(dst)
    sender = make.sender()
    if release_first:
        SECRETS["r1"] = receiver.expect("r1", [6])
        receiver.release("r1")
    sender.send(TransferSpec("r1", [0], [6], receiver.address, secret=SECRETS.get("r1", b"")), src)
    assert wait(lambda: sender.poll("r1")) is KVPoll.DONE  # sent, though nobody wanted it
    SECRETS["r2"] = receiver.expect("r2", [7])
    sender.send(TransferSpec("r2", [1], [7], receiver.address, secret=SECRETS.get("r2", b"")), src)
    assert wait(lambda: receiver.poll("r2")) is KVPoll.DONE
    with pytest.raises(TransferError, match="unknown request id 'r1'"):
        receiver.poll("r1")
    assert torch.equal(dst[1][6], before[1][6]) and torch.equal(dst[1][7], src[1][1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("src_kw", "reason"),
    [
        ({"shape": (10, 2, 4, 2, 4)}, "block shape [2, 4, 2, 4] sent, the cache has [2, 4, 2, 8]"),
        ({"dtype": torch.bfloat16}, "dtype 'bfloat16' sent, the cache holds 'float32'"),
        ({"layers": 2}, "2 layers sent, the cache has 3"),
    ],
)
def test_layout_mismatch_on_the_wire_fails(make, backend, src_kw, reason) -> None:
    dst = cache(2)
    receiver = make.receiver(dst)
    sender = make.sender()
    SECRETS["r1"] = receiver.expect("r1", [1])
    sender.send(
        TransferSpec("r1", [0], [1], receiver.address, secret=SECRETS.get("r1", b"")),
        cache(1, **src_kw),
    )
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert receiver.failure_reason("r1") == reason
    SECRETS["r2"] = receiver.expect(
        "r2", [3]
    )  # what was drained does not confuse the next transfer
    sender.send(
        TransferSpec("r2", [0], [3], receiver.address, secret=SECRETS.get("r2", b"")), cache(5)
    )
    assert wait(lambda: receiver.poll("r2")) is KVPoll.DONE
    assert torch.equal(dst[0][3], cache(5)[0][0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_destination_blocks_fail(make, backend) -> None:
    dst = cache(2)
    before = [t.clone() for t in dst]
    receiver = make.receiver(dst)
    sender = make.sender()
    SECRETS["r1"] = receiver.expect("r1", [1, 2])
    sender.send(
        TransferSpec("r1", [0, 1], [2, 1], receiver.address, secret=SECRETS.get("r1", b"")),
        cache(1),
    )
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert (
        receiver.failure_reason("r1") == "destination blocks [2, 1] differ from the expected ones"
    )
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))


@pytest.mark.parametrize("backend", ["zmq"])
def test_garbage_frames_do_not_kill_the_receiver(make, backend) -> None:
    src, dst = cache(1), cache(2)
    receiver = make.receiver(dst)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(receiver.address)
    push.send_multipart([b"\xc1", b"junk"])
    push.send_multipart([b"\x80"])
    push.close(linger=1000)
    ctx.term()
    sender = make.sender()
    SECRETS["r1"] = receiver.expect("r1", [1])
    sender.send(TransferSpec("r1", [0], [1], receiver.address, secret=SECRETS.get("r1", b"")), src)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.DONE


# ---- API edges -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_and_close(make, backend) -> None:
    # threads of this test's own (another module's, still alive in this worker process, are
    # not this test's to judge: a fresh-clone run once found two there)
    before = {t for t in threading.enumerate() if t.name.startswith("kv-")}
    receiver = make.receiver(cache(2))
    sender = make.sender()
    with pytest.raises(ValueError, match=r"^r1: block ids \[10\] outside \[0, 10\)$"):
        SECRETS["r1"] = receiver.expect("r1", [3, 10])
    with pytest.raises(ValueError, match=r"^r1: repeated block ids$"):
        SECRETS["r1"] = receiver.expect("r1", [3, 3])
    SECRETS["r1"] = receiver.expect("r1", [3])
    with pytest.raises(ValueError, match=r"request id 'r1' is already in use"):
        SECRETS["r1"] = receiver.expect("r1", [4])
    with pytest.raises(TransferError, match=r"unknown request id 'nope'"):
        sender.poll("nope")
    receiver.release("never-seen")  # a no-op
    sender.close()
    sender.close()
    with pytest.raises(TransferError, match=r"sender is closed"):
        sender.send(
            TransferSpec("r1", [0], [3], receiver.address, secret=SECRETS.get("r1", b"")), cache(1)
        )
    receiver.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-") and t not in before]


def test_transfer_spec_and_factory_errors() -> None:
    with pytest.raises(ValueError, match=r"^transfer 'r1': 2 source blocks but 1 destination"):
        TransferSpec("r1", [0, 1], [2], "tcp://x:1", secret=SECRETS.get("r1", b""))
    with pytest.raises(ValueError, match=r"^transfer 'r1': no blocks to send$"):
        TransferSpec("r1", [], [], "tcp://x:1", secret=SECRETS.get("r1", b""))
    with pytest.raises(ValueError) as info:
        make_sender("rdma")
    assert str(info.value) == (
        "unknown KV transfer backend 'rdma'; available: host, nccl, nixl, zmq"
    )
    assert backends() == ["host", "nccl", "nixl", "zmq"]
    with make_sender("host") as sender:
        assert type(sender).__name__ == "ZmqKVSender"


def test_layouts() -> None:
    layers = cache(1, torch.bfloat16)
    assert layout_of(layers) == KVLayout(
        block_size=4, dtype="bfloat16", num_layers=3, num_kv_heads=2, head_dim=8
    )
    with pytest.raises(ValueError, match=r"KV layer 1 is \[10, 2, 4, 2, 8\] torch.float32"):
        layout_of([layers[0], layers[1].float()])
    a = KVLayout(block_size=16, dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=64)
    check_layouts(a, a)
    with pytest.raises(LayoutMismatchError) as info:
        check_layouts(
            a,
            KVLayout(block_size=32, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=64),
            names=("prefill p0", "decode d0"),
        )
    assert str(info.value) == (
        "KV layouts of prefill p0 and decode d0 differ: block_size prefill p0=16 decode d0=32, "
        "dtype prefill p0='bfloat16' decode d0='float32'"
    )
    # blocks computed by other weights hold other values: a float worker never pairs with int4
    with pytest.raises(LayoutMismatchError, match="weights prefill p0='none' decode d0='int4-g32'"):
        check_layouts(
            dataclasses.replace(a, weights="none"),
            dataclasses.replace(a, weights="int4-g32"),
            names=("prefill p0", "decode d0"),
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_transfer_without_its_secret_is_dropped(make, backend, caplog) -> None:
    """Only the sender handed the reservation's secret may write its blocks: a forged one (no
    secret, a wrong one) changes nothing and leaves the reservation for the real one."""
    caplog.set_level(logging.WARNING, logger="pdserve.kvtransfer")
    src, dst, forged = cache(1), cache(2), cache(3)
    before = [t.clone() for t in dst]
    receiver = make.receiver(dst)
    sender = make.sender()
    secret = receiver.expect("r1", [4, 5])
    assert len(secret) == 16 and receiver.expect("r2", [6]) != secret
    for wrong in [b"", bytes(16), secret[:-1] + bytes([secret[-1] ^ 1])]:
        attacker = make.sender()
        attacker.send(TransferSpec("r1", [0, 1], [4, 5], receiver.address, secret=wrong), forged)
        assert wait(lambda a=attacker: a.poll("r1")) is KVPoll.DONE  # handed to the transport

    def turned_away() -> int:
        return sum("without its secret" in r.getMessage() for r in caplog.records)

    assert wait_for(lambda: turned_away() == 3)  # the receiver has judged every forged one
    assert receiver.poll("r1") is KVPoll.PENDING
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))
    sender.send(TransferSpec("r1", [0, 1], [4, 5], receiver.address, secret=secret), src)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.DONE
    assert_landed(dst, before, src, [0, 1], [4, 5])
