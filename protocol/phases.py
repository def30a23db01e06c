"""Where a request's time went: its phases, each measured by the role it passes through as a
duration on that role's own monotonic clock (machines' clocks differ: no timestamp ever
crosses a process), carried to the gateway on messages that flow anyway::

    gateway      gateway_queue      HTTP arrival → its Generate sent (body, template, tokens)
    coordinator  coordinator_wait   Generate in → PrefillJob out: held while its model had no
                                    worker (coordinator/holds.py), queued for decode blocks and
                                    reserving them                         (PrefillJob.phases)
    prefill      prefill_queue      PrefillJob in → the first step computing its prompt
                 prefill_compute    that step's start → token 0 sampled   (token 0's chunk,
                                    with coordinator_wait passed on)
                 kv_transfer        push started → the sender done          (TransferDone)
    decode       first_decode_step  TransferDone in → token 1's chunk  (its first chunk, with
                                    kv_transfer passed on)

Where one worker runs both phases (conditional disaggregation, a colocated pool) there is no
``kv_transfer`` and no ``coordinator_wait`` (not observed, rather than 0: nothing moves, no
blocks are waited for; but a request that was held has its hold as its coordinator_wait), its
token 0's chunk carries the prefill phases and
``first_decode_step`` runs from token 0 to token 1 on that worker. None overlaps another; what
none covers (the hops between roles, the HTTP layer before the request arrived and after its
last token) is the gap between their sum and a client's time. A choice asked of another decode
worker after a refusal or a timeout counts its coordinator_wait from then.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum

MAX_PHASE_S = 24 * 3600.0  # a worker's figure past this is not believed (numbers are bounded)


class Phase(StrEnum):
    GATEWAY_QUEUE = "gateway_queue"
    COORDINATOR_WAIT = "coordinator_wait"
    PREFILL_QUEUE = "prefill_queue"
    PREFILL_COMPUTE = "prefill_compute"
    KV_TRANSFER = "kv_transfer"
    FIRST_DECODE_STEP = "first_decode_step"


_NAMES = frozenset(p.value for p in Phase)


def checked(phases: Mapping[str, float] | None) -> dict[Phase, float]:
    """The phases a peer reported that are known, finite and within bounds (a negative one,
    from a clock stepping back mid-measure, as 0); anything else is dropped."""
    out: dict[Phase, float] = {}
    for name, seconds in (phases or {}).items():
        if name in _NAMES and math.isfinite(seconds) and seconds <= MAX_PHASE_S:
            out[Phase(name)] = max(0.0, float(seconds))
    return out
