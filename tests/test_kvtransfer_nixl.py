"""kvtransfer over NIXL (pull, host memory here): the contract the other backends keep, plus
what only a one-sided transport needs: regions exchanged ahead of the first transfer, a read's
deadline, a sender's lease, a peer that goes away, and the injected faults. Then a transfer in
parts (``--kv-stream-chunks``): read in order as they come, whole after the last, a bad or
faulty part failing it, and, through an in-process cluster, the decode worker's policy taking
over with every block freed on both sides."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.scheduler import ScheduledBatch
from pdserve.kvtransfer import make_receiver, make_sender
from pdserve.kvtransfer.base import KVPoll, KVReceiver, KVSender, TransferError, TransferSpec
from pdserve.kvtransfer.faults import FaultDice, FaultPlan
from pdserve.launch.serve import add_serve_args, run_serve, worker_commands
from pdserve.prefill.main import add_prefill_args, run_prefill
from pdserve.prefill.worker import PrefillWorker
from pdserve.protocol.sampling import SamplingParams
from tests.cluster_util import Bus, Cluster
from tests.engine_util import hf_greedy, make_engine, prompts
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


# ---- a transfer in parts (the prefill worker's --kv-stream-chunks) ----------------------------


def landed(dst, src, src_ids, dst_ids) -> bool:
    return all(torch.equal(d[dst_ids], s[src_ids]) for d, s in zip(dst, src, strict=True))


def fault_on_part(sender, mode: str, part: int) -> None:
    """The sender injects ``mode`` into offer ``part`` of every transfer, and only there."""
    dice = FaultDice(FaultPlan(mode, delay_s=5.0))
    sender._dice = SimpleNamespace(mark=lambda job: job.header.part == part and dice.mark(job))


def test_parts_are_read_as_they_come_and_done_after_the_last(pair) -> None:
    src, dst = cache(1), cache(2)
    before = [t.clone() for t in dst]
    sender, receiver = pair.sender(src, checksum=True), pair.receiver(dst, require_checksum=True)
    pair.introduce(sender, receiver)
    dst_ids = [2, 9, 4, 0, 7]
    secret = receiver.expect("r1", dst_ids)
    at = 0
    for src_ids, last in [([5, 0], False), ([3], False), ([8, 1], True)]:
        ids = dst_ids[at : at + len(src_ids)]
        at += len(src_ids)
        sender.send_part(spec("r1", src_ids, ids, receiver, secret), src, last)
        if not last:  # read at once; the transfer stays open on both sides
            assert wait_for(lambda s=src_ids, d=ids: landed(dst, src, s, d))
            assert (receiver.poll("r1"), sender.poll("r1")) == (KVPoll.TRANSFERRING,) * 2
    assert wait(lambda: receiver.poll("r1")) is KVPoll.DONE
    assert wait(lambda: sender.poll("r1")) is KVPoll.DONE  # every part acknowledged
    assert_landed(dst, before, src, [5, 0, 3, 8, 1], dst_ids)


@pytest.mark.parametrize(
    ("second", "reason"),
    [
        ((2, [4], [2], False), "offer 2 came where 1 was due"),
        ((1, [4], [3], False), "destination blocks [3] differ from the expected ones"),
        ((1, [4], [2], True), "the last offer ends at block 2 of 3"),
        ((1, [4, 5], [2, 3], False), "offer 1 leaves no blocks for the last one"),
    ],
    ids=["out-of-order", "not-the-next-blocks", "last-too-soon", "nothing-left"],
)
def test_a_part_that_does_not_follow_fails_the_transfer(pair, monkeypatch, second, reason) -> None:
    src, dst = cache(1), cache(2)
    before = [t.clone() for t in dst]
    sender, receiver = pair.sender(src), pair.receiver(dst)
    pair.introduce(sender, receiver)
    part, src_ids, dst_ids, last = second
    honest = sender._header
    monkeypatch.setattr(sender, "_header", lambda s, kv, p, la: honest(s, kv, p and part, la))
    secret = receiver.expect("r1", [1, 2, 3])
    sender.send_part(spec("r1", [0], [1], receiver, secret), src, last=False)
    sender.send_part(spec("r1", src_ids, dst_ids, receiver, secret, timeout_s=60), src, last)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert receiver.failure_reason("r1") == reason
    assert wait(lambda: sender.poll("r1"), 10) is KVPoll.FAILED  # told at once
    assert sender.failure_reason("r1") == f"reader: {reason}"
    if not last:  # one more part of a transfer that failed: not sent
        sender.send_part(spec("r1", [6], [3], receiver, secret), src, last=True)
        assert sender.poll("r1") is KVPoll.FAILED
    assert all(torch.equal(d[2:], b[2:]) for d, b in zip(dst, before, strict=True))
    with pytest.raises(ValueError, match=r"^transfer 'r2': a part for another receiver$"):
        sender.send_part(spec("r2", [0], [1], receiver, b"x"), src, last=False)
        sender.send_part(spec("r2", [1], [2], receiver, b"y"), src, last=True)


@pytest.mark.parametrize(
    ("mode", "checksum", "reason"),
    [
        ("truncate", False, "1 source blocks offered for 2"),
        ("corrupt", True, "checksum mismatch"),
        ("drop", False, "timed out"),
        ("delay", False, "timed out"),
    ],
)
def test_a_fault_in_a_middle_part_fails_the_transfer(pair, mode, checksum, reason) -> None:
    src, dst = cache(1), cache(2)
    sender, receiver = pair.sender(src, checksum=checksum), pair.receiver(dst)
    pair.introduce(sender, receiver)
    fault_on_part(sender, mode, 1)
    secret = receiver.expect("r1", [1, 2, 3, 4, 5], timeout_s=1.0)
    for src_ids, dst_ids, last in [
        ([6], [1], False),
        ([7, 8], [2, 3], False),
        ([9, 0], [4, 5], True),
    ]:
        sender.send_part(spec("r1", src_ids, dst_ids, receiver, secret, timeout_s=2.0), src, last)
    assert wait(lambda: receiver.poll("r1")) is KVPoll.FAILED
    assert receiver.failure_reason("r1") == reason
    assert wait(lambda: sender.poll("r1")).finished  # the sender's blocks come back too


def test_a_side_that_goes_away_mid_stream_ends_the_transfer(pair) -> None:
    """The reader gone after part 0: the sender's lease ends (it runs from the latest part).
    The sender gone after part 0: the reader's deadline ends it, no read left running."""
    src = cache(1)
    sender, receiver = pair.sender(src), pair.receiver(cache(2))
    pair.introduce(sender, receiver)
    secret = receiver.expect("r1", [1, 2])
    sender.send_part(spec("r1", [0], [1], receiver, secret, timeout_s=0.5), src, last=False)
    assert wait_for(lambda: receiver.poll("r1") is KVPoll.TRANSFERRING)
    receiver.close()
    time.sleep(0.3)
    sender.send_part(spec("r1", [3], [2], receiver, secret, timeout_s=0.5), src, last=True)
    assert wait(lambda: sender.poll("r1")) is KVPoll.FAILED  # the lease ended
    src3 = cache(3)
    other = pair.sender(src3)
    reader = pair.receiver(cache(4))
    pair.introduce(other, reader)
    secret = reader.expect("r2", [1, 2], timeout_s=1.0)
    other.send_part(spec("r2", [0], [1], reader, secret), src3, last=False)
    assert wait_for(lambda: reader.poll("r2") is KVPoll.TRANSFERRING)
    other.close()
    assert wait(lambda: reader.poll("r2")) is KVPoll.FAILED
    assert reader.failure_reason("r2") == "timed out"


def test_offered_blocks_stay_pinned_when_the_prompt_is_preempted(tiny_dir) -> None:
    engine = make_engine(tiny_dir, max_num_batched_tokens=8)  # blocks of 4 tokens
    engine.add_request("r", list(range(1, 31)), GREEDY1, hold_kv=True)
    engine.step()
    offered = engine.handoff.computed_blocks("r")  # the first chunk's 8 tokens
    assert offered == engine.requests.live["r"].block_table[:2]
    engine.handoff.pin("r", offered)
    seq = engine.requests.live["r"]
    engine.scheduler.running.remove(seq)  # preempted, as when blocks run out
    engine.scheduler._preempt(seq, ScheduledBatch())
    assert engine.handoff.computed_blocks("r") == []
    blocks = engine.block_manager
    assert [blocks.ref_counts[b] for b in offered] == [1, 1]  # still held for the read
    assert not set(offered) & set(blocks.free)
    while engine.has_unfinished():
        engine.step()
    assert engine.handoff.release("r")
    assert blocks.num_used_blocks == 0


# ---- in parts through a cluster: coordinator, prefill and decode workers in one process -------

GREEDY1 = SamplingParams(max_tokens=1, temperature=0.0)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SENDER = "KV transfer failed: reader: "  # a prefill worker's TransferDone.error, the reader's


def streaming_cluster(tiny_dir, **kw) -> tuple[Cluster, list[tuple[str, list[int], bool]]]:
    """1P1D over nixl, the prefill worker streaming chunks of 8 tokens (2 blocks) with no
    prefix cache of its own; and every offer it makes: (transfer, destination blocks, last)."""
    prefill = make_engine(tiny_dir, max_num_batched_tokens=8, prefix_caching=False)
    c = Cluster([prefill], [make_engine(tiny_dir)], "nixl", stream_chunks=True, **kw)
    sender, offers = c.workers["p0"].sender, []
    send_part = sender.send_part

    def spy(spec, kv_layers, last):
        offers.append((spec.request_id, spec.dst_block_ids, last))
        send_part(spec, kv_layers, last)

    sender.send_part = spy
    return c, offers


def test_parts_through_the_cluster_equal_transformers(tiny_dir) -> None:
    c, offers = streaming_cluster(tiny_dir)
    try:
        first = prompts(512, [30], seed=5)[0]  # 8 blocks, 4 chunks
        c.submit("a", first, GREEDY)
        c.pump()
        assert [(len(d), last) for _, d, last in offers] == [(2, False)] * 3 + [(2, True)]
        assert c.tokens("a") == {0: hf_greedy(tiny_dir, first, 6)}
        # the decode worker holds the first 6 blocks now (its prefix cache): only the rest
        # moves, in parts from there on (the prefill worker computes all 40 tokens again)
        offers.clear()
        second = first[:24] + prompts(512, [16], seed=6)[0]  # 10 blocks, 5 chunks
        c.submit("b", second, GREEDY)
        c.pump()
        assert [(len(d), last) for _, d, last in offers] == [(2, False), (2, True)]
        assert c.tokens("b") == {0: hf_greedy(tiny_dir, second, 6)}
        offers.clear()
        third = prompts(512, [20], seed=7)[0]  # 5 blocks, 3 chunks
        c.submit("n", third, GREEDY, n=2)  # one prompt for both choices
        c.pump()
        assert [(len(d), last) for _, d, last in offers] == [(2, False), (2, False), (1, True)]
        assert c.tokens("n") == {i: hf_greedy(tiny_dir, third, 6) for i in (0, 1)}
        assert c.workers["d0"].engine.prefill_tokens_computed == 0  # nothing recomputed
        assert set(c.used_blocks().values()) == {0}
        assert c.coordinator.routes == {}
    finally:
        c.close()


@pytest.mark.parametrize(
    ("mode", "policy", "reason"),
    [
        ("truncate", "recompute", "1 source blocks offered for 2"),
        ("corrupt", "recompute", "checksum mismatch"),
        ("drop", "recompute", "timed out"),
        ("delay", "recompute", "timed out"),
        ("corrupt", "fail", "checksum mismatch"),
    ],
)
def test_a_fault_in_a_middle_part_recovers_by_the_policy(tiny_dir, caplog, mode, policy, reason):
    caplog.set_level(logging.WARNING)
    c, _ = streaming_cluster(tiny_dir, policy=policy, transfer_timeout_s=2.0)
    try:
        fault_on_part(c.workers["p0"].sender, mode, 1)
        prompt = prompts(512, [30], seed=5)[0]
        c.submit("a", prompt, GREEDY)
        c.pump()
        # a deadline: the reader's, or the sender's lease (as long, from the latest part)
        sides = ("receiver", "sender") if reason == "timed out" else ("receiver",)
        logged = [r.getMessage() for r in caplog.records]
        assert any(f"nixl {side}: transfer 'a#0' failed: {reason}" in logged for side in sides)
        if policy == "recompute":  # the decode worker computed the prompt (and token 0) again
            assert c.tokens("a") == {0: hf_greedy(tiny_dir, prompt, 6)}
            assert c.workers["d0"].engine.prefill_tokens_computed == 31
        else:
            # the decode worker's reason, or the one its reader told the prefill worker (when
            # that came before NIXL's word of every read); again through the coordinator
            told = {f"KV transfer failed: {reason}", f"KV transfer failed: {SENDER}{reason}"}
            assert len(c.errors()) == 2 and {e.message for e in c.errors()} <= told
        assert set(c.used_blocks().values()) == {0}
        assert c.coordinator.routes == {}
    finally:
        c.close()


def test_stream_chunks_only_over_nixl(tiny_dir) -> None:
    for add, run, command in [
        (add_prefill_args, run_prefill, "prefill"),
        (add_serve_args, run_serve, "serve"),
    ]:
        parser = argparse.ArgumentParser()
        add(parser)
        assert parser.parse_args(["--model=m"]).kv_stream_chunks is False  # off by default
        args = parser.parse_args(["--model=/nonexistent", "--kv-stream-chunks"])
        with pytest.raises(SystemExit) as e:  # before anything loads
            run(args)
        assert str(e.value) == (
            f"pdserve {command}: --kv-stream-chunks needs --transfer-backend nixl (the decode "
            "worker reads each part while later chunks compute), not zmq"
        )
    # serve hands it to prefill workers only (and its transfer timeout to every worker)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    flags = ["--model=m", "--transfer-backend=nixl", "--kv-stream-chunks", "--transfer-timeout=90"]
    prefill, decode = worker_commands(parser.parse_args(flags), "tcp://127.0.0.1:1", "/m")
    assert ("--kv-stream-chunks" in prefill, "--kv-stream-chunks" in decode) == (True, False)
    assert "--transfer-timeout=90.0" in prefill and "--transfer-timeout=90.0" in decode
    with make_sender("zmq") as sender, pytest.raises(ValueError, match=r"ZmqKVSender does not$"):
        PrefillWorker(make_engine(tiny_dir), sender, "p0", Bus().outbox(), stream_chunks=True)
