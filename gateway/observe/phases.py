"""Where each request's time went: ``pdserve_request_phase_seconds{model,phase}`` (the phases
are ``protocol.phases``'s). The gateway measures its own (gateway_queue); the others come on
the chunks that carry them (token 0's from the prefill worker, with the coordinator's; the
first decoded one's from the decode worker). Observed once per request, for its first prompt's
choice 0, when it succeeded."""

from __future__ import annotations

from pdserve.gateway.observe.prometheus import Histogram, Registry
from pdserve.protocol import messages as m
from pdserve.protocol.phases import Phase, checked

PHASE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class PhaseMetrics:
    """The histogram of every request's phases."""

    def __init__(self, r: Registry) -> None:
        self.seconds = r.add(
            Histogram(
                "pdserve_request_phase_seconds",
                "Where a request's time went, by phase: gateway_queue (HTTP arrival to its "
                "request sent), coordinator_wait (held while its model had no worker, queued for "
                "decode blocks and reserving them), "
                "prefill_queue, prefill_compute (to token 0), kv_transfer (the push after it), "
                "first_decode_step (to token 1). No kv_transfer where one worker ran both phases, "
                "nor coordinator_wait unless it was held.",
                PHASE_BUCKETS,
                ["model", "phase"],
            )
        )


class RequestPhases:
    """One request's phases so far (``metrics`` None: nothing is kept)."""

    def __init__(self, metrics: PhaseMetrics | None, model: str) -> None:
        self._metrics = metrics
        self._model = model
        self.seconds: dict[Phase, float] = {}

    def measured(self, phase: Phase, seconds: float) -> None:
        """One the gateway measured itself."""
        if self._metrics is not None:
            self.seconds[phase] = max(0.0, seconds)

    def reported(self, chunk: m.TokenChunk) -> None:
        """What a worker's chunk of choice 0 carries (checked: known, finite, bounded)."""
        if self._metrics is not None and chunk.phases and chunk.choice == 0:
            self.seconds.update(checked(chunk.phases))

    def observe(self) -> None:
        """Into the histogram, once."""
        if self._metrics is None:
            return
        for phase, seconds in self.seconds.items():
            self._metrics.seconds.observe(seconds, model=self._model, phase=phase.value)
        self._metrics = None
