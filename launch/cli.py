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


def _not_yet(name: str, issue: str) -> Callable[[argparse._SubParsersAction], None]:
    def register(sub: argparse._SubParsersAction) -> None:
        p = sub.add_parser(name, help=f"(not yet: {issue})")
        p.set_defaults(func=lambda _args: _say_not_yet(name, issue))

    return register


def _say_not_yet(name: str, issue: str) -> int:
    print(f"pdserve {name}: not yet implemented ({issue})", file=sys.stderr)
    return 2


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _generate,
    _make_model,
    _not_yet("serve", "the disaggregated serving issue"),
    _not_yet("bench", "the benchmark harness issue"),
]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
