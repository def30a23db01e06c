"""What one-sided KV transports (NIXL) need on the wire, beside ``messages.KVHeader``::

    worker      ── Register.kv_regions (``control.KVRegions``: its cache) ────────────▶ coordinator
    coordinator ── KVPeers (the regions of the workers it may exchange KV with) ──────▶ worker
    kv reader   ── KVAck (an offer was read; all of them: the blocks may be freed) ──▶ kv sender

The regions reach every peer at registration, over the authenticated control plane, so the
first request's transfer finds its peer loaded; a worker that leaves is in ``gone``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.codec import Message, message
from pdserve.protocol.control import KVRegions


@dataclass(frozen=True, kw_only=True)
class KVPeer:
    worker_id: str
    regions: KVRegions


@message("kv_peers")
@dataclass(frozen=True, kw_only=True)
class KVPeers(Message):
    """Coordinator → worker: peers to load (a worker that registered, or all of them when this
    worker registers) and worker ids to forget (they left, or were declared dead)."""

    added: list[KVPeer] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)


@message("kv_ack")
@dataclass(frozen=True, kw_only=True)
class KVAck(Message):
    """KV reader → sender, as a transport notification: offer ``part`` of the transfer of
    ``request_id`` was read (``ok``), or the transfer failed there (``reason``)."""

    request_id: str
    ok: bool
    reason: str = ""
    part: int = 0  # which offer was read (``KVHeader.part``: a transfer offered in parts)
