"""An in-process cluster: the real coordinator and workers, messages delivered by a loop.

No control sockets (KV still moves over a real transfer backend on loopback), so tests can
step everything deterministically and inspect every engine.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pdserve.coordinator.coordinator import Coordinator
from pdserve.decode.worker import DecodeWorker
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_events import KVEventPublisher
from pdserve.kvtransfer import make_receiver, make_sender
from pdserve.kvtransfer.base import KVReceiver, KVSender
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.prefill.worker import PrefillWorker
from pdserve.protocol import messages as m
from pdserve.protocol.control import Register
from pdserve.protocol.transfer import KVPeers
from pdserve.worker.wire import heartbeat, kv_layout


@dataclass
class Bus:
    """Queues of (destination, message); destinations: 'coordinator', worker ids, gateways."""

    queue: deque = field(default_factory=deque)
    gateway: dict[str, list[m.Message]] = field(default_factory=dict)

    def outbox(self) -> _Outbox:
        return _Outbox(self)


class _Outbox:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    def to_coordinator(self, msg: m.Message) -> None:
        self.bus.queue.append(("coordinator", m.decode(m.encode(msg))))

    def to_gateway(self, address: str, msg: m.Message) -> None:
        self.bus.gateway.setdefault(address, []).append(m.decode(m.encode(msg)))

    def to_worker(self, worker_id: str, address: str, msg: m.Message) -> None:
        self.bus.queue.append((worker_id, m.decode(m.encode(msg))))

    def forget_worker(self, worker_id: str) -> None:
        pass


class Cluster:
    def __init__(
        self,
        engines_p: list[LLMEngine],
        engines_d: list[LLMEngine],
        backend: str = "zmq",
        colocated: bool = False,
        fault: FaultPlan | None = None,
        policy: str = "recompute",
        transfer_timeout_s: float = 30.0,
        stream_chunks: bool = False,  # prefill workers offer KV chunk by chunk (nixl)
        **coordinator_options: Any,
    ) -> None:
        self.bus = Bus()
        self.backend = backend
        self.coordinator = Coordinator(self.bus.outbox(), **coordinator_options)
        self.workers: dict[str, PrefillWorker | DecodeWorker] = {}
        self.kv_events: dict[str, KVEventPublisher] = {}  # sent by ``heartbeats``
        for i, engine in enumerate(engines_p):
            wid = f"p{i}"
            options: dict[str, Any] = {"fault": fault} if fault is not None else {}
            if backend == "nixl":  # a one-sided transport registers the cache up front
                options["kv_layers"] = engine.status.kv_layers
            sender = make_sender(backend, checksum=True, **options)
            self.workers[wid] = PrefillWorker(
                engine, sender, wid, self.bus.outbox(), transfer_timeout_s, stream_chunks
            )
            self._register(wid, "prefill", engine, "", sender)
        for i, engine in enumerate(engines_d):
            wid = f"d{i}"
            receiver = (
                None
                if colocated
                else make_receiver(backend, engine.status.kv_layers, require_checksum=True)
            )
            self.workers[wid] = DecodeWorker(
                engine, receiver, wid, self.bus.outbox(), transfer_timeout_s, policy
            )
            address = receiver.address if receiver else ""
            self._register(wid, "both" if colocated else "decode", engine, address, receiver)

    def _register(
        self,
        wid: str,
        role: str,
        engine: LLMEngine,
        transfer: str,
        transport: KVSender | KVReceiver | None,
    ) -> None:
        self.kv_events[wid] = KVEventPublisher(engine.block_manager, wid)
        self.coordinator.handle(
            Register(
                role=role,
                worker_id=wid,
                model="tiny",
                control_address=f"inproc://{wid}",
                transfer_address=transfer,
                transfer_backend=self.backend,
                layout=kv_layout(engine),
                num_blocks=engine.block_manager.num_blocks,
                model_root="/models/tiny",
                max_model_len=engine.max_model_len,
                kv_regions=None if transport is None else transport.regions,
            ),
            time.monotonic(),
        )

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        spec: m.SamplingParams,
        n: int = 1,
        gateway: str = "gw",
    ) -> None:
        self.bus.queue.append(
            (
                "coordinator",
                m.Generate(
                    request_id=request_id,
                    model="tiny",
                    prompt_token_ids=prompt,
                    sampling=spec,
                    n=n,
                    stream_address=gateway,
                ),
            )
        )

    def deliver_next(self) -> None:
        dest, msg = self.bus.queue.popleft()
        if dest == "coordinator":
            self.coordinator.handle(msg, time.monotonic())
        elif isinstance(msg, KVPeers):  # as worker.process does: the transport's, not the worker's
            transport = self.transport(dest)
            if transport is not None:
                transport.update_peers([(p.worker_id, p.regions) for p in msg.added], msg.gone)
        else:
            self.workers[dest].handle(msg)

    def transport(self, wid: str) -> KVSender | KVReceiver | None:
        w = self.workers[wid]
        return w.sender if isinstance(w, PrefillWorker) else w.receiver

    def pump_round(self) -> bool:
        """Deliver every queued message, step every worker once; whether anything happened."""
        delivered = bool(self.bus.queue)
        while self.bus.queue:
            self.deliver_next()
        busy = any([w.step() for w in self.workers.values()])
        if busy:
            time.sleep(0.0005)  # let transfer threads run
        return busy or delivered or bool(self.bus.queue)

    def pump(self, max_rounds: int = 20000) -> None:
        """Deliver messages and step workers until nothing is left to do."""
        for _ in range(max_rounds):
            if not self.pump_round():
                return
        raise AssertionError("cluster did not go idle")

    def heartbeats(self) -> None:
        """Each worker's ``KVEvents`` and ``Heartbeat``, as its process sends them a period."""
        for wid, w in self.workers.items():
            for events in self.kv_events[wid].messages():
                self.coordinator.handle(m.decode(m.encode(events)), time.monotonic())
            self.coordinator.handle(
                heartbeat(
                    w.engine,
                    wid,
                    w.queued_prompt_tokens,
                    transfers=w.transfers,
                    kv_failures=w.kv_failures,
                ),
                time.monotonic(),
            )

    def chunks(self, gateway: str = "gw") -> list[m.TokenChunk]:
        """Every token chunk the gateway received, in arrival order (out of their batches)."""
        return [
            chunk
            for msg in self.bus.gateway.get(gateway, [])
            if isinstance(msg, m.TokenBatch)
            for chunk in msg.chunks
        ]

    def tokens(self, request_id: str, gateway: str = "gw", start: int = 0) -> dict[int, list[int]]:
        """choice -> token ids in index order, checking indices run on from ``start``."""
        chunks: dict[int, list[m.TokenChunk]] = {}
        for msg in self.chunks(gateway):
            if msg.request_id == request_id:
                chunks.setdefault(msg.choice, []).append(msg)
        out = {}
        for choice, cs in chunks.items():
            cs.sort(key=lambda c: c.index)
            tokens: list[int] = []
            for c in cs:
                assert c.index == start + len(tokens), (c.index, start + len(tokens))
                tokens += c.token_ids
            assert cs[-1].finished and sum(c.finished for c in cs) == 1
            out[choice] = tokens
        return out

    def tokens_sent(self, request_id: str, gateway: str = "gw") -> int:
        """How many tokens of ``request_id`` reached the gateway so far (any order)."""
        return sum(len(x.token_ids) for x in self.chunks(gateway) if x.request_id == request_id)

    def errors(self, gateway: str = "gw") -> list[m.RequestError]:
        return [x for x in self.bus.gateway.get(gateway, []) if isinstance(x, m.RequestError)]

    def used_blocks(self) -> dict[str, int]:
        return {wid: w.engine.block_manager.num_used_blocks for wid, w in self.workers.items()}

    def close(self) -> None:
        for wid in self.workers:
            transport = self.transport(wid)
            if transport is not None:
                transport.close()
