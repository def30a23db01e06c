"""Role-bound keys at a receiving socket: whether a message's sender may send it there.

Every receiver (the coordinator's inbox, a worker's control socket, a gateway's token stream,
a KV receiver) owns one ``RoleGate`` and asks it about each message before acting on it: the
sender's key (its ``User-Id``) must hold one of the roles ``protocol.roles`` lists for that
message at that receiver. A refusal is logged, once a half-minute per sender and message type
however hard it knocks, and counted. Without keys (``--insecure``) every message passes.
"""

from __future__ import annotations

import logging
from collections import Counter

from pdserve.protocol.codec import Message
from pdserve.protocol.roles import Receiver, format_roles, refusal
from pdserve.runtime.loop import RateLimitedLog
from pdserve.runtime.security import Security

log = logging.getLogger(__name__)


class RoleGate:
    """Owns one receiver's verdicts on who sent what: ``refused`` counts the refusals by
    message tag."""

    def __init__(self, security: Security | None, receiver: Receiver) -> None:
        self.security = security
        self.receiver = receiver
        self.refused: Counter[str] = Counter()
        self._log = RateLimitedLog(logger=log)

    def admit(self, msg: Message, sender: str) -> bool:
        """Whether ``sender`` (a z85 public key) may send ``msg`` here; a refusal is logged."""
        return self.admit_tag(type(msg).TYPE, sender, msg)

    def admit_tag(self, tag: str, sender: str, msg: object = None) -> bool:
        """``admit`` for a message known by its tag (the nccl control channel's own)."""
        if self.security is None:
            return True
        roles = self.security.roles_of(sender)
        why = refusal(self.receiver, tag, roles, msg)
        if why is None:
            return True
        self.refused[tag] += 1
        self._log.error(
            f"{tag} {sender}",
            "refused %s from key %s (roles: %s) at the %s: %s",
            tag,
            sender or "(none)",
            format_roles(roles) or "none",
            self.receiver,
            why,
        )
        return False
