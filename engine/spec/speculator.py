"""The engine's speculation part: each step, before scheduling, which decoding sequences verify
drafts and how many slots they need; after, the drafts (a draft model's), and once the target
has run, what the verification kept.

    plan(queues)    proposals (n-gram) or slots (draft), priced by the policy: ``lookahead``
                    and ``spec_tokens`` set on the chosen sequences
    schedule        the scheduler allocates the slots, or drops them (no room)
    fill(batch)     a draft model drafts for the scheduled ones; grammar-invalid tails cut
    execute         one forward pass: every position of every verification
    settle(...)     computed tokens = the last token + the kept drafts; the rest of the blocks
                    given back; the prefix cache offered only what was kept
    end_step(batch) every sequence's slots and drafts cleared; shadows checked; the counters
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.scheduler import ScheduledBatch, Scheduler, Sequence
from pdserve.engine.spec.draft import DraftModel
from pdserve.engine.spec.ngram import NgramIndex
from pdserve.engine.spec.policy import (
    Acceptance,
    Candidate,
    choose,
    expected_kept,
    worth_drafting,
)
from pdserve.engine.spec.verify import Verdict
from pdserve.engine.step_model import StepModel
from pdserve.protocol.control import SPEC_STEP_REASONS, SpecCounters

VERIFY_EMA = 0.1  # the newest verification's weight in ``verify_s``
PROBE_EVERY = 16  # draft mode, speculation priced out: one sequence drafts every this many steps


@dataclass
class SeqSpec:
    """One sequence's speculation: its n-gram index, its tested and kept drafts, and a
    proposal it did not verify (``shadow``), checked against the tokens that came instead."""

    index: NgramIndex | None = None
    tested: int = 0  # drafts a verification reached: kept ones and each first miss
    kept: int = 0
    shadow: list[int] = field(default_factory=list)
    shadow_from: int = 0  # the token index the shadow proposal starts at
    passes: int = 0  # draft passes its last drafting ran
    kind: int = 0  # its last proposal's kind (``Acceptance``: an n-gram's match length)
    shadow_kind: int = 0


class Speculator:
    """Owns the proposer (n-gram index per sequence, or the ``draft`` model), the policy's
    inputs (acceptance, the step-time ``model``) and the speculation counters."""

    def __init__(
        self,
        config: SpeculativeConfig,
        blocks: BlockManager,
        max_seq_tokens: int,
        model: StepModel | None,
        draft: DraftModel | None = None,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.max_seq_tokens = max_seq_tokens
        self.model = model
        self.draft = draft
        self.acceptance = Acceptance(config.num_tokens)
        self.reasons: Counter[str] = Counter()
        self._planned = False  # some sequence was given slots this step
        # seconds this step's drafting took: not the target's step (its model prices it apart)
        self.drafting_s = 0.0
        self._priced_out = 0  # draft mode: steps in a row the policy said no
        self.verify_s = 0.001  # a verification's own cost past its rows (sampling), recent

    # ---- before scheduling ----------------------------------------------------------------------
    def plan(self, scheduler: Scheduler) -> None:
        """Give the chosen decoding sequences their slots (and n-gram drafts)."""
        self._planned = False
        self._step_reason: str | None = None
        decoding = [s for s in scheduler.running if s.is_decoding]
        if not decoding:
            return
        if self.config.switch == "off":
            self._step_reason = "switched_off"
            return
        seqs: list[Sequence] = []
        drafts: list[list[int]] = []
        for seq in decoding:
            room = self._room(seq)
            proposal = self._propose_ngram(seq, room) if self.draft is None else [0] * room
            if proposal:
                seqs.append(seq)
                drafts.append(proposal)
        if not seqs:
            self._step_reason = "no_drafts"
            return
        chosen = self._choose(seqs, drafts, scheduler, len(decoding))
        if not chosen:
            self._step_reason = "not_worth"
            for seq, proposal in zip(seqs, drafts, strict=True):
                if self.draft is None:
                    self._shadow(seq, proposal)
            return
        picked = set(chosen)
        for i, (seq, proposal) in enumerate(zip(seqs, drafts, strict=True)):
            if i in picked:
                seq.lookahead = len(proposal)
                seq.spec_tokens = proposal if self.draft is None else []
            elif self.draft is None:
                self._shadow(seq, proposal)
        self._planned = True

    def _room(self, seq: Sequence) -> int:
        """Drafts ``seq`` may verify: ``k``, fewer near ``max_tokens`` or the cache's end (the
        token after the last kept draft must fit too)."""
        left = min(
            seq.params.max_tokens - seq.num_output_tokens, self.max_seq_tokens - seq.num_tokens
        )
        return max(0, min(self.config.num_tokens, left - 1))

    def _propose_ngram(self, seq: Sequence, room: int) -> list[int]:
        if room <= 0:
            return []
        state = self.state(seq)
        if state.index is None:
            state.index = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        proposal, state.kind = state.index.propose(seq.token_ids, room)
        return self._valid(seq, proposal)

    @staticmethod
    def _valid(seq: Sequence, drafts: list[int]) -> list[int]:
        """The drafts a constrained sequence's grammar allows, up to its first refusal."""
        if seq.matcher is None or not drafts:
            return drafts
        return drafts[: seq.matcher.validate_tokens(drafts)]

    def _choose(
        self, seqs: list[Sequence], drafts: list[list[int]], scheduler: Scheduler, decodes: int
    ) -> list[int]:
        if self.config.switch == "on" or self.model is None:
            return list(range(len(seqs)))
        costs = self.model.costs
        prompt = sum(s.num_uncomputed_tokens for s in scheduler.running if not s.is_decoding)
        prompt += sum(s.num_uncomputed_tokens for s in scheduler.waiting)
        prompt = min(prompt, scheduler.config.max_num_batched_tokens)
        rates = [self._rate(s) for s in seqs]
        for rate, d in zip(rates, drafts, strict=True):  # each cut to the drafts that pay
            del d[max(1, worth_drafting(rate, len(d), costs, prompt, decodes)) :]
        candidates = [
            Candidate(len(d), expected_kept(r, len(d))) for r, d in zip(rates, drafts, strict=True)
        ]
        if self.draft is not None:
            draft, k = self.draft, self.config.num_tokens
            chosen = choose(
                candidates, costs, prompt, decodes, lambda n: draft.seconds(n, k), self.verify_s
            )
            if chosen:
                self._priced_out = 0
                return chosen
            self._priced_out += 1
            if self._priced_out % PROBE_EVERY:
                return []
            # a probe keeps the acceptance measured while priced out: the likeliest one
            return [max(range(len(seqs)), key=lambda i: candidates[i].expected)]
        return choose(candidates, costs, prompt, decodes, verify_s=self.verify_s)

    def _rate(self, seq: Sequence) -> float:
        state = self.state(seq)
        return self.acceptance.seq_rate(state.tested, state.kept, state.kind)

    def _shadow(self, seq: Sequence, proposal: list[int]) -> None:
        state = self.state(seq)
        if not state.shadow:
            state.shadow, state.shadow_from = list(proposal), seq.num_tokens
            state.shadow_kind = state.kind

    @staticmethod
    def state(seq: Sequence) -> SeqSpec:
        if seq.spec is None:
            seq.spec = SeqSpec()
        state: SeqSpec = seq.spec
        return state

    # ---- after scheduling -----------------------------------------------------------------------
    def fill(self, batch: ScheduledBatch) -> None:
        """Draft mode: the scheduled sequences with slots draft now; the batch's counts are
        cut to the drafts the grammar allows."""
        self.drafting_s = 0.0
        if self.draft is None:
            return
        picked = [i for i, s in enumerate(batch.seqs) if s.lookahead and s.is_decoding]
        if not picked:
            return
        seqs = [batch.seqs[i] for i in picked]
        counts = [s.lookahead for s in seqs]
        drafts, self.drafting_s = self.draft.propose(seqs, counts)
        for i, seq, proposal, count in zip(picked, seqs, drafts, counts, strict=True):
            seq.spec_tokens = self._valid(seq, proposal)
            self.state(seq).passes = count
            batch.num_new_tokens[i] = 1 + len(seq.spec_tokens)
        batch.spec_slots = sum(len(s.spec_tokens) for s in batch.seqs)

    # ---- after the target ran -----------------------------------------------------------------
    def settle(self, verdicts: list[Verdict], seconds: float) -> None:
        """Each verified sequence keeps the KV of its last token and its kept drafts: the
        blocks past them go back, the prefix cache is offered only what was kept. ``seconds``:
        what the verification took (the policy's ``verify_s`` moves toward it)."""
        self.verify_s += VERIFY_EMA * (seconds - self.verify_s)
        for v in verdicts:
            seq = v.seq
            state = self.state(seq)
            self.acceptance.record(len(v.drafts), v.accepted, state.kind)
            state.tested += min(len(v.drafts), v.accepted + 1)
            state.kept += v.accepted
            if seq.is_finished:
                continue  # its blocks are freed already
            seq.num_computed_tokens += 1 + v.accepted
            self.blocks.trim(seq, seq.num_computed_tokens)
            if self.draft is not None:  # it computed the last token and passes - 1 drafts
                seq.draft_lag = max(0, v.accepted + 1 - state.passes)
            self.blocks.cache_full_blocks(seq, seq.draft_lag)

    def end_step(self, batch: ScheduledBatch | None, decoding: list[bool]) -> None:
        """Clear every sequence's slots and drafts; a draft model lags one token behind each
        decode it did not draft for (``decoding[i]``: batch row i was a decode); count the
        step's reason; check shadow proposals."""
        verified = False
        if batch is not None:
            for seq, was_decode in zip(batch.seqs, decoding, strict=True):
                if seq.spec_tokens:
                    verified = True
                elif self.draft is not None and was_decode and not seq.is_finished:
                    seq.draft_lag += 1
                if seq.spec is not None and seq.spec.shadow:
                    self._check_shadow(seq)
                seq.lookahead, seq.spec_tokens = 0, []
        reason = "speculated" if verified else ("no_room" if self._planned else self._step_reason)
        if reason is not None and batch is not None and batch.decode_seqs:
            self.reasons[reason] += 1

    def _check_shadow(self, seq: Sequence) -> None:
        """A proposal not verified, against the tokens that came: into the acceptance rate
        (not the metrics) once it is decided."""
        state: SeqSpec = seq.spec
        came = seq.token_ids[state.shadow_from :]
        kept = 0
        while kept < min(len(came), len(state.shadow)) and came[kept] == state.shadow[kept]:
            kept += 1
        if kept == len(state.shadow) or kept < len(came) or seq.is_finished:
            self.acceptance.observe(min(len(state.shadow), kept + 1), kept, state.shadow_kind)
            state.tested += min(len(state.shadow), kept + 1)
            state.kept += kept
            state.shadow = []

    def counters(self) -> SpecCounters:
        draft = self.draft
        return SpecCounters(
            mode=self.config.mode,
            drafted=list(self.acceptance.drafted),
            accepted=list(self.acceptance.accepted),
            steps={r: self.reasons[r] for r in SPEC_STEP_REASONS if self.reasons[r]},
            draft_tokens=draft.tokens if draft is not None else 0,
            draft_prompt_tokens=draft.prompt_tokens if draft is not None else 0,
        )
