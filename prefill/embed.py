"""Embed worker: a prefill-only worker of an embedding model (``pdserve prefill --model`` of a
sentence-transformers directory). No KV is kept and no decode pool is involved: each step
takes the requests waiting, oldest first, up to a token budget, runs their inputs as one
packed batch, and answers each gateway itself.

    Embed ─▶ waiting ─step (one batch)─▶ EmbedResult to the gateway, Finished to the
               │                          coordinator
               └─ Abort: dropped     (a bad input: RequestError to both)
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid
from collections import deque

import numpy as np

from pdserve.engine.embed.model import EmbeddingModel
from pdserve.protocol import messages as m
from pdserve.protocol.control import Heartbeat, KVLayout, Register, WorkerCounters, WorkerLoad
from pdserve.runtime.loop import PushOutbox

logger = logging.getLogger(__name__)

STEP_TOKENS = 8192  # tokens a step takes (more only when one request alone has more)


class EmbedWorker:
    """The requests waiting (``waiting``, in arrival order) and the model that embeds them."""

    def __init__(self, model: EmbeddingModel, worker_id: str, outbox: PushOutbox) -> None:
        self.model = model
        self.worker_id = worker_id
        self.outbox = outbox
        self.waiting: deque[m.Embed] = deque()
        self.draining = False
        self.embedded_tokens = 0

    def handle(self, msg: m.Message) -> None:
        if isinstance(msg, m.Embed):
            self.waiting.append(msg)
        elif isinstance(msg, m.Abort):
            self.waiting = deque(e for e in self.waiting if e.request_id != msg.request_id)
        else:
            logger.warning("embed worker ignores %s", type(msg).__name__)

    def step(self) -> bool:
        """One batch: the oldest waiting requests within ``STEP_TOKENS`` (one at least)."""
        if not self.waiting:
            return False
        batch, tokens = [self.waiting.popleft()], 0
        tokens = _tokens(batch[0])
        while self.waiting and tokens + _tokens(self.waiting[0]) <= STEP_TOKENS:
            tokens += _tokens(self.waiting[0])
            batch.append(self.waiting.popleft())
        inputs = [ids for e in batch for ids in e.inputs]
        try:
            vectors = self.model.embed(inputs).numpy().astype("<f4")  # [N, dim]
        except ValueError:  # some input is bad: each request alone, so only its own fails
            for e in batch:
                self._one(e)
            return True
        row = 0
        for e in batch:
            self._answer(e, vectors[row : row + len(e.inputs)])
            row += len(e.inputs)
        return True

    def _one(self, e: m.Embed) -> None:
        try:
            vectors = self.model.embed(e.inputs).numpy().astype("<f4")
        except ValueError as error:
            logger.warning("embedding request %s failed: %s", e.request_id, error)
            failed = m.RequestError(request_id=e.request_id, status=400, message=str(error))
            self.outbox.to_gateway(e.stream_address, failed)
            self.outbox.to_coordinator(failed)
            return
        self._answer(e, vectors)

    def _answer(self, e: m.Embed, vectors: np.ndarray) -> None:
        tokens = _tokens(e)
        self.embedded_tokens += tokens
        result = m.EmbedResult(
            request_id=e.request_id,
            dim=int(vectors.shape[1]),
            vectors=np.ascontiguousarray(vectors).tobytes(),
            num_tokens=tokens,
        )
        self.outbox.to_gateway(e.stream_address, result)
        done = m.Finished(request_id=e.request_id, choice=0, worker_id=self.worker_id)
        self.outbox.to_coordinator(done)

    # ---- what the process loop and the coordinator read ---------------------------------------
    def begin_drain(self) -> None:
        self.draining = True

    def in_flight(self) -> bool:
        return bool(self.waiting)

    def heartbeat(self) -> Heartbeat:
        queued = sum(_tokens(e) for e in self.waiting)
        load = WorkerLoad(
            free_blocks=1,
            used_blocks=0,
            total_blocks=1,
            running=0,
            waiting=len(self.waiting),
            queued_prompt_tokens=queued,
            draining=self.draining,
        )
        counters = WorkerCounters(prefill_tokens=self.embedded_tokens)  # its work, in tokens
        return Heartbeat(worker_id=self.worker_id, load=load, counters=counters)


def _tokens(e: m.Embed) -> int:
    return sum(len(ids) for ids in e.inputs)


def embed_register(
    args: argparse.Namespace, model: EmbeddingModel, worker_id: str, control_address: str
) -> Register:
    """What an embed worker tells the coordinator: role ``embed``; its "layout" only names
    the model's shape (no KV moves to or from it)."""
    path = os.path.abspath(args.model)
    layout = KVLayout(
        block_size=1,
        dtype="float32",
        num_layers=1,
        num_kv_heads=1,
        head_dim=model.dim,
        weights=f"embedding {model.kind}",
    )
    return Register(
        role="embed",
        worker_id=worker_id,
        model=args.served_model_name or os.path.basename(os.path.normpath(path)),
        control_address=control_address,
        transfer_address="",
        transfer_backend=args.transfer_backend,
        layout=layout,
        num_blocks=1,
        model_root=path,
        max_model_len=model.max_seq_len,
    )


def new_worker_id(args: argparse.Namespace) -> str:
    return str(args.worker_id or f"embed-{uuid.uuid4().hex[:8]}")
