"""``pdserve profile``: measure a model on this machine for the planner (coordinator/profile.py).

One in-process engine, built from the same engine flags a worker takes (``--threads``,
``--dtype``, ``--block-size``, ``--num-kv-blocks``/``--kv-cache-memory``,
``--tensor-parallel-size``, ...), measures (a tensor-parallel group whole, as the planner
counts it: one worker; the profile records its size):

    prefill   seconds from a prompt's arrival to its first token (the engine's chunked prefill
              and sampling, as a prefill worker runs it), by prompt length
    decode    seconds per decode step (inputs, model, greedy sampling) of B sequences of C
              tokens in the KV cache, by (B, C), for the batches that fit the cache (and the
              largest that does); timed on the engine's model runner, the cache left as zeros
    kv        the KV blocks the engine allocated (what a worker with these flags gets)

Every figure is the median of ``--repeats`` runs (decode: ``--steps`` steps) after a warm-up,
taken in rounds that time every point once, so a burst of load elsewhere spreads over them.
Prompts are random tokens with prefix caching off, so nothing is served from the cache. The
default run takes about a minute for SmolLM2-135M on one CPU thread (most of it prefill).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.coordinator.profile import Profile
from pdserve.engine.cli_args import add_engine_args, engine_config_from_args
from pdserve.protocol.blocks import blocks_for
from pdserve.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    g = parser.add_argument_group("profile")
    g.add_argument(
        "--out",
        default=None,
        help="the JSON file (default: ./profile-<model>.json, ./profile-<model>-tp<N>.json at "
        "--tensor-parallel-size N > 1)",
    )
    g.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 128, 512, 1024, 2048])
    g.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    g.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    g.add_argument("--repeats", type=int, default=3, help="prefill runs per prompt length")
    g.add_argument("--steps", type=int, default=5, help="decode steps timed per point")


def run_profile(args: argparse.Namespace) -> int:
    from pdserve.engine.config import ConfigError
    from pdserve.engine.engine import LLMEngine
    from pdserve.models.pull import PullError

    if min([*args.prompt_lens, *args.batches, *args.contexts, args.repeats, args.steps]) < 1:
        print("pdserve profile: sizes and counts must be positive", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        config = engine_config_from_args(args)
        config = replace(config, cache=replace(config.cache, enable_prefix_caching=False))
        engine = LLMEngine(config)
    except (OSError, ValueError, ConfigError, PullError) as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return 2
    import torch

    try:
        prof = Profiler(engine, random.Random(args.seed))
        prof.warm_up()
        prefill = prof.prefill(args.prompt_lens, args.repeats)
        decode = prof.decode(args.batches, args.contexts, args.steps)
        leaked = engine.status.num_used_blocks
    finally:
        engine.close()  # a tensor-parallel group's other ranks
    if leaked:
        print(f"pdserve profile: {leaked} KV blocks leaked", file=sys.stderr)
        return 1
    if not decode:
        print("pdserve profile: the KV cache holds no sequence of any --contexts", file=sys.stderr)
        return 2
    tp = config.tensor_parallel_size
    profile = Profile(
        model=Path(config.model).name,
        device=engine.runner.device.type,
        threads=torch.get_num_threads(),  # rank 0's; each rank of a group runs as many
        block_size=engine.status.block_size,
        kv_blocks=engine.status.num_blocks,  # a group's: its block ids are the group's
        prefill=tuple(prefill),
        decode=tuple(decode),
        tensor_parallel_size=tp,
    )
    out = Path(args.out or f"profile-{profile.model}{f'-tp{tp}' if tp > 1 else ''}.json")
    profile.save(out)
    print(describe(profile))
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")
    return 0


class Profiler:
    """Times one engine: prefills by prompt length, decode steps by batch and context."""

    def __init__(self, engine: LLMEngine, rng: random.Random) -> None:
        self.engine = engine
        self.rng = rng
        self.vocab = engine.model_config.vocab_size
        # the longest prompt: the model's, and what the KV cache holds
        capacity = engine.status.num_blocks * engine.status.block_size
        self.max_len = min(engine.max_model_len, capacity)
        self._ids = 0

    def warm_up(self) -> None:
        """First-call costs (allocations, kernel selection) out of every timed run."""
        self._run(self._prompt(16), max_tokens=4)

    def prefill(self, lengths: list[int], repeats: int) -> list[tuple[int, float]]:
        """(prompt tokens, median seconds to the first token), lengths capped by the model's.
        Each round times every length once, so a burst of load elsewhere spreads over them."""
        sizes = sorted({min(n, self.max_len - 1) for n in lengths})
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(repeats):
            for n in sizes:
                times[n].append(self._run(self._prompt(n), max_tokens=1))
        return [(n, _sig(statistics.median(times[n]))) for n in sizes]

    def decode(
        self, batches: list[int], contexts: list[int], steps: int
    ) -> list[tuple[int, int, float]]:
        """(batch, context, median step seconds) for the batches that fit the KV cache at each
        context, and the largest that fits where that is below the largest asked for. Rounds
        as for prefill; the first is a warm-up."""
        sizes = sorted({min(c, self.max_len - 1) for c in contexts})
        points = [(b, c) for c in sizes for b in self._fitting(batches, c)]
        times: dict[tuple[int, int], list[float]] = {p: [] for p in points}
        for _ in range(steps + 1):
            for b, c in points:
                times[b, c].append(self._decode_step(b, c))
        return [(b, c, _sig(statistics.median(times[b, c][1:]))) for b, c in points]

    def _fitting(self, batches: list[int], context: int) -> list[int]:
        status = self.engine.status
        per_seq = blocks_for(context + 1, status.block_size)
        cap = min(status.num_blocks // per_seq, self.engine.scheduler.config.max_num_seqs)
        fits = {b for b in batches if b <= cap}
        if 1 <= cap < max(batches):
            fits.add(cap)
        return sorted(fits)

    def _decode_step(self, batch: int, context: int) -> float:
        """Seconds of one decode step of ``batch`` sequences whose first ``context`` tokens
        are in the KV cache (as zeros: a step's cost does not depend on the values)."""
        import torch

        from pdserve.engine.scheduler import Sequence

        engine = self.engine
        blocks = engine.block_manager
        params = SamplingParams(max_tokens=1, temperature=0.0)
        seqs = [Sequence(f"profile-{i}", self._prompt(context + 1), params) for i in range(batch)]
        taken: list[Sequence] = []
        try:
            for seq in seqs:
                if not blocks.allocate(seq, seq.num_tokens):
                    raise RuntimeError(f"no KV blocks for a batch of {batch} at {context} tokens")
                taken.append(seq)
                seq.num_computed_tokens = context
            start = time.perf_counter()
            inputs = engine.runner.prepare(seqs, [1] * batch)
            engine.sampler(engine.runner.execute(inputs), seqs)
            if engine.runner.device.type == "cuda":
                torch.cuda.synchronize(engine.runner.device)
            return time.perf_counter() - start
        finally:
            for seq in reversed(taken):
                blocks.free_seq(seq)

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def _run(self, prompt: list[int], max_tokens: int) -> float:
        """Seconds until ``prompt`` has ``max_tokens`` tokens."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self._ids += 1
        start = time.perf_counter()
        self.engine.add_request(f"profile-{self._ids}", prompt, params)
        while self.engine.has_unfinished():
            self.engine.step()
        return time.perf_counter() - start


def describe(profile: Profile) -> str:
    """The profile as a short table."""
    tp, threads = profile.tensor_parallel_size, f"{profile.threads} threads"
    if tp > 1:
        threads = f"tensor-parallel size {tp}, {threads} a rank"
    lines = [
        f"{profile.model} on {profile.device}, {threads}, "
        f"{profile.kv_blocks} KV blocks of {profile.block_size} tokens",
        f"{'prompt':>8} {'prefill ms':>11} {'tokens/s':>9}",
    ]
    lines += [f"{n:>8} {t * 1e3:>11.1f} {n / t:>9.0f}" for n, t in profile.prefill]
    lines.append(f"{'batch':>8} {'context':>8} {'step ms':>8} {'tokens/s':>9}")
    lines += [f"{b:>8} {c:>8} {t * 1e3:>8.1f} {b / t:>9.0f}" for b, c, t in profile.decode]
    return "\n".join(lines)


def _sig(seconds: float) -> float:
    """Four significant digits: more is timing noise."""
    return float(f"{seconds:.4g}")
