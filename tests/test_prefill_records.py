"""A prefill worker keeps one record per job (``PrefillRecord``) and nothing else: through
every way out (pushed, ended at token 0, aborted computing or sending, a transfer that fails or
times out, a push that cannot start) the record, the engine's held KV or computing prompt and
the sender's transfer all go, and every block is free (the prompt's stay in the prefix cache)."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.base import KVPoll
from pdserve.prefill.worker import PrefillState, PrefillWorker
from pdserve.protocol import messages as m
from pdserve.protocol.blocks import fork_blocks
from pdserve.protocol.keys import ChoiceKey
from pdserve.worker.wire import PromptKey
from tests.engine_util import make_engine, prompts
from tests.worker_util import Outbox, Sender, assert_engine_empty

KEY = ChoiceKey("r", 0)
PROMPT = prompts(512, [10], seed=91)[0]  # 3 blocks of 4


def worker(tiny_dir, **engine: object) -> tuple[PrefillWorker, Sender, Outbox]:
    sender, outbox = Sender(), Outbox()
    return PrefillWorker(make_engine(tiny_dir, **engine), sender, "p0", outbox), sender, outbox


def job(prompt: list[int] = PROMPT, choices: int = 1, max_tokens: int = 8) -> m.PrefillJob:
    return m.PrefillJob(
        request_id="r",
        prompt_token_ids=prompt,
        sampling=m.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        n=choices,
        dst_block_ids=list(range(100, 100 + fork_blocks(len(prompt), choices, 4))),
        transfer_address="fake://receiver",
        stream_address="gw",
        choices=choices,
    )


def assert_freed(w: PrefillWorker, sender: Sender) -> None:
    w.step()  # an aborted prompt's final output goes with the next step
    assert w.records == {} and not w.in_flight()
    assert sender.states == {}
    assert_engine_empty(w.engine)


@pytest.mark.parametrize("choices", [1, 3])
def test_pushed_job_leaves_nothing(tiny_dir, choices: int) -> None:
    w, sender, outbox = worker(tiny_dir)
    w.handle(job(choices=choices))
    assert w.keys_in(PrefillState.COMPUTING) == [KEY]
    held = KEY if choices == 1 else PromptKey("r", 0)
    assert list(w.engine.requests)[-1] == held
    w.step()  # the prompt, and every choice's token 0
    assert w.keys_in(PrefillState.SENDING) == [KEY]
    assert w.engine.requests.held[held].block_table == [0, 1, 2]
    assert sender.sent["r#0"].src_block_ids == [0, 1, 2]
    sender.finish("r#0", KVPoll.DONE)  # from the sender's thread: TransferDone at once
    [done] = outbox.sent(m.TransferDone)
    assert (done.error, len(done.first_token_ids)) == (None, choices)
    assert w.records[KEY].reported
    assert_freed(w, sender)
    assert len(outbox.sent(m.TransferDone)) == 1  # the worker's own poll sends no second one
    assert w.engine.block_manager.num_cached_blocks == 2  # the prompt's full blocks


def test_token0_that_ends_every_choice_moves_nothing(tiny_dir) -> None:
    w, sender, outbox = worker(tiny_dir)
    w.handle(job(choices=2, max_tokens=1))
    w.step()
    assert sender.sent == {} and outbox.sent(m.TransferDone) == []
    assert [f.choice for f in outbox.sent(m.Finished)] == [0, 1]
    assert_freed(w, sender)


@pytest.mark.parametrize("state", [PrefillState.COMPUTING, PrefillState.SENDING])
@pytest.mark.parametrize("choices", [1, 3])
def test_abort_in_each_state_frees_at_once(tiny_dir, state: PrefillState, choices: int) -> None:
    w, sender, outbox = worker(tiny_dir, max_num_batched_tokens=8)
    long = prompts(512, [20], seed=92)[0]  # three steps of 8 tokens
    w.handle(job(long, choices=choices))
    w.step()
    if state is PrefillState.SENDING:
        w.step()
        w.step()
    assert w.keys_in(state) == [KEY]
    assert w.engine.block_manager.num_used_blocks > 0
    w.handle(m.Abort(request_id="r", reason="client went away"))
    assert w.records == {} and w.engine.block_manager.num_used_blocks == 0
    assert_freed(w, sender)
    assert outbox.sent(m.TransferDone) == []


@pytest.mark.parametrize("seen_by", ["sender thread", "poll"])
def test_failed_or_timed_out_transfer_reports_and_frees(tiny_dir, seen_by: str) -> None:
    w, sender, outbox = worker(tiny_dir)
    w.handle(job())
    w.step()
    if seen_by == "poll":
        sender.states["r#0"] = KVPoll.FAILED  # no callback: the worker's poll finds it
    else:
        sender.finish("r#0", KVPoll.FAILED)
    assert_freed(w, sender)
    [done] = outbox.sent(m.TransferDone)
    assert done.error == "KV transfer failed: timed out" and done.first_token_ids


def test_push_that_cannot_start_frees(tiny_dir) -> None:
    w, sender, outbox = worker(tiny_dir)
    sender.refuse = True
    w.handle(job())
    w.step()
    [done] = outbox.sent(m.TransferDone)
    assert done.error == "KV transfer could not start: sender closed"
    assert_freed(w, sender)


def test_refused_job_keeps_no_record(tiny_dir) -> None:
    w, sender, outbox = worker(tiny_dir)
    w.handle(job(prompt=[]))
    [error] = outbox.errors()
    assert (error.status, error.message) == (400, "the prompt is empty")
    assert_freed(w, sender)


def test_a_draining_worker_still_runs_a_job_sent_before_the_coordinator_heard(tiny_dir) -> None:
    """The coordinator sends no job to a worker it knows drains; one already on its way is
    run (and counted in flight, so the drain waits for it), not refused: another worker could
    have served it, and a refusal would fail its stream (``pdserve serve --autoscale``)."""
    w, sender, outbox = worker(tiny_dir)
    w.begin_drain()
    w.handle(job())
    assert w.keys_in(PrefillState.COMPUTING) == [KEY] and w.in_flight()
    w.step()
    sender.finish("r#0", KVPoll.DONE)
    assert outbox.sent(m.RequestError) == []
    [done] = outbox.sent(m.TransferDone)
    assert done.error is None
    assert_freed(w, sender)
