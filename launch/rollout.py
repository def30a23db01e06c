"""``pdserve rollout``: which version of a model serves whom, on a running cluster.

    pdserve rollout --coordinator ADDR --keys DIR [--key-name admin] status [NAME]
    pdserve rollout ... set NAME v1=75 v2=25     # each version's percent of NAME's requests
    pdserve rollout ... promote NAME@v2          # v2 becomes the stable version, 100 %
    pdserve rollout ... rollback NAME            # every request to the stable version

A ``RolloutCommand`` goes to the coordinator's inbox from an identity holding the ``admin``
role (``pdserve serve`` makes one in its launch's keys and prints this command line; on a
cluster of your own, ``pdserve keygen --nodes ops:admin``); the coordinator applies it whole or
not at all and answers at this command's own socket (``--reply-bind``, an address the
coordinator can reach), where only the coordinator's key is heard. The table as applied, or the
reason it was refused, is printed; the exit status is 0, 1 (refused, no answer) or 2 (usage).
Streams in flight finish on the version they started on: gateways resolve a request once.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable

import zmq

from pdserve import envs
from pdserve.launch.versions import ADMIN_KEY
from pdserve.protocol.roles import ADMIN, Receiver, format_roles
from pdserve.protocol.rollouts import (
    RolloutAnswer,
    RolloutCommand,
    format_rollout,
    split_version,
)
from pdserve.runtime import security
from pdserve.runtime.gate import RoleGate
from pdserve.runtime.keyfiles import KeysError
from pdserve.runtime.sockets import bound_address, make_socket, recv_from, send_msg


def add_rollout_args(parser: argparse.ArgumentParser) -> None:
    coordinator = envs.coordinator_address()
    parser.add_argument(
        "--coordinator",
        default=coordinator,
        required=coordinator is None,
        help="the coordinator's inbox address (env PDSERVE_COORDINATOR)",
    )
    parser.add_argument(
        "--keys", default=envs.keys_dir(), help="a keys directory holding an admin identity"
    )
    parser.add_argument("--key-name", default=ADMIN_KEY, help="the admin identity in --keys")
    parser.add_argument("--insecure", action="store_true", help="a cluster without keys")
    parser.add_argument(
        "--reply-bind",
        default="tcp://127.0.0.1:0",
        help="where the coordinator sends its answer (an address it can reach; port 0: any)",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for it")
    sub = parser.add_subparsers(dest="action", required=True)
    status = sub.add_parser("status", help="every name's versions and weights (or NAME's)")
    status.add_argument("model", nargs="?", default="", metavar="NAME")
    set_ = sub.add_parser("set", help="each version's percent of NAME's requests (sum 100)")
    set_.add_argument("model", metavar="NAME")
    set_.add_argument("weights", nargs="+", metavar="VERSION=PERCENT")
    promote = sub.add_parser("promote", help="make a version the stable one, with 100 %%")
    promote.add_argument("served", metavar="NAME@VERSION")
    rollback = sub.add_parser("rollback", help="every request of NAME to its stable version")
    rollback.add_argument("model", metavar="NAME")


def command_of(args: argparse.Namespace, request_id: str, reply: str) -> RolloutCommand:
    """The command ``args`` ask for; ``ValueError`` naming what is wrong."""
    common = {"request_id": request_id, "reply_address": reply, "action": args.action}
    if args.action == "set":
        return RolloutCommand(**common, model=args.model, weights=parse_weights(args.weights))
    if args.action == "promote":
        parts = split_version(args.served)
        if parts is None:
            raise ValueError(f"promote takes NAME@VERSION, not {args.served!r}")
        return RolloutCommand(**common, model=parts[0], version=parts[1])
    return RolloutCommand(**common, model=args.model)


def parse_weights(specs: list[str]) -> dict[str, int]:
    """``["v1=75", "v2=25%"]`` -> {"v1": 75, "v2": 25}."""
    weights: dict[str, int] = {}
    for spec in specs:
        version, sep, pct = spec.partition("=")
        digits = pct.strip().removesuffix("%")
        if not sep or not digits.isdigit():
            raise ValueError(f"{spec!r}: write VERSION=PERCENT (e.g. v2=25)")
        if version in weights:
            raise ValueError(f"version {version} is given twice")
        weights[version] = int(digits)
    return weights


def ask(
    keys: security.Security | None,
    coordinator: str,
    make: Callable[[str, str], RolloutCommand],
    reply_bind: str = "tcp://127.0.0.1:0",
    timeout_s: float = 10.0,
) -> RolloutAnswer | None:
    """Send the command ``make(request_id, reply_address)`` builds; the coordinator's answer,
    or None when none came within ``timeout_s`` (refused at its inbox, or unreachable)."""
    ctx = security.context(keys)
    gate = RoleGate(keys, Receiver.ADMIN)  # answers from the coordinator's key only
    try:
        reply = make_socket(ctx, zmq.PULL, reply_bind, bind=True)
        cmd = make(uuid.uuid4().hex, bound_address(reply))
        out = make_socket(ctx, zmq.PUSH, coordinator, bind=False, linger_ms=1000)
        send_msg(out, cmd)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = recv_from(reply, int(left * 1000) + 1)
            if got is None:
                continue
            sender, msg = got
            if not isinstance(msg, RolloutAnswer) or msg.request_id != cmd.request_id:
                continue
            if gate.admit(msg, sender):
                return msg
        return None
    finally:
        ctx.destroy(linger=0)


def run_rollout(args: argparse.Namespace) -> int:
    try:
        keys = _keys(args)
        command_of(args, "check", "check")  # the arguments, before any socket
    except (KeysError, ValueError) as e:
        print(f"pdserve rollout: {e}", file=sys.stderr)
        return 2
    answer = ask(
        keys,
        args.coordinator,
        lambda rid, reply: command_of(args, rid, reply),
        args.reply_bind,
        args.timeout,
    )
    if answer is None:
        print(
            f"pdserve rollout: no answer from the coordinator at {args.coordinator} within "
            f"{args.timeout:g} s (is it reachable, and does it admit this key as admin?)",
            file=sys.stderr,
        )
        return 1
    if answer.error:
        print(f"pdserve rollout {args.action}: refused: {answer.error}", file=sys.stderr)
        return 1
    for rollout in answer.rollouts:
        print(format_rollout(rollout))
    if not answer.rollouts:
        print("no model has versions")
    return 0


def _keys(args: argparse.Namespace) -> security.Security | None:
    if args.insecure:
        return None
    if not args.keys:
        raise KeysError("no keys: pass --keys DIR (an admin identity's), or --insecure")
    keys = security.Security.load(args.keys, args.key_name)
    if ADMIN not in keys.own_roles:
        held = format_roles(keys.own_roles)
        raise KeysError(f"identity {keys.name!r} holds the roles {held}, not admin")
    return keys
