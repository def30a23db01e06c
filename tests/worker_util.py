"""Doubles for stepping one worker alone: an outbox that keeps what it is given, and KV
transports whose transfers land, fail or time out when the test says so."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.engine import LLMEngine
from pdserve.kvtransfer.base import KVPoll, KVReceiver, KVSender, TransferError, TransferSpec
from pdserve.protocol import messages as m


class Outbox:
    def __init__(self) -> None:
        self.coordinator: list[m.Message] = []
        self.gateway: list[m.Message] = []

    def to_coordinator(self, msg: m.Message) -> None:
        self.coordinator.append(msg)

    def to_gateway(self, address: str, msg: m.Message) -> None:
        self.gateway.append(msg)

    def sent(self, kind: type[m.Message]) -> list[m.Message]:
        return [x for x in self.coordinator if isinstance(x, kind)]

    def errors(self) -> list[m.RequestError]:
        return [x for x in self.gateway if isinstance(x, m.RequestError)]


class Receiver(KVReceiver):
    """Expected transfers by id; ``land`` or ``fail`` one (nothing is written)."""

    def __init__(self) -> None:
        self.expected: dict[str, list[int]] = {}
        self.states: dict[str, KVPoll] = {}

    @property
    def address(self) -> str:
        return "fake://receiver"

    def expect(self, request_id: str, dst_block_ids: list[int], timeout_s: float = 30.0) -> bytes:
        if request_id in self.expected:
            raise ValueError(f"{request_id} expected twice")
        self.expected[request_id] = list(dst_block_ids)
        self.states[request_id] = KVPoll.PENDING
        return b"secret"

    def land(self, request_id: str) -> None:
        self.states[request_id] = KVPoll.DONE

    def fail(self, request_id: str) -> None:
        self.states[request_id] = KVPoll.FAILED

    def poll(self, request_id: str) -> KVPoll:
        if request_id not in self.states:
            raise TransferError(f"unknown transfer {request_id}")
        return self.states[request_id]

    def failure_reason(self, request_id: str) -> str | None:
        return "link cut" if self.states.get(request_id) is KVPoll.FAILED else None

    def release(self, request_id: str) -> None:
        self.expected.pop(request_id, None)
        self.states.pop(request_id, None)

    def close(self) -> None:
        pass


class Sender(KVSender):
    """Transfers by id; ``finish`` one from "the sender's thread" (its notify callback)."""

    def __init__(self) -> None:
        self.sent: dict[str, TransferSpec] = {}
        self.states: dict[str, KVPoll] = {}
        self.refuse = False  # send raises, as a closed sender does
        self.callback: Callable[[str, KVPoll], None] | None = None

    def send(self, spec: TransferSpec, kv_layers: list[torch.Tensor]) -> None:
        if self.refuse:
            raise TransferError("sender closed")
        self.sent[spec.request_id] = spec
        self.states[spec.request_id] = KVPoll.TRANSFERRING

    def finish(self, request_id: str, state: KVPoll) -> None:
        self.states[request_id] = state
        if self.callback is not None:
            self.callback(request_id, state)

    def poll(self, request_id: str) -> KVPoll:
        if request_id not in self.states:
            raise TransferError(f"unknown transfer {request_id}")
        return self.states[request_id]

    def failure_reason(self, request_id: str) -> str | None:
        return "timed out" if self.states.get(request_id) is KVPoll.FAILED else None

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def notify(self, callback: Callable[[str, KVPoll], None] | None) -> None:
        self.callback = callback

    def close(self) -> None:
        pass


def assert_engine_empty(engine: LLMEngine) -> None:
    """No sequence anywhere in the engine and every block free (cached ones count as free)."""
    assert dict(engine.requests) == {} and engine.requests.held == {}
    assert engine.requests.due == []
    assert engine.scheduler.waiting_for_kvs == {} and not engine.scheduler.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    assert engine.status.num_free_blocks == engine.status.num_blocks
