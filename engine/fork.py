"""``n`` choices of one prompt: the prompt's KV is computed (or received) once, then forked.

A forked choice holds one reference to each of the prompt's full blocks and owns a copy of
its partial last block, where it writes its own tokens' KV (prompt of 10 tokens, blocks of 4)::

    prompt KV:  [b0: t0..t3] [b1: t4..t7] [b2: t8 t9 . .]
    choice 0    b0 b1 b2        b0, b1: one reference per choice (3 here)
    choice 1    b0 b1 b3        b3, b4: copies of b2, where token 0 of their choice goes next
    choice 2    b0 b1 b4        (a prompt of whole blocks shares them all, no copy)

Each choice samples token 0 from the prompt's last logits with its own parameters, generator
(a seeded choice ``c`` has its own seed, e.g. seed + c) and output-constraint matcher, so it
gets the tokens a request of its own would. Afterwards the choices are plain sequences: an
abort frees what one alone holds, a preempted one recomputes from its own tokens.

colocated engine or prefill worker               decode worker
add_request_n(pid, ids, prompt, params)          reserve(rid, P + 1, choices=n)
  step(): the prompt runs once, under pid;         (the prompt's KV lands in its first
  its last logits give each choice token 0          blocks_needed(P) blocks)
  hold_kv: the prompt's KV stays held under       add_prefilled_n(rid, ids, prompt,
  pid (held_block_ids, release); the choices                      token 0s, params)
  that go on decode with forked blocks              n sequences forked as drawn above
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.block_manager import NoFreeBlocks
from pdserve.engine.sequence import Sequence
from pdserve.protocol.blocks import fork_blocks
from pdserve.protocol.messages import TokenLogprob
from pdserve.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


class ForkMixin:
    """Mixed into ``LLMEngine``."""

    # ---- one prompt, n choices, computed here ---------------------------------------------
    def add_request_n(
        self: LLMEngine,
        prompt_id: str,
        request_ids: list[str],
        prompt_token_ids: list[int],
        params: list[SamplingParams],
        hold_kv: bool = False,
    ) -> None:
        """Queue one prompt for ``len(request_ids)`` choices; ``params[i]`` is choice i's.

        The prompt runs once under ``prompt_id``, which never appears in ``step()``'s outputs;
        each choice reports under its own id from token 0 on. ``hold_kv``: the prompt's KV is
        kept under ``prompt_id`` (``held_block_ids``, ``release``) once token 0 is drawn.
        ``abort(choice)`` drops one choice (the prompt too if it was the last one computing);
        ``abort(prompt_id)`` drops the prompt and every choice still waiting for token 0.
        """
        _check_choices(request_ids, len(params))
        if prompt_id in request_ids or prompt_id in self.requests or prompt_id in self.held:
            raise ValueError(f"request id {prompt_id!r} is already running")
        choices = [
            self._new_sequence(rid, prompt_token_ids, p)
            for rid, p in zip(request_ids, params, strict=True)
        ]
        prompt = Sequence(prompt_id, list(prompt_token_ids), params[0])
        prompt.hold_kv = hold_kv
        prompt.choices = choices
        for seq in choices:
            seq.parent = prompt
            self.requests[seq.request_id] = seq
        self.requests[prompt_id] = prompt
        self.scheduler.add(prompt)

    def _fork_rows(
        self: LLMEngine, seqs: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[Sequence], torch.Tensor]:
        """The rows to sample: a prompt computed for its choices hands its row to each."""
        if all(seq.choices is None for seq in seqs):
            return seqs, logits
        rows: list[int] = []
        out: list[Sequence] = []
        for i, seq in enumerate(seqs):
            for choice in seq.choices if seq.choices is not None else [seq]:
                if choice is not seq and choice.is_finished:
                    continue  # aborted before its token 0
                choice.num_cached_tokens = seq.num_cached_tokens
                rows.append(i)
                out.append(choice)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        return out, logits[index]  # [len(out), V]

    def _settle_forks(self: LLMEngine, seqs: list[Sequence]) -> None:
        """Prompts whose choices just drew token 0: the prompt leaves the queues (held, or
        freed), the choices that go on enter WAITING with blocks forked from it."""
        for prompt in seqs:
            if prompt.choices is None:
                continue
            going = [seq for seq in prompt.choices if not seq.is_finished]
            for seq in prompt.choices:
                seq.parent = None
            prompt.choices = None
            self.requests.pop(prompt.request_id, None)
            self.scheduler.finish(prompt, free=False)
            # the first takes the prompt's blocks over, unless they stay held
            taker = going[0] if going and not prompt.hold_kv else None
            copies: list[tuple[int, int]] = []
            for seq in going:
                seq.num_computed_tokens = prompt.num_computed_tokens
                seq.block_hashes = list(prompt.block_hashes)
                seq.num_committed_blocks = prompt.num_committed_blocks
                if seq is not taker:
                    self._fork_local(prompt, seq, copies)
            if taker is not None:
                taker.block_table, prompt.block_table = prompt.block_table, []
            self.runner.kv_cache.copy_blocks([s for s, _ in copies], [d for _, d in copies])
            for seq in reversed(going):  # next step, ahead of requests that came after them
                self.scheduler.add(seq, front=True)
            if prompt.hold_kv:
                self.held[prompt.request_id] = prompt
            else:
                self.block_manager.free_seq(prompt)

    def _fork_local(
        self: LLMEngine, prompt: Sequence, seq: Sequence, copies: list[tuple[int, int]]
    ) -> None:
        """A block for the partial tail if the prompt has one; none free: ``seq`` is left
        without blocks to be computed again from its tokens, as if it had been preempted."""
        tail = None
        if prompt.num_tokens % self.block_manager.block_size:
            try:
                [tail] = self.block_manager.allocate_blocks(1)
            except NoFreeBlocks:
                seq.num_computed_tokens = seq.num_committed_blocks = 0
                seq.num_preemptions += 1
                return
        _fork_blocks(self, prompt.block_table, prompt.num_tokens, seq, tail, copies)

    def _abort_forked(self: LLMEngine, seq: Sequence) -> None:
        """After ``seq`` was aborted: a prompt still computing takes its waiting choices with
        it; a waiting choice that was the prompt's last one takes the prompt."""
        if seq.choices is not None:
            for choice in seq.choices:
                if not choice.is_finished:
                    self.abort(choice.request_id)
        elif seq.parent is not None and all(c.is_finished for c in seq.parent.choices or []):
            self.abort(seq.parent.request_id)

    # ---- one prompt, n choices, KV received from a prefill worker ---------------------------
    def fork_blocks_needed(self: LLMEngine, num_prompt_tokens: int, n: int) -> int:
        """Blocks ``n`` choices of a received prompt start with: the prompt's and token 0's
        slot for the first, one more each for the others (their tail copy or token 0's)."""
        return fork_blocks(num_prompt_tokens, n, self.block_manager.block_size)

    def add_prefilled_n(
        self: LLMEngine,
        reservation_id: str,
        request_ids: list[str],
        prompt_token_ids: list[int],
        first_tokens: list[int],
        params: list[SamplingParams],
        first_logprobs: list[TokenLogprob | None] | None = None,
        num_cached_tokens: int = 0,
    ) -> None:
        """Start decoding ``len(request_ids)`` choices of a prompt whose KV now sits in the
        first ``blocks_needed(len(prompt))`` blocks of ``reservation_id``'s reservation.

        Choice i continues after ``first_tokens[i]`` (sampled, and reported, by the prefill
        worker) with ``params[i]``; outputs start at token 1. The reservation needs
        ``fork_blocks_needed(len(prompt), n)`` blocks (``reserve(..., choices=n)``); blocks
        past that (choices aborted meanwhile) are freed. ``ValueError`` frees all of them.
        ``num_cached_tokens`` as for ``add_prefilled``, the same for every choice.
        """
        if reservation_id not in self.reserved:
            raise ValueError(f"request {reservation_id!r} has no reserved blocks")
        num_tokens = len(prompt_token_ids)
        needed = self.fork_blocks_needed(num_tokens, len(request_ids))
        logprobs = first_logprobs or [None] * len(request_ids)
        try:
            _check_choices(request_ids, len(params), len(first_tokens), len(logprobs))
            if len(self.reserved[reservation_id]) < needed:
                raise ValueError(
                    f"{len(request_ids)} choices of a {num_tokens}-token prompt need {needed} "
                    f"reserved blocks, {reservation_id!r} has {len(self.reserved[reservation_id])}"
                )
            seqs = [
                self._continued(rid, prompt_token_ids, [token], p)
                for rid, token, p in zip(request_ids, first_tokens, params, strict=True)
            ]
        except ValueError:
            self.cancel_reservation(reservation_id)
            raise
        ids = self.reserved.pop(reservation_id)
        self.block_manager.free_blocks(ids[needed:])
        own = self.block_manager.blocks_needed(num_tokens + 1)
        copies: list[tuple[int, int]] = []
        for i, seq in enumerate(seqs):
            if i == 0:
                seq.block_table = ids[:own]
            else:
                _fork_blocks(self, ids, num_tokens, seq, ids[own + i - 1], copies)
            seq.num_computed_tokens = num_tokens
            seq.num_cached_tokens = num_cached_tokens
        self.runner.kv_cache.copy_blocks([s for s, _ in copies], [d for _, d in copies])
        for seq, lp in zip(seqs, logprobs, strict=True):
            if lp is not None:
                seq.output_logprobs.append(lp)
            self._admit_continued(seq)


def _fork_blocks(
    engine: LLMEngine,
    table: list[int],
    num_tokens: int,
    seq: Sequence,
    extra: int | None,
    copies: list[tuple[int, int]],
) -> None:
    """``seq`` shares the full blocks of ``num_tokens`` tokens of ``table``, then owns
    ``extra``: a copy of the partial block after them (``copies`` gets the pair), or, when
    there is none, the block for its next token."""
    full = num_tokens // engine.block_manager.block_size
    engine.block_manager.share(table[:full])
    seq.block_table = table[:full]
    if extra is not None:
        if num_tokens % engine.block_manager.block_size:
            copies.append((table[full], extra))
        seq.block_table.append(extra)


def _check_choices(request_ids: list[str], *lengths: int) -> None:
    """One id per choice, all different, and one entry per choice in every per-choice list."""
    if not request_ids:
        raise ValueError("at least one choice is needed")
    if len(set(request_ids)) != len(request_ids):
        raise ValueError(f"choice ids repeat: {request_ids}")
    if any(n != len(request_ids) for n in lengths):
        raise ValueError(f"{len(request_ids)} choices, but per-choice lists of lengths {lengths}")
