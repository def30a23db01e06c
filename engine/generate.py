"""``pdserve generate``: run the in-process engine offline on prompts as one batch."""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.engine.cli_args import add_engine_args, engine_config_from_args


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("prompts", nargs="+", metavar="PROMPT")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")


def run_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.protocol.sampling import SamplingParams

    try:
        config = engine_config_from_args(args)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sample_seed,
            ignore_eos=args.ignore_eos,
        )
        engine = LLMEngine(config)
        tokenizer = Tokenizer.from_dir(config.model)
        prompts = [
            tokenizer.encode_chat([{"role": "user", "content": p}])
            if args.chat
            else tokenizer.encode(p)
            for p in args.prompts
        ]
        outputs = engine.generate(prompts, params)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"pdserve generate: error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outputs, strict=True):
        text = tokenizer.decode(out.new_token_ids)
        if args.json:
            record = {
                "prompt": prompt,
                "token_ids": out.new_token_ids,
                "text": text,
                "finish_reason": out.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"{prompt!r} -> {text!r} ({out.finish_reason})")
    return 0
