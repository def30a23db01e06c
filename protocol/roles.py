"""Who may send what: the roles a cluster key holds, and for each kind of receiving socket the
roles whose keys may send each message there. Every receiver consults this one table
(``runtime.gate.RoleGate``); a message from a key without one of the listed roles is refused
and logged. Found by reading who sends what (``protocol.messages``' picture)::

    receiver      message                                       sender roles
    coordinator   generate, abort, gateway_hello, embed         gateway
                  register, heartbeat, kv_events, finished,     prefill, decode
                  request_error
                  reserved                                      decode
                  transfer_done                                 prefill
                  rollout_command (protocol.rollouts)           admin
    worker        reserve, prefill_job, transfer_done, abort,   coordinator
                  kv_peers, embed
    gateway       token_batch                                   prefill, decode
                  embed_result                                  prefill (an embed worker)
                  request_error                                 coordinator, prefill, decode
                  accepted, cluster_state                       coordinator
    admin         rollout_answer (`pdserve rollout`'s socket)   coordinator
    kv            kv_header (zmq); gpu_hello, gpu_begin,        prefill
                  gpu_done (nccl's control channel)

Only an ``admin`` key changes which version of a model serves whom: ``admin`` is no process's
role but the operator's (``pdserve rollout``), and ``all`` does not include it.

A ``Register`` must also be of a role its key holds: ``both`` (a colocated worker, which
prefills and decodes) needs both worker roles; ``embed`` (an embedding model's worker, which
only prefills) a prefill key. ``kv_ack`` travels as a NIXL notification, on
no socket that carries a key. Not in the table: refused everywhere.
"""

from __future__ import annotations

from enum import StrEnum

from pdserve.protocol.control import Register

COORDINATOR, GATEWAY, PREFILL, DECODE = "coordinator", "gateway", "prefill", "decode"
ADMIN = "admin"  # the operator's: changes rollouts (``pdserve rollout``), runs no process
ROLES = (COORDINATOR, GATEWAY, PREFILL, DECODE, ADMIN)  # in the order keygen writes them
ALL = "all"  # keygen's shorthand for every process role (an identity that runs the cluster)
PROCESS_ROLES = ROLES[:4]  # what ``all`` stands for
WORKERS = frozenset({PREFILL, DECODE})


class Receiver(StrEnum):
    """A kind of receiving socket: the coordinator's inbox, a worker's control socket, a
    gateway's token stream, a decode worker's KV receiver."""

    COORDINATOR = "coordinator"
    WORKER = "worker"
    GATEWAY = "gateway"
    KV = "kv"
    ADMIN = "admin"  # ``pdserve rollout``'s socket for the coordinator's answer


def _only(*roles: str) -> frozenset[str]:
    return frozenset(roles)


# receiver -> message tag -> the roles whose keys may send it there
SENDERS: dict[Receiver, dict[str, frozenset[str]]] = {
    Receiver.COORDINATOR: {
        "generate": _only(GATEWAY),
        "abort": _only(GATEWAY),
        "gateway_hello": _only(GATEWAY),
        "embed": _only(GATEWAY),
        "register": WORKERS,
        "heartbeat": WORKERS,
        "kv_events": WORKERS,
        "finished": WORKERS,
        "request_error": WORKERS,
        "reserved": _only(DECODE),
        "transfer_done": _only(PREFILL),
        "rollout_command": _only(ADMIN),
    },
    Receiver.WORKER: {
        "reserve": _only(COORDINATOR),
        "prefill_job": _only(COORDINATOR),
        "transfer_done": _only(COORDINATOR),
        "abort": _only(COORDINATOR),
        "kv_peers": _only(COORDINATOR),
        "embed": _only(COORDINATOR),
    },
    Receiver.GATEWAY: {
        "token_batch": WORKERS,
        "request_error": _only(COORDINATOR, PREFILL, DECODE),
        "accepted": _only(COORDINATOR),
        "embed_result": _only(PREFILL),
        "cluster_state": _only(COORDINATOR),
    },
    Receiver.KV: {
        "kv_header": _only(PREFILL),
        "gpu_hello": _only(PREFILL),
        "gpu_begin": _only(PREFILL),
        "gpu_done": _only(PREFILL),
    },
    Receiver.ADMIN: {
        "rollout_answer": _only(COORDINATOR),
    },
}

# what a worker registers as -> the roles its key must hold
REGISTERS_AS: dict[str, frozenset[str]] = {
    "prefill": _only(PREFILL),
    "decode": _only(DECODE),
    "both": WORKERS,
    "embed": _only(PREFILL),
}


def senders(receiver: Receiver, tag: str) -> frozenset[str]:
    """The roles that may send a ``tag`` message to ``receiver`` (empty: none may)."""
    return SENDERS[receiver].get(tag, frozenset())


def refusal(receiver: Receiver, tag: str, roles: frozenset[str], msg: object = None) -> str | None:
    """Why a key holding ``roles`` may not send this (``tag``, the message ``msg`` when the
    receiver has it decoded) to ``receiver``; None when it may."""
    allowed = senders(receiver, tag)
    if not allowed:
        return f"no role sends {tag} to the {receiver}"
    if not roles & allowed:
        return f"only {format_roles(allowed, '/')} keys send {tag} to the {receiver}"
    if isinstance(msg, Register):
        needs = REGISTERS_AS.get(msg.role, frozenset({msg.role}))
        if not needs <= roles:
            return f"registering as {msg.role} needs a key of role {format_roles(needs)}"
    return None


def parse_roles(text: str) -> frozenset[str]:
    """``prefill+decode`` -> its roles (``all``: every one); ``ValueError`` naming what is
    wrong."""
    names = [n.strip() for n in text.split("+")]
    if names == [ALL]:
        return frozenset(PROCESS_ROLES)
    unknown = [n for n in names if n not in ROLES]
    if unknown:
        raise ValueError(
            f"unknown role {unknown[0]!r} in {text!r}: roles are {', '.join(ROLES)} "
            f"(join several with '+', or '{ALL}')"
        )
    return frozenset(names)


def format_roles(roles: frozenset[str], sep: str = "+") -> str:
    """The roles as ``parse_roles`` reads them, in a fixed order (``prefill+decode``)."""
    return sep.join(r for r in ROLES if r in roles)


def command_roles(command: str, colocated: bool = False) -> frozenset[str]:
    """The roles a ``pdserve <command>`` process sends as (a colocated decode worker
    registers as ``both``); empty for a command that is no cluster role."""
    if command == DECODE and colocated:
        return WORKERS
    return frozenset({command}) if command in ROLES else frozenset()
