"""The KV transfer contract: one sender/receiver interface, a poll state per transfer.

A prefill worker pushes the KV of blocks ``src_block_ids`` (its cache) into blocks
``dst_block_ids`` that a decode worker reserved (its cache); ids differ on the two sides::

    decode                                     prefill
    r = make_receiver(backend, kv_layers)
    secret = r.expect(rid, dst_ids)     ──ids, r.address,──▶  s.send(TransferSpec(rid, src_ids,
                                          secret             dst_ids, r.address, secret=secret),
                                                               kv_layers)
    r.poll(rid): PENDING → TRANSFERRING → DONE | FAILED      s.poll(rid): same states
    r.release(rid)                                           s.release(rid)

Receiver DONE: every layer landed in ``kv_layers[l][dst_ids]`` (and matched the checksum, when
one came). Sender DONE: every byte was handed to the transport and the source blocks may be
freed; whether the receiver accepted it is the receiver's poll, which the decode side acts on.
A transfer not finished within its ``timeout_s`` is FAILED on each side. Only ``dst_ids``
ever change on the receiver; a transfer it was not told to ``expect``, or one without the
secret ``expect`` returned, is dropped (its reservation stays PENDING for the real one).

This module imports no torch: the coordinator uses ``KVLayout`` and ``check_layouts``.
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from pdserve.protocol.control import KVLayout, KVRegions

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "KVEndpoint",
    "KVLayout",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "LayoutMismatchError",
    "TransferError",
    "TransferSpec",
    "check_layouts",
]

DEFAULT_TIMEOUT_S = 30.0


class KVPoll(enum.Enum):
    PENDING = "pending"  # sender: queued; receiver: expected, nothing arrived yet
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (KVPoll.DONE, KVPoll.FAILED)


class TransferError(RuntimeError):
    """A transfer that cannot start (closed endpoint, unusable backend, unknown request)."""


class LayoutMismatchError(ValueError):
    """Two workers whose KV blocks are not interchangeable."""


def check_layouts(a: KVLayout, b: KVLayout, names: tuple[str, str] = ("a", "b")) -> None:
    """Raise ``LayoutMismatchError`` naming every field where ``a`` and ``b`` differ."""
    diffs = [
        f"{f.name} {names[0]}={getattr(a, f.name)!r} {names[1]}={getattr(b, f.name)!r}"
        for f in dataclasses.fields(KVLayout)
        if getattr(a, f.name) != getattr(b, f.name)
    ]
    if diffs:
        hint = ""
        if a.dtype != b.dtype and "int8" in (a.dtype, b.dtype):
            # an int8 cache's head_dim is its row's bytes: the values, then a float32 scale
            hint = " (one has an int8 KV cache: pass the same --kv-cache-dtype to every worker)"
        raise LayoutMismatchError(
            f"KV layouts of {names[0]} and {names[1]} differ: {', '.join(diffs)}{hint}"
        )


@dataclass(frozen=True)
class TransferSpec:
    request_id: str
    src_block_ids: list[int]  # sender's blocks, in token order
    dst_block_ids: list[int]  # receiver's blocks: src_block_ids[i] lands in dst_block_ids[i]
    address: str  # the receiver's ``address``
    timeout_s: float = DEFAULT_TIMEOUT_S
    secret: bytes = b""  # what the receiver's ``expect`` returned for this transfer

    def __post_init__(self) -> None:
        if not self.src_block_ids:
            raise ValueError(f"transfer {self.request_id!r}: no blocks to send")
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ValueError(
                f"transfer {self.request_id!r}: {len(self.src_block_ids)} source blocks but "
                f"{len(self.dst_block_ids)} destination blocks"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"transfer {self.request_id!r}: timeout_s must be > 0")


class KVEndpoint(ABC):
    """What a sender and a receiver both are: closable, and, for one-sided transports (nixl),
    a peer that publishes where its cache lives and loads its peers' (``protocol.transfer``;
    the others publish nothing and need no peers)."""

    @property
    def regions(self) -> KVRegions | None:
        """Where this endpoint's KV cache lives, for ``Register.kv_regions``; None: unused."""
        return None

    def update_peers(self, added: list[tuple[str, KVRegions]], gone: list[str]) -> None:
        """Load peers' regions by worker id (replacing older ones) and forget ``gone``."""
        del added, gone  # the two-sided transports learn their peer from each transfer

    @abstractmethod
    def close(self) -> None:
        """Stop background threads and close connections; idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVSender(KVEndpoint):
    """Pushes blocks of a local KV cache into remote receivers; any number of them."""

    @abstractmethod
    def send(self, spec: TransferSpec, kv_layers: list[torch.Tensor]) -> None:
        """Start pushing ``kv_layers[l][spec.src_block_ids]`` for every layer; returns quickly.

        ``ValueError`` for a bad spec or a request id already in flight, ``TransferError``
        when the sender is closed.
        """

    sends_parts = False  # whether ``send_part`` works (nixl: ``--kv-stream-chunks``)

    def send_part(self, spec: TransferSpec, kv_layers: list[torch.Tensor], last: bool) -> None:
        """Offer the next part of a transfer: its first part opens it (as ``send`` does), each
        later one (same request id, receiver and secret) lists the blocks that follow, in
        order, until the ``last``; the transfer is DONE once every part was received. The
        blocks must stay as they are until then. A part of a transfer that finished already
        (FAILED, or dropped by an injected fault) is not sent; ``poll`` says how it ended.
        """
        del spec, kv_layers, last
        raise TransferError(f"{type(self).__name__} cannot send a transfer in parts")

    @abstractmethod
    def poll(self, request_id: str) -> KVPoll:
        """State of a sent transfer; ``TransferError`` for an unknown request id."""

    @abstractmethod
    def failure_reason(self, request_id: str) -> str | None:
        """Why a transfer FAILED (None while it has not)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Forget a transfer (in any state); unknown ids are ignored."""

    @abstractmethod
    def notify(self, callback: Callable[[str, KVPoll], None] | None) -> None:
        """Call ``callback(request_id, state)`` the moment a transfer finishes (DONE or
        FAILED), from whichever thread saw it (usually the sender's), so its owner can act
        before its next ``poll`` (a prefill worker is deaf for a whole prompt's step)."""


class KVReceiver(KVEndpoint):
    """Receives transfers into the blocks of a local KV cache (``kv_layers``, given at init)."""

    @property
    @abstractmethod
    def address(self) -> str:
        """Where senders reach this receiver (goes into ``Register`` and ``Reserved``)."""

    @abstractmethod
    def expect(
        self, request_id: str, dst_block_ids: list[int], timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> bytes:
        """Accept one transfer for ``request_id`` into ``dst_block_ids`` within ``timeout_s``,
        from a sender presenting the returned random secret (``TransferSpec.secret``, carried
        to the prefill worker over the authenticated control plane); any other is dropped.

        ``ValueError`` for a duplicate request id or block ids outside the cache.
        """

    @abstractmethod
    def poll(self, request_id: str) -> KVPoll:
        """State of an expected transfer; ``TransferError`` for an unknown request id."""

    @abstractmethod
    def failure_reason(self, request_id: str) -> str | None:
        """Why a transfer FAILED (None while it has not)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Forget a transfer; a later arrival for it is dropped, its blocks untouched."""
