"""kvtransfer over NIXL (pull, host memory here): the contract the other backends keep, plus
what only a one-sided transport needs: regions exchanged ahead of the first transfer, a read's
deadline, a sender's lease, a peer that goes away, and the injected faults."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest
import torch

from pdserve.kvtransfer import make_receiver, make_sender
from pdserve.kvtransfer.base import KVPoll, KVReceiver, KVSender, TransferError, TransferSpec
from pdserve.kvtransfer.faults import FaultPlan
from tests.gateway_util import wait_for
from tests.test_kvtransfer import assert_landed, cache, wait


class Pair:
    """A prefill-side sender and decode-side receivers, each with its own cache, introduced to
    each other as the coordinator does at registration (``update_peers``)."""

    def __init__(self) -> None:
        self.made: list[KVSender | KVReceiver] = []

    def sender(self, layers, **kw) -> KVSender:
        self.made.append(make_sender("nixl", kv_layers=layers, **kw))
        return self.made[-1]

    def receiver(self, layers, **kw) -> KVReceiver:
        self.made.append(make_receiver("nixl", layers, **kw))
        return self.made[-1]

    def introduce(self, a, b, a_id="a", b_id="b") -> None:
        a.update_peers([(b_id, b.regions)], [])
        b.update_peers([(a_id, a.regions)], [])

    def close(self) -> None:
        for obj in self.made:
            obj.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def spec(rid, src, dst, receiver, secret, **kw) -> TransferSpec:
    return TransferSpec(rid, src, dst, receiver.address, secret=secret, **kw)


@pytest.mark.parametrize(("dtype", "checksum"), [(torch.float32, False), (torch.bfloat16, True)])
def test_exact_bytes_in_listed_blocks_only(pair, dtype, checksum) -> None:
    src, dst = cache(1, dtype), cache(2, dtype)
    before = [t.clone() for t in dst]
    sender = pair.sender(src, checksum=checksum)
    receiver = pair.receiver(dst, require_checksum=checksum)
    assert receiver.address.startswith("nixl://pdserve-decode-")
    pair.introduce(sender, receiver)
    src_ids, dst_ids = [5, 0, 3], [2, 9, 4]
    secret = receiver.expect("r1", dst_ids, timeout_s=60)
    sender.send(spec("r1", src_ids, dst_ids, receiver, secret), src)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.DONE
    assert wait(lambda: sender.poll("r1")) is KVPoll.DONE  # the reader's acknowledgement
    assert_landed(dst, before, src, src_ids, dst_ids)
    receiver.release("r1")
    sender.release("r1")
    with pytest.raises(TransferError, match=r"unknown request id 'r1'"):
        receiver.poll("r1")


def test_concurrent_transfers_to_two_receivers(pair) -> None:
    src, dst_a, dst_b = cache(1), cache(2), cache(3)
    before_a, before_b = [t.clone() for t in dst_a], [t.clone() for t in dst_b]
    sender = pair.sender(src, checksum=True)
    a, b = pair.receiver(dst_a), pair.receiver(dst_b)
    pair.introduce(sender, a, "p", "a")
    pair.introduce(sender, b, "p", "b")
    jobs = [("r1", a, [0, 1], [7, 8]), ("r2", a, [2], [3]), ("r3", b, [9, 4, 6], [0, 5, 1])]
    secrets = {rid: r.expect(rid, dst_ids) for rid, r, _, dst_ids in jobs}
    for rid, receiver, src_ids, dst_ids in jobs:
        sender.send(spec(rid, src_ids, dst_ids, receiver, secrets[rid]), src)
    for rid, receiver, _, _ in jobs:
        assert wait(lambda r=receiver, i=rid: r.poll(i)) is KVPoll.DONE
        assert wait(lambda i=rid: sender.poll(i)) is KVPoll.DONE
    assert_landed(dst_a, before_a, src, [0, 1, 2], [7, 8, 3])
    assert_landed(dst_b, before_b, src, [9, 4, 6], [0, 5, 1])


def test_an_offer_before_the_regions_waits_for_them(pair) -> None:
    """A receiver that registered after the sender's offer left reads once it knows the
    sender; a sender holds an offer until it knows the reader."""
    src, dst = cache(1), cache(2)
    sender, receiver = pair.sender(src), pair.receiver(dst)
    secret = receiver.expect("r1", [1])
    sender.send(spec("r1", [0], [1], receiver, secret), src)
    time.sleep(0.2)
    assert sender.poll("r1") is KVPoll.PENDING  # it does not know the reader yet
    sender.update_peers([("b", receiver.regions)], [])
    assert wait_for(lambda: sender.poll("r1") is KVPoll.TRANSFERRING)
    assert receiver.poll("r1") is KVPoll.PENDING  # offered by an agent it has not loaded
    receiver.update_peers([("a", sender.regions)], [])
    assert wait(lambda: receiver.poll("r1")) is KVPoll.DONE
    assert torch.equal(dst[2][1], src[2][0])


def test_checksum_mismatch_fails(pair, monkeypatch) -> None:
    src, dst = cache(1), cache(2)
    sender, receiver = pair.sender(src, checksum=True), pair.receiver(dst)
    pair.introduce(sender, receiver)
    honest = sender._header
    monkeypatch.setattr(
        sender, "_header", lambda *a: dataclasses.replace(honest(*a), checksum=bytes(4))
    )
    secret = receiver.expect("r1", [2, 3])
    sender.send(spec("r1", [0, 1], [2, 3], receiver, secret), src)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert receiver.failure_reason("r1") == "checksum mismatch"


def test_missing_required_checksum_fails_and_ends_the_lease(pair) -> None:
    src = cache(1)
    sender, receiver = pair.sender(src), pair.receiver(cache(2), require_checksum=True)
    pair.introduce(sender, receiver)
    secret = receiver.expect("r1", [2])
    sender.send(spec("r1", [0], [2], receiver, secret, timeout_s=60), src)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert receiver.failure_reason("r1") == "no checksum sent, one is required"
    assert wait(lambda: sender.poll("r1"), 10) is KVPoll.FAILED  # told at once, not at 60 s
    assert sender.failure_reason("r1") == "reader: no checksum sent, one is required"


def test_timeout_fails_and_a_late_offer_is_dropped(pair) -> None:
    src, dst = cache(1), cache(2)
    before = [t.clone() for t in dst]
    sender, receiver = pair.sender(src), pair.receiver(dst)
    pair.introduce(sender, receiver)
    secret = receiver.expect("r1", [4], timeout_s=0.1)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert receiver.failure_reason("r1") == "timed out"
    sender.send(spec("r1", [0], [4], receiver, secret, timeout_s=0.5), src)
    assert wait(lambda: sender.poll("r1")) is KVPoll.FAILED  # nobody read it: the lease ends
    assert sender.failure_reason("r1") == "timed out"
    secret2 = receiver.expect("r2", [5])
    sender.send(spec("r2", [1], [5], receiver, secret2), src)
    assert wait(lambda: receiver.poll("r2")) is KVPoll.DONE
    assert torch.equal(dst[0][4], before[0][4]) and torch.equal(dst[0][5], src[0][1])


def test_other_destination_blocks_and_short_offers_fail(pair) -> None:
    src, dst = cache(1), cache(2)
    before = [t.clone() for t in dst]
    sender, receiver = pair.sender(src), pair.receiver(dst)
    pair.introduce(sender, receiver)
    secret = receiver.expect("r1", [1, 2])
    sender.send(spec("r1", [0, 1], [2, 1], receiver, secret), src)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert (
        receiver.failure_reason("r1") == "destination blocks [2, 1] differ from the expected ones"
    )
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))


def test_an_offer_without_its_secret_is_dropped(pair, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="pdserve.kvtransfer")
    src, dst, forged = cache(1), cache(2), cache(3)
    before = [t.clone() for t in dst]
    sender, receiver = pair.sender(src), pair.receiver(dst)
    attacker = pair.sender(forged)
    pair.introduce(sender, receiver)
    pair.introduce(attacker, receiver, "x", "b")
    secret = receiver.expect("r1", [4, 5])
    for i, wrong in enumerate([b"", bytes(16), secret[:-1] + bytes([secret[-1] ^ 1])]):
        attacker.send(spec("r1", [0, 1], [4, 5], receiver, wrong, timeout_s=0.3), forged)
        assert wait(lambda: attacker.poll("r1")) is KVPoll.FAILED  # nobody read it
        attacker.release("r1")
        assert wait_for(
            lambda n=i + 1: sum("without its secret" in r.getMessage() for r in caplog.records) == n
        )
    assert receiver.poll("r1") is KVPoll.PENDING
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))
    sender.send(spec("r1", [0, 1], [4, 5], receiver, secret), src)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.DONE
    assert_landed(dst, before, src, [0, 1], [4, 5])


def test_a_peer_with_another_layout_is_refused(pair, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="pdserve.kvtransfer")
    sender = pair.sender(cache(1, shape=(10, 2, 4, 2, 4)))
    receiver = pair.receiver(cache(2))
    receiver.update_peers([("a", sender.regions)], [])
    assert any(
        "not loading peer a" in r.getMessage() and "head_dim" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize(
    ("mode", "checksum", "reason"),
    [
        ("truncate", False, "2 source blocks offered for 3"),
        ("corrupt", True, "checksum mismatch"),
        ("drop", False, "timed out"),
        ("delay", False, "timed out"),
    ],
)
def test_injected_faults_fail_the_receiver(pair, mode, checksum, reason) -> None:
    src, dst = cache(1), cache(2)
    sender = pair.sender(src, checksum=checksum, fault=FaultPlan(mode, delay_s=5.0))
    receiver = pair.receiver(dst)
    pair.introduce(sender, receiver)
    secret = receiver.expect("r1", [1, 2, 3], timeout_s=1.0)
    sender.send(spec("r1", [4, 5, 6], [1, 2, 3], receiver, secret, timeout_s=2.0), src)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert receiver.failure_reason("r1") == reason
    assert wait(lambda: sender.poll("r1")).finished  # the sender's blocks come back too


def test_a_reader_that_goes_away_ends_the_lease(pair) -> None:
    """A decode worker killed before reading: the prefill worker's blocks come back at the
    lease's end, and forgetting the peer (it left the cluster) fails the offer at once."""
    src = cache(1)
    sender, receiver = pair.sender(src), pair.receiver(cache(2))
    pair.introduce(sender, receiver)
    receiver.close()
    sender.send(spec("r1", [0], [1], receiver, bytes(16), timeout_s=0.5), src)
    assert wait(lambda: sender.poll("r1")) is KVPoll.FAILED
    sender.update_peers([], ["b"])
    sender.send(spec("r2", [0], [1], receiver, bytes(16), timeout_s=0.5), src)
    assert wait(lambda: sender.poll("r2")) is KVPoll.FAILED


def test_bad_arguments_and_close(pair) -> None:
    src = cache(1)
    sender, receiver = pair.sender(src), pair.receiver(cache(2))
    with pytest.raises(ValueError, match=r"^r1: block ids \[10\] outside \[0, 10\)$"):
        receiver.expect("r1", [3, 10])
    with pytest.raises(ValueError, match=r"not the registered KV cache"):
        sender.send(spec("r1", [0], [3], receiver, b""), cache(1))
    with pytest.raises(TransferError, match=r"unknown request id 'nope'"):
        sender.poll("nope")
    sender.close()
    sender.close()
    with pytest.raises(TransferError, match=r"sender is closed"):
        sender.send(spec("r1", [0], [3], receiver, b""), src)
    receiver.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-nixl")]
