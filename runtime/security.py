"""CURVE keys and secured ZeroMQ contexts: who may talk to a pdserve cluster.

Every socket between roles is CURVE-encrypted and authenticated. A cluster has one *server*
keypair, which every binding socket (inboxes, token streams, KV receivers) serves with, and one
*identity* keypair per process (``pdserve serve``) or per node (``pdserve keygen``), which every
connecting socket presents. A ZAP handler in each process admits only identities listed in
the keys directory's ``authorized/``, so a process without a key can neither connect to a
socket nor pose as one (it lacks the server's secret key)::

    keys/
      server.key_secret        the cluster's server keypair (0600)
      <name>.key_secret        this process's (or node's) identity keypair (0600)
      authorized/<name>.key    public keys of every identity the cluster admits, each with
                               the roles it holds (``runtime.keyfiles``, ``protocol.roles``)

``make_socket`` (``runtime.sockets``) secures every socket made from a ``SecureContext`` (or
``SecureAsyncContext``): bound ones as CURVE servers, connected ones as CURVE clients. The
sender's identity (its public key, z85) arrives on every message as the ``User-Id`` property,
which the coordinator binds worker ids to and every receiver checks the sender's roles by
(``roles_of``, ``runtime.gate``).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from pdserve import envs
from pdserve.protocol.roles import format_roles
from pdserve.runtime.keyfiles import KeysError, load_authorized, load_secret

log = logging.getLogger(__name__)

SERVER = "server"
AUTHORIZED = "authorized"
ZAP_DOMAIN = "pdserve"


class _DeniedLog:
    """One warning per refused key a minute, however hard it knocks."""

    def __init__(self) -> None:
        self._last: dict[bytes, float] = {}

    def report(self, key: bytes) -> None:
        now = time.monotonic()
        if now - self._last.get(key, float("-inf")) < 60.0:
            return
        if len(self._last) > 1024:
            self._last.clear()
        self._last[key] = now
        log.warning("refused a connection from unknown CURVE key %s", key.decode(errors="replace"))


@dataclass(frozen=True)
class Security:
    """One process's CURVE material: the cluster's server keypair, its own identity keypair
    and the public keys it admits (z85 bytes), with the roles of each."""

    name: str
    server_public: bytes
    server_secret: bytes
    public: bytes
    secret: bytes
    authorized: frozenset[bytes]
    roles: Mapping[bytes, frozenset[str]] = field(default_factory=dict, compare=False, repr=False)
    _denied: _DeniedLog = field(default_factory=_DeniedLog, init=False, repr=False, compare=False)

    @classmethod
    def load(cls, keys_dir: str | Path, name: str | None = None) -> Security:
        """The keys in ``keys_dir`` for identity ``name`` (default: the only one there)."""
        root = Path(keys_dir)
        if not root.is_dir():
            raise KeysError(f"keys directory {root} does not exist (make one: pdserve keygen)")
        names = sorted(p.name[: -len(".key_secret")] for p in root.glob("*.key_secret"))
        names = [n for n in names if n != SERVER]
        if name is None:
            if len(names) != 1:
                raise KeysError(
                    f"{root} holds identities {names or 'none'}: choose one with --key-name"
                )
            name = names[0]
        server_public, server_secret = load_secret(root / f"{SERVER}.key_secret")
        public, secret = load_secret(root / f"{name}.key_secret")
        roles = load_authorized(root / AUTHORIZED)
        if public not in roles:
            raise KeysError(f"identity {name!r} is not in {root / AUTHORIZED}")
        return cls(name, server_public, server_secret, public, secret, frozenset(roles), roles)

    def roles_of(self, sender: str) -> frozenset[str]:
        """The roles of the identity whose ``User-Id`` is ``sender`` (none: unknown)."""
        return self.roles.get(sender.encode(), frozenset())

    @property
    def own_roles(self) -> frozenset[str]:
        return self.roles.get(self.public, frozenset())

    @property
    def user_id(self) -> str:
        """What receivers see as this process's ``User-Id``."""
        return self.public.decode()

    def secure(self, sock: zmq.Socket[object], *, bind: bool) -> None:
        """Make ``sock`` a CURVE server (``bind``) or client; before bind/connect."""
        if bind:
            sock.curve_secretkey = self.server_secret
            sock.curve_publickey = self.server_public
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
        else:
            sock.curve_secretkey = self.secret
            sock.curve_publickey = self.public
            sock.curve_serverkey = self.server_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: admit a client's public key (z85) only if the cluster lists it."""
        if client_key in self.authorized:
            return True
        self._denied.report(client_key)
        return False


class _Zap:
    """The ZAP handler of one secure context: a thread that admits only the cluster's keys to
    the context's CURVE server sockets (``Security.callback``)."""

    def __init__(self, security: Security, sync_ctx: zmq.SyncContext) -> None:
        self._auth: ThreadAuthenticator | None = ThreadAuthenticator(
            sync_ctx, log=logging.getLogger("pdserve.zap")
        )
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=security)

    def stop(self) -> None:
        """Idempotent. The thread's sockets go before the context's: destroy would close them
        under its feet, and term would wait for them forever."""
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()


class SecureContext(zmq.SyncContext):
    """A context whose sockets ``make_socket`` secures with ``security``; it owns their ZAP
    handler."""

    # declared here: a context takes any other attribute set on it for a zmq option
    security: Security
    _zap: _Zap | None = None  # None until made (a context that failed to start has none)

    def __init__(self, security: Security) -> None:
        super().__init__()
        self.security = security
        self._zap = _Zap(security, self)

    def term(self) -> None:
        if self._zap is not None:
            self._zap.stop()
        super().term()

    def destroy(self, linger: int | None = None) -> None:
        if self._zap is not None:
            self._zap.stop()
        super().destroy(linger)


class SecureAsyncContext(zmq.asyncio.Context):
    """The asyncio twin of ``SecureContext`` (the gateway's)."""

    security: Security
    _zap: _Zap | None = None
    _sync_view: zmq.SyncContext  # the ZAP thread's sync view of the same libzmq context

    def __init__(self, security: Security) -> None:
        super().__init__()
        self.security = security
        self._sync_view = zmq.Context.shadow(self.underlying)
        self._zap = _Zap(security, self._sync_view)

    def term(self) -> None:
        if self._zap is not None:
            self._zap.stop()
        super().term()

    def destroy(self, linger: int | None = None) -> None:
        if self._zap is not None:
            self._zap.stop()
        super().destroy(linger)


def context(security: Security | None) -> zmq.SyncContext:
    """A context for a role: secured when ``security`` is given, else a plain one."""
    if security is None:
        return zmq.Context()
    return SecureContext(security)


def async_context(security: Security | None) -> zmq.asyncio.Context:
    if security is None:
        return zmq.asyncio.Context()
    return SecureAsyncContext(security)


def security_of(ctx: zmq.Context[zmq.Socket[object]]) -> Security | None:
    """The keys ``ctx`` secures its sockets with; None for a plain context."""
    if isinstance(ctx, (SecureContext, SecureAsyncContext)):
        return ctx.security
    return None


# ---- configuration: flags and environment --------------------------------------------------


def add_security_args(parser: argparse.ArgumentParser) -> None:
    """``--keys``, ``--key-name``, ``--insecure`` for a role (env PDSERVE_KEYS, ...)."""
    g = parser.add_argument_group("security")
    g.add_argument(
        "--keys",
        default=envs.keys_dir(),
        help="the cluster's CURVE keys directory, from `pdserve keygen` (env PDSERVE_KEYS)",
    )
    g.add_argument(
        "--key-name",
        default=envs.key_name(),
        help="this process's identity in --keys (default: the only one; env PDSERVE_KEY_NAME)",
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        default=envs.insecure(),
        help="no CURVE on internal sockets: anyone who reaches them can drive the cluster",
    )


def export(
    args: argparse.Namespace,
    env: MutableMapping[str, str] = os.environ,
    needs: frozenset[str] = frozenset(),
) -> None:
    """Check a role's security flags (``KeysError`` if unusable, or if the identity lacks a
    role in ``needs``: what the process sends as) and put them in ``env``, where every
    socket-making part of the process (and ``from_env``) reads them."""
    if args.insecure and args.keys:
        raise KeysError("--insecure and --keys exclude each other")
    if not args.insecure and not args.keys:
        raise KeysError(
            "no cluster keys: pass --keys DIR (env PDSERVE_KEYS; make them with `pdserve "
            "keygen`), or --insecure to run without authentication"
        )
    for name in (envs.KEYS, envs.KEY_NAME, envs.INSECURE):
        env.pop(name, None)
    if args.insecure:
        env[envs.INSECURE] = "1"
        return
    security = Security.load(args.keys, args.key_name)  # fail now, with the reason
    if not needs <= security.own_roles:
        raise KeysError(
            f"identity {security.name!r} holds the roles {format_roles(security.own_roles)}, "
            f"not {format_roles(needs - security.own_roles)}: every receiver would refuse what "
            f"this process sends (give it a key made with pdserve keygen --nodes "
            f"NAME:{format_roles(needs)})"
        )
    env[envs.KEYS] = str(Path(args.keys).resolve())
    env[envs.KEY_NAME] = security.name


def from_env() -> Security | None:
    """This process's keys as ``export`` left them; None (with a loud warning) when insecure
    or unset (library use in tests: the CLI never starts a role that way)."""
    keys_dir = envs.keys_dir()
    if envs.insecure() or keys_dir is None:
        if envs.insecure():
            log.warning(
                "INSECURE: internal sockets have no authentication or encryption; anyone who "
                "can reach them can register workers, read prompts and inject tokens"
            )
        return None
    return Security.load(keys_dir, envs.key_name())
