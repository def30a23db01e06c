"""The engine's hand-off part: the prefill side keeps KV for a transfer, the decode side takes
it in.

prefill worker                                  decode worker
add_request(hold_kv=True, max_tokens=1)         reserve(rid, prompt_len + 1) -> block ids
step() ... token 0 sampled, request finished      rid WAITING_FOR_REMOTE_KVS in the scheduler
held_block_ids(rid) -> push KV ───────────────▶ (KV lands in the reserved blocks)
release(rid)  (blocks stay in the prefix cache) add_prefilled(rid, prompt, token 0, params)
                                                  rid WAITING with those blocks; step() ...

Sent while the prompt still computes (a prefill worker's ``--kv-stream-chunks``): after a step,
``computed_blocks(rid)`` are final (later chunks write past them); those sent are ``pin``-ned
until ``release(rid)``, so a preempted prompt's freed blocks are not reused under a read.

n choices of one prompt (engine/fork.py): the prefill side runs it once and holds its KV under
the prompt's id; here ``reserve(..., choices=n)`` takes one more block for each choice past the
first and ``add_prefilled_n`` forks the received prompt into them.

A tensor-parallel group (engine/tp/staging.py) moves KV through rank 0's staging blocks: the
ids a sender reads are ``outgoing(rid, ids)``'s, those a receiver writes ``incoming(rid, ids)``'s;
alone they are the blocks themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from pdserve.engine.block_manager import BlockManager, KVCache
from pdserve.engine.fork import check_choices, fork_blocks_into
from pdserve.engine.requests import RequestTable
from pdserve.engine.scheduler import RequestId, Scheduler, Sequence
from pdserve.protocol.blocks import blocks_for, fork_blocks, full_blocks
from pdserve.protocol.messages import TokenLogprob
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.tenancy import DEFAULT, Share

if TYPE_CHECKING:
    from pdserve.engine.tp.staging import KVStaging

_NO_SAMPLING = SamplingParams()  # a reservation draws nothing; its successors have their own


class KVHandoff:
    """Owns KV that crosses workers, in the request table and the scheduler: finished prompts
    whose KV is ``held`` until sent (``held_block_ids``, ``release``), and reservations,
    sequences WAITING_FOR_REMOTE_KVS in the scheduler whose blocks another worker writes,
    taken over by the sequences decoding after token 0 (``add_prefilled``, ``add_prefilled_n``)
    or given back (``cancel_reservation``). Also starts requests recomputed here after their
    first tokens were drawn elsewhere (``add_continuation``)."""

    def __init__(
        self,
        requests: RequestTable,
        scheduler: Scheduler,
        blocks: BlockManager,
        kv_cache: KVCache,
        staging: Callable[[], KVStaging | None] = lambda: None,
    ) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.blocks = blocks
        self.kv_cache = kv_cache
        self.pinned: dict[RequestId, list[int]] = {}  # blocks sent while computing (``pin``)
        self._staging = staging  # a group's rank 0: its staging blocks (made on first use)
        self.staged_out: dict[RequestId, list[int]] = {}  # staging ids read by a sender
        # staging ids a receiver writes, and the reserved blocks they go to once landed
        self.staged_in: dict[RequestId, tuple[list[int], list[int]]] = {}

    # ---- staging (tensor-parallel groups) ----------------------------------------------------
    def outgoing(self, request_id: RequestId, block_ids: list[int]) -> list[int]:
        """The ids a sender reads for blocks ``block_ids`` of ``request_id``: the blocks
        themselves, or, in a group, staging blocks holding their whole KV now (given back
        by ``release``)."""
        staging = self._staging()
        if staging is None:
            return block_ids
        staged = staging.export(block_ids)
        self.staged_out.setdefault(request_id, []).extend(staged)
        return staged

    def incoming(self, request_id: RequestId, block_ids: list[int]) -> list[int]:
        """The ids a receiver writes for reserved blocks ``block_ids``: themselves, or, in a
        group, staging blocks whose KV ``add_prefilled`` gives every rank its heads of.
        ``NoFreeBlocks`` when the staging blocks are taken."""
        staging = self._staging()
        if staging is None or not block_ids:
            return block_ids
        staged = staging.take(len(block_ids))
        self.staged_in[request_id] = (staged, list(block_ids))
        return staged

    def _landed(self, request_id: RequestId) -> None:
        """A group's received KV into each rank's reserved blocks; its staging given back."""
        entry, staging = self.staged_in.pop(request_id, None), self._staging()
        if entry is not None and staging is not None:
            try:
                staging.import_(*entry)
            finally:
                staging.give(entry[0])

    def _unstage(self, request_id: RequestId) -> None:
        staging = self._staging()
        if staging is None:
            return
        staging.give(self.staged_out.pop(request_id, []))
        entry = self.staged_in.pop(request_id, None)
        if entry is not None:
            staging.give(entry[0])

    # ---- the prefill side -------------------------------------------------------------------
    def held_block_ids(self, request_id: RequestId) -> list[int]:
        """Blocks holding the finished prompt's KV, in token order."""
        return list(self.requests.held[request_id].block_table)

    def computed_blocks(self, request_id: RequestId) -> list[int]:
        """A prompt still computing: its leading full blocks whose every token's KV is
        computed, in token order (final: later chunks write past them); [] if not live."""
        seq = self.requests.live.get(request_id)
        if seq is None:
            return []
        return seq.block_table[: full_blocks(seq.num_computed_tokens, self.block_size)]

    def pin(self, request_id: RequestId, block_ids: Seq[int]) -> None:
        """One more reference to each block, for ``request_id`` until ``release``: KV sent
        while its prompt computes stays as it is until read, even if the prompt is preempted
        (its blocks freed) meanwhile."""
        self.blocks.share(block_ids)
        self.pinned.setdefault(request_id, []).extend(block_ids)

    def release(self, request_id: RequestId) -> bool:
        """Free a held request's blocks (full ones stay findable in the prefix cache) and its
        pinned ones (and a group's staging blocks); whether it was held."""
        self._unstage(request_id)
        self.blocks.free_blocks(self.pinned.pop(request_id, []))
        seq = self.requests.held.pop(request_id, None)
        if seq is None:
            return False
        self.blocks.free_seq(seq)
        return True

    # ---- the decode side: reservations ------------------------------------------------------
    def reserve(self, request_id: RequestId, num_tokens: int, choices: int = 1) -> list[int]:
        """Blocks for ``num_tokens`` tokens of KV that another worker will write, and one
        more for each choice past the first (``add_prefilled_n``).

        ``NoFreeBlocks`` when they are not free now; ``ValueError`` for a duplicate id.
        """
        self._check_new(request_id)
        ids = self.blocks.allocate_blocks(fork_blocks(num_tokens - 1, choices, self.block_size))
        self._wait_for_kvs(request_id, [], ids)
        return ids

    def reserve_prompt(
        self, request_id: RequestId, prompt_token_ids: list[int], choices: int = 1
    ) -> tuple[list[int], int]:
        """Blocks for a prompt's KV and token 0 (and one more for each choice past the first,
        as ``reserve``), where the leading full blocks this engine already holds in its
        prefix cache are shared rather than written again: the block ids, and how many
        leading ones are such hits (only the rest need the KV moved here).

        ``NoFreeBlocks`` when they are not free now; ``ValueError`` for a duplicate id.
        """
        self._check_new(request_id)
        needed = fork_blocks(len(prompt_token_ids), choices, self.block_size)
        hits = self.blocks.find_cached_blocks(prompt_token_ids)
        ids = self.blocks.allocate_blocks(needed - len(hits), hits)
        self._wait_for_kvs(request_id, prompt_token_ids, ids)
        self.scheduler.prefix_hit_tokens += len(hits) * self.block_size
        return ids, len(hits)

    def cancel_reservation(self, request_id: RequestId) -> bool:
        self._unstage(request_id)
        seq = self.scheduler.waiting_for_kvs.get(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        return True

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def _check_new(self, request_id: RequestId) -> None:
        if request_id in self.scheduler.waiting_for_kvs or request_id in self.requests:
            raise ValueError(f"request id {request_id!r} already has blocks here")

    def _wait_for_kvs(self, request_id: RequestId, prompt: list[int], ids: list[int]) -> None:
        seq = Sequence(request_id, list(prompt), _NO_SAMPLING)
        seq.block_table = ids
        self.scheduler.wait_for_kvs(seq)

    def _reserved(self, request_id: RequestId) -> Sequence:
        seq = self.scheduler.waiting_for_kvs.get(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} has no reserved blocks")
        return seq

    def _take_over(self, reservation: Sequence) -> list[int]:
        """The KV has landed: the reservation ends, its blocks go to what decodes from it."""
        self.scheduler.finish(reservation, free=False)
        ids, reservation.block_table = reservation.block_table, []
        return ids

    # ---- the decode side: starting to decode ------------------------------------------------
    def add_prefilled(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        first_logprob: TokenLogprob | None = None,
        num_cached_tokens: int = 0,
        share: Share = DEFAULT,
    ) -> None:
        """Start decoding a request whose prompt KV now sits in its reserved blocks (``share``:
        who it is for, the order it waits in).

        Token 0 was sampled (and reported) by the prefill worker; outputs start at token 1.
        ``num_cached_tokens``: prompt tokens a prefix cache served (the prefill worker's, or
        this engine's through ``reserve_prompt``), what the outputs report.
        """
        reservation = self._reserved(request_id)
        self._landed(request_id)
        try:
            seq = self.requests.continued(request_id, prompt_token_ids, [first_token], params)
        except ValueError:
            self.cancel_reservation(request_id)
            raise
        seq.block_table = self._take_over(reservation)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = num_cached_tokens
        seq.share = share
        if first_logprob is not None:
            seq.output_logprobs.append(first_logprob)
        self.requests.admit_continued(seq)

    def add_prefilled_n(
        self,
        reservation_id: RequestId,
        request_ids: Seq[RequestId],
        prompt_token_ids: list[int],
        first_tokens: Seq[int],
        params: Seq[SamplingParams],
        first_logprobs: Seq[TokenLogprob | None] | None = None,
        num_cached_tokens: int = 0,
        share: Share = DEFAULT,
    ) -> None:
        """Start decoding ``len(request_ids)`` choices of a prompt whose KV now sits in the
        leading ``blocks_for(len(prompt))`` blocks of ``reservation_id``'s reservation.

        Choice i continues after ``first_tokens[i]`` (sampled, and reported, by the prefill
        worker) with ``params[i]``; outputs start at token 1. The reservation needs
        ``fork_blocks(len(prompt), n)`` blocks (``reserve(..., choices=n)``); blocks past that
        (choices aborted meanwhile) are freed. ``ValueError`` frees all of them.
        ``num_cached_tokens`` and ``share`` as for ``add_prefilled``, the same for every choice.
        """
        reservation = self._reserved(reservation_id)
        self._landed(reservation_id)
        num_tokens = len(prompt_token_ids)
        needed = fork_blocks(num_tokens, len(request_ids), self.block_size)
        logprobs = first_logprobs or [None] * len(request_ids)
        try:
            check_choices(request_ids, len(params), len(first_tokens), len(logprobs))
            if len(reservation.block_table) < needed:
                raise ValueError(
                    f"{len(request_ids)} choices of a {num_tokens}-token prompt need {needed} "
                    f"reserved blocks, {reservation_id!r} has {len(reservation.block_table)}"
                )
            seqs = [
                self.requests.continued(rid, prompt_token_ids, [token], p)
                for rid, token, p in zip(request_ids, first_tokens, params, strict=True)
            ]
        except ValueError:
            self.cancel_reservation(reservation_id)
            raise
        ids = self._take_over(reservation)
        self.blocks.free_blocks(ids[needed:])
        own = blocks_for(num_tokens + 1, self.block_size)
        copies: list[tuple[int, int]] = []
        for i, seq in enumerate(seqs):
            if i == 0:
                seq.block_table = ids[:own]
            else:
                fork_blocks_into(self.blocks, ids, num_tokens, seq, ids[own + i - 1], copies)
            seq.num_computed_tokens = num_tokens
            seq.num_cached_tokens = num_cached_tokens
            seq.share = share
        self.kv_cache.copy_blocks([s for s, _ in copies], [d for _, d in copies])
        for seq, lp in zip(seqs, logprobs, strict=True):
            if lp is not None:
                seq.output_logprobs.append(lp)
            self.requests.admit_continued(seq)

    def add_continuation(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        generated: list[int],
        params: SamplingParams,
        share: Share = DEFAULT,
    ) -> None:
        """Take over a request whose first ``generated`` tokens were produced elsewhere: the
        prompt and those tokens are computed again here (after a failed KV transfer, or when
        a request moves off a dead worker), and outputs continue at ``len(generated)``;
        ``share`` as for ``add_prefilled``."""
        self.cancel_reservation(request_id)
        seq = self.requests.continued(request_id, prompt_token_ids, generated, params)
        seq.share = share
        self.requests.admit_continued(seq)
