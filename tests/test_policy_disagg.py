"""coordinator.policies, ConditionalDisaggPolicy: which prompts are prefilled where they
decode, exact, from the figures alone (no cluster, no coordinator)."""

from __future__ import annotations

import pytest

from pdserve.coordinator.policies import ConditionalDisaggPolicy, LocalReason

SHORT, BUSY = LocalReason.SHORT_PROMPT, LocalReason.PREFILL_BUSY


@pytest.mark.parametrize(
    ("max_local", "max_queue", "prompt", "cached", "queued", "want"),
    [
        (0, 0, 1, 0, 10**9, None),  # both rules off (the default)
        (16, 0, 16, 0, None, SHORT),  # at the limit
        (16, 0, 17, 0, None, None),  # one past it
        (12, 0, 53, 44, None, SHORT),  # a long history its decode worker holds: 9 to compute
        (12, 0, 53, 40, None, None),  # 13 to compute
        (16, 0, 0, 0, None, None),  # an empty prompt is never "short"
        (0, 100, 30, 0, 101, BUSY),  # every prefill queue is longer than 100 tokens
        (0, 100, 30, 0, 100, None),  # not longer
        (0, 100, 30, 0, None, None),  # no prefill worker answers: nothing to compare
        (16, 100, 10, 0, 500, SHORT),  # both hold: the short prompt is named
        (16, 100, 40, 0, 500, BUSY),
    ],
)
def test_the_reason_or_none(max_local, max_queue, prompt, cached, queued, want) -> None:
    policy = ConditionalDisaggPolicy(max_local, max_queue)
    assert policy.enabled == (max_local > 0 or max_queue > 0)
    got = policy.reason(
        prompt_tokens=prompt, decode_cached_tokens=cached, prefill_queue_tokens=queued
    )
    assert got is want


def test_reasons_are_the_metric_labels_and_thresholds_are_checked() -> None:
    reasons = ["local_short_prompt", "local_prefill_busy", "local_no_prefill"]
    assert [r.value for r in LocalReason] == reasons
    for bad in ((-1, 0), (0, -1)):
        with pytest.raises(ValueError, match="thresholds must be >= 0"):
            ConditionalDisaggPolicy(*bad)
