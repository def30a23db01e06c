"""A decode worker keeps one record per choice (decode/record.py) and nothing else: through
every way out (finished, aborted in each state, a failed transfer under either policy, a
reservation nobody followed up, a bad hand-off) the record, the engine's reservation or
sequence and the receiver's expectation all go, and every block is free."""

from __future__ import annotations

import time

import pytest

from pdserve.decode.record import DecodeState
from pdserve.decode.worker import DecodeWorker
from pdserve.engine.scheduler import SequenceStatus
from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey
from tests.engine_util import make_engine, prompts
from tests.worker_util import Outbox, Receiver, assert_engine_empty

SPEC = m.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
KEY = ChoiceKey("r", 0)
PROMPT = prompts(512, [10], seed=90)[0]  # 3 blocks of 4 with token 0's slot


def worker(tiny_dir, policy: str = "recompute", timeout_s: float = 30.0):
    receiver, outbox = Receiver(), Outbox()
    w = DecodeWorker(make_engine(tiny_dir), receiver, "d0", outbox, timeout_s, policy)
    return w, receiver, outbox


def reserve(w: DecodeWorker, choices: int = 1) -> None:
    w.handle(
        m.Reserve(
            request_id="r",
            prompt_token_ids=PROMPT,
            sampling=SPEC,
            n=choices,
            stream_address="gw",
            choice=0,
            choices=choices,
        )
    )


def transfer_done(w: DecodeWorker, choices: int = 1, **kw: object) -> None:
    w.handle(m.TransferDone(request_id="r", first_token_ids=[7] * choices, choice=0, **kw))


def run_out(w: DecodeWorker) -> None:
    for _ in range(100):
        if not w.step():
            return
    raise AssertionError("the worker did not go idle")


def assert_freed(w: DecodeWorker, receiver: Receiver) -> None:
    run_out(w)  # an aborted sequence's final output goes with the next step
    assert w.records == {} and not w.in_flight()
    assert receiver.expected == {} and receiver.states == {}
    assert_engine_empty(w.engine)


def test_finished_choice_leaves_nothing(tiny_dir) -> None:
    w, receiver, outbox = worker(tiny_dir)
    reserve(w)
    assert w.keys_in(DecodeState.RESERVED) == [KEY]
    reservation = w.engine.scheduler.waiting_for_kvs[KEY]  # a state the scheduler knows
    assert reservation.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    assert reservation.block_table == [0, 1, 2] and w.engine.block_manager.num_used_blocks == 3
    assert not w.engine.has_unfinished() and w.engine.status.num_waiting == 0  # never scheduled
    assert receiver.expected == {"r#0": [0, 1, 2]}  # the prompt's blocks, token 0's included
    [reply] = outbox.sent(m.Reserved)
    assert (reply.block_ids, reply.free_blocks) == ([0, 1, 2], 509)
    assert (reply.transfer_secret, reply.cached_blocks, reply.error) == (b"secret", 0, None)
    transfer_done(w)
    assert w.keys_in(DecodeState.RECEIVING) == [KEY]
    assert w.step() and w.keys_in(DecodeState.RECEIVING) == [KEY]  # not landed yet
    receiver.land("r#0")
    w.step()
    assert w.keys_in(DecodeState.RUNNING) == [KEY] and receiver.expected == {}
    assert w.engine.scheduler.waiting_for_kvs == {} and list(w.engine.requests) == [KEY]
    assert_freed(w, receiver)
    assert [(f.request_id, f.choice) for f in outbox.sent(m.Finished)] == [("r", 0)]
    chunks = [c for b in outbox.gateway if isinstance(b, m.TokenBatch) for c in b.chunks]
    assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("state", list(DecodeState)[:3])
def test_abort_in_each_state_frees_at_once(tiny_dir, state: DecodeState) -> None:
    w, receiver, outbox = worker(tiny_dir)
    reserve(w)
    if state is not DecodeState.RESERVED:
        transfer_done(w)
    if state is DecodeState.RUNNING:
        receiver.land("r#0")
        w.step()
    assert w.keys_in(state) == [KEY]
    w.handle(m.Abort(request_id="r", reason="client went away"))
    assert w.records == {} and w.engine.block_manager.num_used_blocks == 0
    assert_freed(w, receiver)
    assert outbox.errors() == []


@pytest.mark.parametrize("how", ["transfer done with an error", "receiver failed"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_transfer_under_either_policy(tiny_dir, policy: str, how: str) -> None:
    w, receiver, outbox = worker(tiny_dir, policy)
    reserve(w)
    if how == "receiver failed":
        transfer_done(w)
        receiver.fail("r#0")
    else:
        transfer_done(w, error="KV transfer failed: dropped")
    w.step()
    assert receiver.expected == {} and w.engine.scheduler.waiting_for_kvs == {}
    if policy == "recompute":  # the prompt and token 0 computed here instead
        assert w.keys_in(DecodeState.RUNNING) == [KEY]
    assert_freed(w, receiver)
    if policy == "recompute":
        assert outbox.errors() == [] and len(outbox.sent(m.Finished)) == 1
    else:
        [error] = outbox.errors()
        assert error.status == 500 and "KV transfer failed" in error.message


def test_reservation_nobody_follows_up_expires(tiny_dir) -> None:
    w, receiver, outbox = worker(tiny_dir, timeout_s=0.01)
    reserve(w)
    time.sleep(0.05)  # past 3 x the transfer timeout
    w.step()
    [error] = outbox.errors()
    assert (error.status, error.message) == (503, "the prompt's KV never arrived")
    assert_freed(w, receiver)


def test_token0_count_mismatch_fails_and_frees(tiny_dir) -> None:
    w, receiver, outbox = worker(tiny_dir)
    reserve(w, choices=2)
    transfer_done(w, choices=1)
    [error] = outbox.errors()
    assert error.status == 500 and "token 0 of 2 choices" in error.message
    assert_freed(w, receiver)


def test_shared_reservation_through_drops_and_aborts(tiny_dir) -> None:
    """Three choices on one reservation: one ended at token 0, one aborted while receiving,
    one decodes to its end."""
    w, receiver, outbox = worker(tiny_dir)
    reserve(w, choices=3)
    assert w.engine.scheduler.waiting_for_kvs[KEY].block_table == [0, 1, 2, 3, 4]
    transfer_done(w, choices=3, ended=[1])
    w.handle(m.Abort(request_id="r", reason="n/a", choice=2))  # only kept from decoding
    assert w.keys_in(DecodeState.RECEIVING) == [KEY]
    receiver.land("r#0")
    w.step()
    assert w.keys_in(DecodeState.RUNNING) == [KEY]  # choices 1 and 2 never decode
    assert_freed(w, receiver)
    assert [f.choice for f in outbox.sent(m.Finished)] == [0]


def test_every_choice_dropped_before_the_kv_lands(tiny_dir) -> None:
    w, receiver, _ = worker(tiny_dir)
    reserve(w, choices=2)
    transfer_done(w, choices=2, ended=[0, 1])
    receiver.land("r#0")
    w.step()
    assert_freed(w, receiver)


@pytest.mark.parametrize("choices", [1, 3])
def test_colocated_choices_aborted_while_running(tiny_dir, choices: int) -> None:
    w = DecodeWorker(make_engine(tiny_dir), None, "d0", outbox := Outbox())
    job = m.PrefillJob(
        request_id="r",
        prompt_token_ids=PROMPT,
        sampling=m.SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
        n=choices,
        dst_block_ids=[],
        transfer_address="",
        stream_address="gw",
        choices=choices,
    )
    w.handle(job)
    w.step()
    w.step()
    assert w.keys_in(DecodeState.RUNNING) == [ChoiceKey("r", c) for c in range(choices)]
    w.handle(m.Abort(request_id="r", reason="client went away"))
    assert w.records == {} and w.engine.block_manager.num_used_blocks == 0
    run_out(w)
    assert w.records == {} and outbox.errors() == []
    assert_engine_empty(w.engine)
