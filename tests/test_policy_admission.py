"""coordinator.policies, AdmissionPolicy: which requests can never run (400) and when a choice
may wait for decode blocks (else 503), exact, from the figures alone."""

from __future__ import annotations

from pdserve.coordinator.policies import MAX_QUEUED, AdmissionPolicy

POLICY = AdmissionPolicy(max_queued=2)


def too_big(prompt: int, max_tokens: int, max_len: int = 256, blocks: int = 4) -> str | None:
    return POLICY.too_big(
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        max_model_len=max_len,
        decode_blocks=blocks,
        block_size=16,
    )


def test_a_request_past_the_context_length_never_fits() -> None:
    assert too_big(250, 6, blocks=100) is None  # 256: at the limit
    assert too_big(251, 6, blocks=100) == (
        "the prompt (251 tokens) plus max_tokens (6) exceeds the model's context length of "
        "256 tokens"
    )
    assert too_big(1000, 6, max_len=0, blocks=100) is None  # no length known: not checked


def test_a_prompt_past_the_largest_decode_cache_never_fits() -> None:
    # max_tokens books no KV (a sequence grows as it decodes): only the prompt and the slot
    # of its token 0 must fit, 64 tokens in 4 blocks of 16
    assert too_big(63, 150) is None
    assert too_big(64, 4) == (
        "the prompt (64 tokens, 1 choice(s)) needs 80 tokens of KV cache, more than the 64 the "
        "largest decode worker holds"
    )
    assert too_big(64, 5, blocks=0) is None  # no decode worker known: not checked
    three = POLICY.too_big(
        prompt_tokens=40, max_tokens=1, max_model_len=256, decode_blocks=4, block_size=16, choices=3
    )
    assert three is not None and "(40 tokens, 3 choice(s)) needs 80 tokens" in three


def test_a_choice_waits_while_the_queue_has_room_and_a_decoder_answers() -> None:
    assert AdmissionPolicy().max_queued == MAX_QUEUED == 4096
    assert POLICY.can_queue(queued=0, decoder_answers=True)
    assert POLICY.can_queue(queued=1, decoder_answers=True)
    assert not POLICY.can_queue(queued=2, decoder_answers=True)  # full
    assert not POLICY.can_queue(queued=0, decoder_answers=False)  # no one to wait for
