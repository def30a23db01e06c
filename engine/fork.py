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

colocated engine or prefill worker               decode worker (engine/kv_handoff.py)
forks.add_request_n(pid, ids, prompt, params)    handoff.reserve(rid, P + 1, choices=n)
  step(): the prompt runs once, under pid;         (the prompt's KV lands in its first
  its last logits give each choice token 0          blocks_for(P) blocks)
  hold_kv: the prompt's KV stays held under       handoff.add_prefilled_n(rid, ids, prompt,
  pid (held_block_ids, release); the choices                        token 0s, params)
  that go on decode with forked blocks              n sequences forked as drawn above
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from pdserve.engine.block_manager import BlockManager, KVCache, NoFreeBlocks
from pdserve.engine.requests import RequestTable
from pdserve.engine.scheduler import RequestId, Scheduler, Sequence
from pdserve.protocol.blocks import full_blocks, tail_tokens
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.tenancy import DEFAULT, Share


class Forks:
    """Owns the prompts computed once for their ``n`` choices: each such prompt sequence holds
    its ``choices`` (outside the scheduler's queues) until its last logits give each its token 0
    (``rows``), then forks its blocks into those that go on (``settle``) and ends."""

    def __init__(
        self,
        requests: RequestTable,
        scheduler: Scheduler,
        blocks: BlockManager,
        kv_cache: KVCache,
    ) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.blocks = blocks
        self.kv_cache = kv_cache

    def add_request_n(
        self,
        prompt_id: RequestId,
        request_ids: Seq[RequestId],
        prompt_token_ids: list[int],
        params: Seq[SamplingParams],
        hold_kv: bool = False,
        share: Share = DEFAULT,
    ) -> None:
        """Queue one prompt for ``len(request_ids)`` choices; ``params[i]`` is choice i's;
        ``share``, who they are for (the order the prompt waits in).

        The prompt runs once under ``prompt_id``, which never appears in ``step()``'s outputs;
        each choice reports under its own id from token 0 on. ``hold_kv``: the prompt's KV is
        kept under ``prompt_id`` (``handoff.held_block_ids``, ``handoff.release``) once token
        0 is drawn. ``abort(choice)`` drops one choice (the prompt too if it was the last one
        computing); ``abort(prompt_id)`` drops the prompt and every choice still waiting for
        token 0.
        """
        check_choices(request_ids, len(params))
        if len(request_ids) > 1 and params[0].prompt_logprobs is not None:
            raise ValueError("prompt logprobs (echo, prompt_logprobs) are for one choice (n=1)")
        if (
            prompt_id in request_ids
            or prompt_id in self.requests
            or prompt_id in self.requests.held
        ):
            raise ValueError(f"request id {prompt_id!r} is already running")
        choices = [
            self.requests.new(rid, prompt_token_ids, p)
            for rid, p in zip(request_ids, params, strict=True)
        ]
        prompt = Sequence(prompt_id, list(prompt_token_ids), params[0], share=share)
        prompt.hold_kv = hold_kv
        prompt.choices = choices
        for seq in choices:
            seq.parent, seq.share = prompt, share
            self.requests.live[seq.request_id] = seq
        self.requests.admit(prompt)

    def rows(
        self, seqs: list[Sequence], logits: torch.Tensor
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

    def settle(self, seqs: list[Sequence]) -> None:
        """Prompts whose choices just drew token 0: the prompt leaves the queues (held, or
        freed), the choices that go on enter WAITING with blocks forked from it."""
        for prompt in seqs:
            if prompt.choices is None:
                continue
            going = [seq for seq in prompt.choices if not seq.is_finished]
            for seq in prompt.choices:
                seq.parent = None
            prompt.choices = None
            self.requests.live.pop(prompt.request_id, None)
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
            self.kv_cache.copy_blocks([s for s, _ in copies], [d for _, d in copies])
            for seq in reversed(going):  # next step, ahead of requests that came after them
                self.scheduler.add(seq, front=True)
            if prompt.hold_kv:
                self.requests.held[prompt.request_id] = prompt
            else:
                self.blocks.free_seq(prompt)

    def _fork_local(self, prompt: Sequence, seq: Sequence, copies: list[tuple[int, int]]) -> None:
        """A block for the partial tail if the prompt has one; none free: ``seq`` is left
        without blocks to be computed again from its tokens, as if it had been preempted."""
        tail = None
        if tail_tokens(prompt.num_tokens, self.blocks.block_size):
            try:
                [tail] = self.blocks.allocate_blocks(1)
            except NoFreeBlocks:
                seq.num_computed_tokens = seq.num_committed_blocks = 0
                seq.num_preemptions += 1
                return
        fork_blocks_into(self.blocks, prompt.block_table, prompt.num_tokens, seq, tail, copies)

    @staticmethod
    def dropped_with(seq: Sequence) -> list[RequestId]:
        """What goes with an aborted ``seq``: a prompt still computing takes its waiting
        choices with it; a waiting choice that was the prompt's last one takes the prompt."""
        if seq.choices is not None:
            return [c.request_id for c in seq.choices if not c.is_finished]
        if seq.parent is not None and all(c.is_finished for c in seq.parent.choices or []):
            return [seq.parent.request_id]
        return []


def fork_blocks_into(
    blocks: BlockManager,
    table: list[int],
    num_tokens: int,
    seq: Sequence,
    extra: int | None,
    copies: list[tuple[int, int]],
) -> None:
    """``seq`` shares the full blocks of ``num_tokens`` tokens of ``table``, then owns
    ``extra``: a copy of the partial block after them (``copies`` gets the pair), or, when
    there is none, the block for its next token."""
    full = full_blocks(num_tokens, blocks.block_size)
    blocks.share(table[:full])
    seq.block_table = table[:full]
    if extra is not None:
        if tail_tokens(num_tokens, blocks.block_size):
            copies.append((table[full], extra))
        seq.block_table.append(extra)


def check_choices(request_ids: Seq[RequestId], *lengths: int) -> None:
    """One id per choice, all different, and one entry per choice in every per-choice list."""
    if not request_ids:
        raise ValueError("at least one choice is needed")
    if len(set(request_ids)) != len(request_ids):
        raise ValueError(f"choice ids repeat: {request_ids}")
    if any(n != len(request_ids) for n in lengths):
        raise ValueError(f"{len(request_ids)} choices, but per-choice lists of lengths {lengths}")
