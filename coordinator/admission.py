"""Admission: whether a request can be taken at all, and whether a choice no decode worker has
room for now may wait for one. Pure decisions over figures the coordinator reads from its
registry and route table."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.blocks import blocks_for

MAX_QUEUED = 4096  # choices waiting for decode blocks at once (the rest fail at once, 503)


@dataclass(frozen=True)
class AdmissionPolicy:
    """A request that can never fit fails at once (400, not worth retrying); a choice may wait
    for blocks only while the queue has room and some decode worker answers (else 503)."""

    max_queued: int = MAX_QUEUED

    def too_big(
        self,
        prompt_tokens: int,
        max_tokens: int,
        max_model_len: int,
        decode_blocks: int,
        block_size: int,
    ) -> str | None:
        """Why a prompt of ``prompt_tokens`` plus ``max_tokens`` can never run: beyond the
        model's context length ``max_model_len``, or the whole KV cache (``decode_blocks`` of
        ``block_size`` tokens) of its largest decode worker; None when it fits. 0 for either
        limit: not known (no worker said)."""
        tokens = prompt_tokens + max_tokens
        if max_model_len and tokens > max_model_len:
            return (
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds "
                f"the model's context length of {max_model_len} tokens"
            )
        if decode_blocks and blocks_for(tokens, block_size) > decode_blocks:
            return (
                f"the prompt plus max_tokens needs {tokens} tokens of KV cache, more than the "
                f"{decode_blocks * block_size} the largest decode worker holds"
            )
        return None

    def can_queue(self, queued: int, decoder_answers: bool) -> bool:
        """Whether one more choice may wait for decode blocks, with ``queued`` waiting already;
        ``decoder_answers``: some decode worker of its model takes work and is not silent."""
        return queued < self.max_queued and decoder_answers
