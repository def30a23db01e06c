"""How a prefill job's KV goes to its decode worker (``KVOffers``): as one transfer once its
prompt is done, or, with ``--kv-stream-chunks`` (a sender that takes parts: nixl), in parts as
its chunks complete, so that the decode worker reads while later chunks compute::

    engine step, chunk 1 ─▶ part 0: blocks [skip, f1)    ┐ read while the prompt
    engine step, chunk 2 ─▶ part 1: blocks [f1, f2)      ┘ still computes
    token 0 sampled      ─▶ part k, last: [fk, all)      every part read: the sender is DONE

``skip``: the leading blocks the decode worker holds already (``PrefillJob.skip_blocks``), never
moved. A part's blocks are pinned in the engine (``KVHandoff.pin``) until the job's KV is
released, so a prompt preempted meanwhile does not give them up for reuse under a read. A part
that cannot go ends the streaming of its job: what is left goes with the last part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.engine.engine import LLMEngine
from pdserve.engine.scheduler import RequestId
from pdserve.kvtransfer.base import KVSender, TransferSpec
from pdserve.protocol import messages as m
from pdserve.protocol.blocks import blocks_for
from pdserve.worker.wire import TransferStats, block_bytes

logger = logging.getLogger(__name__)


@dataclass
class Offered:
    """What a job offered before its last part: blocks up to position ``upto`` (of its
    prompt's), in ``parts`` offers; ``stopped``: no more until the last."""

    upto: int = 0
    parts: int = 0
    stopped: bool = False


class KVOffers:
    """Owns turning a job's blocks into transfer specs and handing them to the sender: at once
    when its prompt is done (``final``), or also in parts while it computes (``partial``, when
    ``stream``)."""

    def __init__(
        self,
        engine: LLMEngine,
        sender: KVSender,
        timeout_s: float,
        stats: TransferStats,
        stream: bool = False,
    ) -> None:
        if stream and not sender.sends_parts:
            raise ValueError(
                f"--kv-stream-chunks needs a transfer backend that sends in parts (nixl); "
                f"{type(sender).__name__} does not"
            )
        self.engine = engine
        self.sender = sender
        self.timeout_s = timeout_s
        self.stats = stats
        self.stream = stream
        self._block_bytes = block_bytes(engine)

    def partial(self, job: m.PrefillJob, held_id: RequestId, rid: str, offered: Offered) -> None:
        """Offer the blocks the job's prompt completed since its last offer, if any."""
        if not self.stream or offered.stopped:
            return
        done = self.engine.handoff.computed_blocks(held_id)
        start = max(offered.upto, self._skip(job))
        if len(done) <= start:
            return
        try:
            self.engine.handoff.pin(held_id, done[start:])  # reads may start at once
            src = self.engine.handoff.outgoing(held_id, done[start:])
            spec = self._spec(job, rid, src, start)
            self.sender.send_part(spec, self.engine.status.kv_layers, last=False)
        except Exception as e:  # the rest goes with the last part (or fails there)
            logger.warning("transfer %s: no more parts before the last: %s", rid, e)
            offered.stopped = True
            return
        offered.upto, offered.parts = len(done), offered.parts + 1
        self.stats.started(len(spec.src_block_ids), self._block_bytes)

    def final(self, job: m.PrefillJob, held_id: RequestId, rid: str, offered: Offered) -> None:
        """Offer what is left of the job's blocks now that its prompt is done: the whole
        transfer, or its last part. Raises what building the spec or the sender raises."""
        src = self.engine.handoff.held_block_ids(held_id)
        start = max(offered.upto, self._skip(job))
        spec = self._spec(job, rid, self.engine.handoff.outgoing(held_id, src[start:]), start)
        self.stats.started(len(spec.src_block_ids), self._block_bytes)
        if offered.parts:
            self.sender.send_part(spec, self.engine.status.kv_layers, last=True)
        else:
            self.sender.send(spec, self.engine.status.kv_layers)

    def _skip(self, job: m.PrefillJob) -> int:
        """Leading blocks the decode worker holds (its prefix cache); never the last one."""
        prompt_blocks = blocks_for(len(job.prompt_token_ids), self.engine.status.block_size)
        return min(max(job.skip_blocks, 0), prompt_blocks - 1)

    def _spec(self, job: m.PrefillJob, rid: str, src: list[int], start: int) -> TransferSpec:
        """Blocks ``src`` of the prompt, from block position ``start`` on."""
        return TransferSpec(
            request_id=rid,
            src_block_ids=src,
            dst_block_ids=job.dst_block_ids[start : start + len(src)],
            address=job.transfer_address,
            timeout_s=self.timeout_s,
            secret=job.transfer_secret,
        )
