"""The workers' speculative decoding on ``/metrics`` (``SpecMetrics``, a part of
``metrics.ClusterMetrics``): each worker's ``SpecCounters`` as it last reported them; nothing
for a worker whose mode is "off". engine/spec/ is what drafts and verifies."""

from __future__ import annotations

from pdserve.gateway.observe.prometheus import Counter, Gauge, Registry
from pdserve.protocol.control import SPEC_STEP_REASONS, SpecCounters

_POSITION_HELP = (
    'by draft position ("1": the first draft of a sequence in a step, "2" the second, ...; a '
    "draft is reached only when every one before it was accepted)"
)


class SpecMetrics:
    """Owns the speculative-decoding metrics of every worker; ``clear`` then ``set`` each
    worker at each render (a worker that left disappears)."""

    def __init__(self, r: Registry) -> None:
        worker = ["role", "worker"]
        by_position = [*worker, "position"]
        self.drafted = r.add(
            Counter(
                "pdserve_worker_spec_drafted_tokens_total",
                f"Draft tokens the worker's target model verified, {_POSITION_HELP}.",
                by_position,
            )
        )
        self.accepted = r.add(
            Counter(
                "pdserve_worker_spec_accepted_tokens_total",
                f"Draft tokens the target model accepted, {_POSITION_HELP}. Accepted over "
                "pdserve_worker_spec_drafted_tokens_total at one position is its conditional "
                "acceptance rate: a rate falling fast with the position says shorter drafts "
                "would waste less.",
                by_position,
            )
        )
        self.steps = r.add(
            Counter(
                "pdserve_worker_spec_steps_total",
                "Engine steps carrying decodes, by whether they verified drafts: speculated "
                "(they did), no_drafts (no decoding sequence had a proposal), not_worth (the "
                "step-time model priced the verification above the tokens it expected: large "
                "batches, low acceptance), no_room (the step's token budget or free KV blocks "
                "left no slots for drafts), switched_off (the worker's switch is off).",
                ["role", "worker", "reason"],
            )
        )
        self.draft_tokens = r.add(
            Counter(
                "pdserve_worker_spec_draft_tokens_total",
                "Tokens the worker's draft model computed (catching up on prompts and "
                "accepted tokens, and drafting): its cost beside the target's.",
                worker,
            )
        )
        self.draft_prompt_tokens = r.add(
            Counter(
                "pdserve_worker_spec_draft_prompt_tokens_total",
                "Of pdserve_worker_spec_draft_tokens_total, prompt tokens: 0 on a decode worker "
                "whose prompts' draft KV came with the target's from a prefill worker.",
                worker,
            )
        )
        self.acceptance_rate = r.add(
            Gauge(
                "pdserve_worker_spec_acceptance_rate",
                "Draft tokens accepted over draft tokens verified, all positions, since the "
                "worker started; absent: it has verified none. Low: drafts cost verification "
                "rows that bring few tokens, and steps go not_worth (see "
                "pdserve_worker_spec_steps_total).",
                worker,
            )
        )
        self.mode = r.add(
            Gauge(
                "pdserve_worker_speculative_mode",
                "1 for the worker's speculative decoding mode (ngram: prompt lookup, drafts from "
                "the sequence's prompt and output so far; draft: from a draft model); absent: "
                "the worker does not speculate.",
                ["role", "worker", "mode"],
            )
        )

    def clear(self) -> None:
        for metric in (
            self.drafted,
            self.accepted,
            self.steps,
            self.draft_tokens,
            self.draft_prompt_tokens,
            self.acceptance_rate,
            self.mode,
        ):
            metric.clear()

    def set(self, spec: SpecCounters, role: str, worker: str) -> None:
        """One worker's speculative decoding, as it last reported it (the coordinator checked
        its shapes: ``coordinator.counter_checks``); nothing when its mode is "off"."""
        if spec.mode == "off":
            return
        labels = {"role": role, "worker": worker}
        self.mode.set(1, mode=spec.mode, **labels)
        positions = zip(spec.drafted, spec.accepted, strict=True)
        for position, (drafted, accepted) in enumerate(positions, start=1):
            self.drafted.inc(drafted, position=str(position), **labels)
            self.accepted.inc(accepted, position=str(position), **labels)
        # every reason shown, at 0 until a step counts for it
        for reason, count in (dict.fromkeys(SPEC_STEP_REASONS, 0) | spec.steps).items():
            self.steps.inc(count, reason=reason, **labels)
        self.draft_tokens.inc(spec.draft_tokens, **labels)
        self.draft_prompt_tokens.inc(spec.draft_prompt_tokens, **labels)
        if sum(spec.drafted) > 0:
            self.acceptance_rate.set(sum(spec.accepted) / sum(spec.drafted), **labels)
