"""Engine calls for disaggregation: the prefill side hands KV off, the decode side takes it in.

prefill worker                                  decode worker
add_request(hold_kv=True, max_tokens=1)         reserve(rid, prompt_len + 1) -> block ids
step() ... token 0 sampled, request finished    .
held_block_ids(rid) -> push KV ───────────────▶ (KV lands in the reserved blocks)
release(rid)  (blocks stay in the prefix cache) add_prefilled(rid, prompt, token 0, params)
                                                step() ... tokens 1..n
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.grammar import advance
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.protocol.blocks import fork_blocks
from pdserve.protocol.messages import TokenLogprob
from pdserve.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


class KVHandoffMixin:
    """Mixed into ``LLMEngine``; state lives in its ``held`` and ``reserved`` dicts."""

    def held_block_ids(self: LLMEngine, request_id: str) -> list[int]:
        """Blocks holding the finished prompt's KV, in token order."""
        return list(self.held[request_id].block_table)

    def release(self: LLMEngine, request_id: str) -> bool:
        """Free a held request's blocks (full ones stay findable in the prefix cache)."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free_seq(seq)
        return True

    def reserve(self: LLMEngine, request_id: str, num_tokens: int, choices: int = 1) -> list[int]:
        """Blocks for ``num_tokens`` tokens of KV that another worker will write, and one
        more for each choice past the first (engine/fork.py ``add_prefilled_n``).

        ``NoFreeBlocks`` when they are not free now; ``ValueError`` for a duplicate id.
        """
        if request_id in self.reserved or request_id in self.requests:
            raise ValueError(f"request id {request_id!r} already has blocks here")
        if choices < 1:
            raise ValueError(f"choices must be at least 1, got {choices}")
        n = fork_blocks(num_tokens - 1, choices, self.block_manager.block_size)
        ids = self.block_manager.allocate_blocks(n)
        self.reserved[request_id] = ids
        return ids

    def reserve_prompt(
        self: LLMEngine, request_id: str, prompt_token_ids: list[int], choices: int = 1
    ) -> tuple[list[int], int]:
        """Blocks for a prompt's KV and token 0 (and one more for each choice past the first,
        as ``reserve``), where the leading full blocks this engine already holds in its
        prefix cache are shared rather than written again: the block ids, and how many
        leading ones are such hits (only the rest need the KV moved here).

        ``NoFreeBlocks`` when they are not free now; ``ValueError`` for a duplicate id.
        """
        if request_id in self.reserved or request_id in self.requests:
            raise ValueError(f"request id {request_id!r} already has blocks here")
        if choices < 1:
            raise ValueError(f"choices must be at least 1, got {choices}")
        bm = self.block_manager
        hits = bm.find_cached_blocks(prompt_token_ids)
        fresh = self.fork_blocks_needed(len(prompt_token_ids), choices) - len(hits)
        ids = bm.allocate_blocks(fresh, hits)
        self.reserved[request_id] = ids
        self.scheduler.prefix_hit_tokens += len(hits) * bm.block_size
        return ids, len(hits)

    def cancel_reservation(self: LLMEngine, request_id: str) -> bool:
        ids = self.reserved.pop(request_id, None)
        if ids is None:
            return False
        self.block_manager.free_blocks(ids)
        return True

    def add_prefilled(
        self: LLMEngine,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        first_logprob: TokenLogprob | None = None,
        num_cached_tokens: int = 0,
    ) -> None:
        """Start decoding a request whose prompt KV now sits in its reserved blocks.

        Token 0 was sampled (and reported) by the prefill worker; outputs start at token 1.
        ``num_cached_tokens``: prompt tokens a prefix cache served (the prefill worker's, or
        this engine's through ``reserve_prompt``), what the outputs report.
        """
        if request_id not in self.reserved:
            raise ValueError(f"request {request_id!r} has no reserved blocks")
        try:
            seq = self._continued(request_id, prompt_token_ids, [first_token], params)
        except ValueError:
            self.cancel_reservation(request_id)
            raise
        seq.block_table = self.reserved.pop(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = num_cached_tokens
        if first_logprob is not None:
            seq.output_logprobs.append(first_logprob)
        self._admit_continued(seq)

    def add_continuation(
        self: LLMEngine,
        request_id: str,
        prompt_token_ids: list[int],
        generated: list[int],
        params: SamplingParams,
    ) -> None:
        """Take over a request whose first ``generated`` tokens were produced elsewhere: the
        prompt and those tokens are computed again here (after a failed KV transfer, or when
        a request moves off a dead worker), and outputs continue at ``len(generated)``."""
        self.cancel_reservation(request_id)
        seq = self._continued(request_id, prompt_token_ids, generated, params)
        self._admit_continued(seq)

    def _continued(
        self: LLMEngine,
        request_id: str,
        prompt_token_ids: list[int],
        generated: list[int],
        params: SamplingParams,
    ) -> Sequence:
        if not generated:
            raise ValueError("a continued request needs at least one generated token")
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        seq.token_ids.extend(generated)
        seq.num_returned_tokens = len(generated)
        if seq.matcher is not None:
            advance(seq.matcher, generated)  # the constraint resumes where they left it
        if seq.generator is not None and not params.greedy:
            # each earlier token drew once from this seed elsewhere; stay in step with it
            for _ in generated:
                self.sampler.skip_draw(seq.generator, self.model_config.vocab_size)
        return seq

    def _admit_continued(self: LLMEngine, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self._check_finish(seq, seq.last_token_id)
        if seq.status is SequenceStatus.FINISHED:
            self._final_outputs.append(seq)  # reported, with its finish reason, next step
