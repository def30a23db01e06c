"""Stall-free steps: the scheduler adds to a step carrying decodes only the prompt tokens its
step-time model says fit the TPOT target, prompts past the age bound take a block a step past
it, and no decode loses its token. Stepped with no model (the engine's work is played by hand),
then an engine whose steps are capped hard gives the same tokens as one that is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.prefill_cap import PrefillCap
from pdserve.engine.scheduler import ScheduledBatch, Scheduler, Sequence, SequenceStatus
from pdserve.engine.step_model import StepCosts, StepModel, calibrate_step_model
from pdserve.engine.step_target import StepTarget
from pdserve.protocol.sampling import SamplingParams
from tests.engine_util import greedy, make_engine, prompts

# powers of two: the room is exact. A step: 1/64 s fixed, 1/1024 s a prompt token, 1/256 s a
# decode sequence; target 1/16 s
COSTS = StepCosts(fixed_s=2**-6, per_prefill_token_s=2**-10, per_decode_seq_s=2**-8)
TARGET = 2**-4
BUDGET = 512


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scheduler(
    costs: StepCosts = COSTS, age_bound_s: float = 2.0, budget: int = BUDGET
) -> tuple[Scheduler, Clock]:
    clock = Clock()
    cap = PrefillCap(lambda d: costs.prefill_room(d, TARGET), age_bound_s, overdue_tokens=16)
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=budget)
    return Scheduler(config, BlockManager(1024, 16, False), cap, clock), clock


def played(sched: Scheduler) -> ScheduledBatch:
    """One step: what the engine does after running it (tokens computed, one sampled for a
    sequence whose tokens are all computed)."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return batch


def decoding(sched: Scheduler, count: int) -> list[Sequence]:
    """``count`` sequences of 4-token prompts, each prefilled and now decoding."""
    seqs = [Sequence(f"d{i}", [1, 2, 3, 4], SamplingParams(max_tokens=100)) for i in range(count)]
    for s in seqs:
        sched.add(s)
    played(sched)  # no decode runs yet: the prompts take the budget
    assert all(s.is_decoding for s in seqs)
    return seqs


def prompt(sched: Scheduler, name: str = "p", tokens: int = 1000) -> Sequence:
    seq = Sequence(name, [5] * tokens, SamplingParams(max_tokens=4))
    sched.add(seq)
    return seq


def tokens_of(batch: ScheduledBatch, seq: Sequence) -> int:
    return next((n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if s is seq), 0)


@pytest.mark.parametrize(
    ("decodes", "room"),
    # (1/16 - 1/64 - d/256) * 1024 prompt tokens; 12 decodes fill the target
    [(1, 44), (2, 40), (4, 32), (8, 16), (11, 4), (12, 0), (20, 0)],
)
def test_a_step_with_decodes_adds_the_prompt_tokens_that_fit_the_target(
    decodes: int, room: int
) -> None:
    sched, _ = scheduler()
    streams = decoding(sched, decodes)
    p = prompt(sched)
    batch = played(sched)
    assert tokens_of(batch, p) == room
    assert batch.decode_seqs == decodes and all(tokens_of(batch, s) == 1 for s in streams)
    assert batch.prefill_tokens == room and batch.overdue_tokens == 0
    # the rest waits for the next step, which again adds what fits
    assert tokens_of(played(sched), p) == room


def test_without_decodes_a_prompt_takes_the_whole_budget() -> None:
    sched, _ = scheduler()
    p = prompt(sched, tokens=BUDGET + 100)
    assert tokens_of(played(sched), p) == BUDGET
    assert tokens_of(played(sched), p) == 100


def test_the_room_is_shared_by_prompts_in_arrival_order_running_first() -> None:
    sched, _ = scheduler()
    decoding(sched, 4)  # room 32
    first = prompt(sched, "first", tokens=20)
    second = prompt(sched, "second", tokens=40)
    batch = played(sched)
    assert (tokens_of(batch, first), tokens_of(batch, second)) == (20, 12)
    batch = played(sched)  # first decodes now: 5 decodes, room 28
    assert (tokens_of(batch, first), tokens_of(batch, second)) == (1, 28)


def test_a_short_prompt_goes_before_a_long_one_in_a_capped_step() -> None:
    sched, _ = scheduler()
    decoding(sched, 4)  # room 32
    long = prompt(sched, "long", tokens=1000)
    assert tokens_of(played(sched), long) == 32
    short, longer = prompt(sched, "short", tokens=10), prompt(sched, "longer", tokens=2000)
    batch = played(sched)
    assert [tokens_of(batch, p) for p in (short, long, longer)] == [10, 22, 0]
    batch = played(sched)  # short decodes now: 5 decodes, room 28, long before longer
    assert [tokens_of(batch, p) for p in (short, long, longer)] == [1, 28, 0]


def test_without_a_cap_running_prompts_go_first_in_queue_order() -> None:
    sched, _ = scheduler(budget=64)
    long = prompt(sched, "long", tokens=1000)
    assert tokens_of(played(sched), long) == 64
    short = prompt(sched, "short", tokens=10)
    batch = played(sched)  # no decode runs: no cap, the budget goes in the old order
    assert (tokens_of(batch, long), tokens_of(batch, short)) == (64, 0)


def test_a_batched_step_term_is_paid_once_past_two_rows() -> None:
    costs = StepCosts(2**-6, 2**-10, 2**-8, batched_s=2**-7)  # 8 tokens' worth
    assert costs.prefill_room(1, TARGET) == 44 - 8
    assert costs.prefill_room(4, TARGET) == 32 - 8
    # a lone decode with one prompt token is still two rows: the term is not paid
    tight = StepCosts(2**-6, 2**-10, 2**-8, batched_s=2**-4)
    assert tight.prefill_room(1, TARGET) == 1
    assert tight.prefill_room(2, TARGET) == 0


def test_a_prompt_without_tokens_for_the_age_bound_takes_a_block_a_step_past_the_target() -> None:
    sched, clock = scheduler(age_bound_s=2.0)
    decoding(sched, 12)  # the decodes fill the target
    old = prompt(sched, "old", tokens=40)
    assert tokens_of(played(sched), old) == 0
    clock.now += 1.5
    young = prompt(sched, "young", tokens=40)
    assert tokens_of(played(sched), old) == 0
    clock.now += 0.5  # old has gone 2 s without a token: one block a step, to its end
    batch = played(sched)
    assert (tokens_of(batch, old), tokens_of(batch, young)) == (16, 0)
    assert batch.overdue_tokens == 16 and batch.decode_seqs == 12
    assert tokens_of(played(sched), old) == 16
    clock.now += 1.5  # both overdue: they share the block, the fewest tokens left first
    batch = played(sched)
    assert (tokens_of(batch, old), tokens_of(batch, young)) == (8, 8)
    batch = played(sched)  # old is decoding now (one more decode: still no room)
    assert (tokens_of(batch, old), tokens_of(batch, young)) == (1, 16)
    assert batch.overdue_tokens == 16


def test_a_prompt_given_room_every_step_is_never_overdue() -> None:
    sched, clock = scheduler(age_bound_s=2.0)
    decoding(sched, 11)  # room 4
    p = prompt(sched, tokens=100)
    for _ in range(10):
        clock.now += 1.0
        batch = played(sched)
        assert tokens_of(batch, p) == 4 and batch.overdue_tokens == 0
    assert not p.overdue


def test_decodes_later_in_the_running_list_keep_their_share_of_the_budget() -> None:
    """A prompt prefilling on a decode worker, then streams whose KV landed from elsewhere
    (appended to the running list behind it): the prompt leaves them their tokens."""
    sched, _ = scheduler(budget=64)
    sched.cap = None  # no target: only the budget holds the prompt back
    early = prompt(sched, "early", tokens=200)
    assert tokens_of(played(sched), early) == 64
    landed = [Sequence(f"l{i}", [1, 2, 3, 4], SamplingParams(max_tokens=9)) for i in range(3)]
    for s in landed:  # token 0 came with the KV of its prompt
        s.token_ids.append(9)
        assert sched.blocks.allocate(s, s.num_tokens)
        s.num_computed_tokens = 4
        s.status = SequenceStatus.RUNNING
        sched.running.append(s)
    batch = played(sched)
    assert [tokens_of(batch, s) for s in landed] == [1, 1, 1]
    assert tokens_of(batch, early) == 64 - 3


def test_the_model_fits_its_terms_and_follows_the_steps_it_observes() -> None:
    truth = StepCosts(0.02, 0.004, 0.006, batched_s=0.1)
    probes = [(64, 0), (256, 0), (0, 1), (0, 2), (0, 8), (0, 16)]
    model = StepModel([(p, d, truth.seconds(p, d)) for p, d in probes])
    for got, want in zip(model.costs.terms(), truth.terms(), strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    slower = StepCosts(0.04, 0.008, 0.012, batched_s=0.2)  # the machine got twice as slow
    for i in range(256):
        p, d = (i % 5) * 8, 1 + i % 7
        model.observe(p, d, slower.seconds(p, d))
    assert model.costs.seconds(16, 4) > 1.8 * truth.seconds(16, 4)


def test_start_up_probes_steps_like_the_capped_ones_and_fits_them() -> None:
    truth = StepCosts(0.02, 0.004, 0.006, batched_s=0.1)
    blocks = BlockManager(512, 16, False)
    timed: list[tuple[int, int]] = []

    def timer(p: int, d: int) -> float:
        timed.append((p, d))
        return truth.seconds(p, d)

    model = calibrate_step_model(None, blocks, 2048, 64, [(96, 0.5), (256, 1.2)], timer)  # type: ignore[arg-type]
    # a warm-up, then decodes alone and decodes with a prompt chunk (the long prefills given)
    assert timed == [(0, 1), (0, 1), (0, 2), (0, 8), (0, 16), (16, 1), (32, 4), (64, 8)]
    assert model.probes[:2] == [(96, 0, 0.5), (256, 0, 1.2)]
    # the given prefills are not on the truth's line: the fit sits between
    assert model.costs.seconds(16, 4) == pytest.approx(truth.seconds(16, 4), rel=0.15)


def test_an_observed_pause_moves_the_model_by_a_bounded_factor() -> None:
    model = StepModel([(64, 0, 0.1), (256, 0, 0.4), (0, 1, 0.01), (0, 8, 0.03)])
    before = model.costs.seconds(8, 4)
    for _ in range(16):  # one refit's worth of ten-second pauses
        model.observe(8, 4, 10.0)
    assert before < model.costs.seconds(8, 4) < 3 * before


def test_a_term_the_probes_cannot_tell_apart_is_dropped() -> None:
    model = StepModel([(64, 0, 0.1), (128, 0, 0.2)])  # prompt tokens only
    assert model.costs.per_prefill_token_s == pytest.approx(0.1 / 64)
    assert model.costs.per_decode_seq_s == 0.0 and model.costs.batched_s == 0.0


def test_steps_over_the_target_are_counted_by_why() -> None:
    target = StepTarget(TARGET, StepModel([(0, 1, 0.02), (0, 8, 0.05), (64, 0, 0.08)]), 2.0)
    target.model.costs = COSTS  # type: ignore[union-attr]
    for decodes, prefill, overdue, seconds in [
        (20, 0, 0, 0.2),  # 20 decodes alone are predicted over the target
        (4, 48, 16, 0.09),  # an overdue prompt took a block past the room
        (4, 32, 0, 0.09),  # predicted within, ran over
        (4, 32, 0, 0.05),  # within
        (0, 512, 0, 0.9),  # no stream waits on a prefill-only step
    ]:
        batch = ScheduledBatch(decode_seqs=decodes, overdue_tokens=overdue)
        batch.num_new_tokens = [1] * decodes + [prefill]
        target.model.costs = COSTS  # type: ignore[union-attr]
        target.observe(batch, seconds)
    counters = target.counters()
    assert counters.over_target == {"decodes": 1, "age_bound": 1, "misprediction": 1}
    assert {k: sum(h.seconds_counts) for k, h in counters.by_kind.items()} == {
        "decode": 1,
        "mixed": 3,
        "prefill": 1,
    }
    assert counters.by_kind["mixed"].prefill_tokens_sum == 48 + 32 + 32
    assert counters.tpot_target_s == TARGET and len(counters.model) == 4


def test_capped_steps_give_the_tokens_of_uncapped_ones_and_free_every_block(
    tiny_dir: Path,
) -> None:
    """Prompts arriving while others decode, each step held to a few prompt tokens."""
    free = make_engine(tiny_dir, max_num_batched_tokens=64)
    capped = make_engine(tiny_dir, max_num_batched_tokens=64)
    tight = StepCosts(0.0, 2**-10, 2**-12)  # target: 8 prompt tokens beside a decode
    capped.steps = StepTarget(2**-7 + 2**-12, StepModel([(64, 0, 1 / 16)]), 3600.0)
    capped.steps.model.costs = tight  # type: ignore[union-attr]
    capped.steps.model.observe = lambda *a: None  # type: ignore[method-assign, union-attr]
    capped.scheduler.cap = capped.steps.cap()
    assert tight.prefill_room(1, capped.steps.target_s) == 8
    texts = prompts(free.model_config.vocab_size, [5, 40, 33, 61, 2])
    results = []
    for engine in (free, capped):
        engine.add_request("first", texts[0], greedy(16, ignore_eos=True))
        outs: dict[str, list[int]] = {}
        step = 0
        while engine.has_unfinished() or step < len(texts):
            if 1 <= step <= len(texts) - 1:
                engine.add_request(f"r{step}", texts[step], greedy(12, ignore_eos=True))
            for out in engine.step():
                outs.setdefault(str(out.request_id), []).extend(out.new_token_ids)
            step += 1
        assert engine.status.num_free_blocks == engine.status.num_blocks
        results.append((outs, step))
    (free_out, free_steps), (capped_out, capped_steps) = results
    assert capped_out == free_out and len(capped_out) == len(texts)
    assert capped_steps > free_steps
    # prompt tokens in steps carrying decodes (buckets <= 0, <= 16, <= 32, ...): at most 8
    # capped, up to a whole prompt not
    capped_mixed = capped.step_counters().by_kind["mixed"].prefill_tokens_counts
    free_mixed = free.step_counters().by_kind["mixed"].prefill_tokens_counts
    assert sum(capped_mixed[:2]) > 0 and sum(capped_mixed[2:]) == 0
    assert sum(free_mixed[2:]) > 0
