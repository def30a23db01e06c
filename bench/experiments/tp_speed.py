"""Tensor parallelism on this machine (issue 38): a model of Llama 3.2 1B's shape (random
weights, float32: ~4 GB a step reads) run as one process with one thread, with two, and as a
TP-2 group of one pinned core a rank.

    python -m bench.experiments.tp_speed [--rounds 3] [--prefill-tokens 2048]

Per arm and round, in a process of its own: the median decode step at 1 and at 8 streams
(TPOT), one prefill step of ``--prefill-tokens`` tokens, the share of a TP-2 decode step its
all-reduces take (timed on rank 0), and the KV hand-off of that prompt from the TP-2 group to a
TP-1 cache over zmq (bytes, rank 0's gather of its ranks' heads, the wire). Medians over rounds;
ratios against TP 1 on one thread and on two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ARMS = {  # name: (tensor-parallel size, threads a rank)
    "tp1-1thread": (1, 1),
    "tp1-2threads": (1, 2),
    "tp2-1thread-a-rank": (2, 1),
}
DECODE_STEPS, WARM_STEPS = 32, 4  # timed decode steps, after untimed ones


def model_dir() -> Path:
    """The llama-1b preset in the model cache, written on first use (~4 GB)."""
    from pdserve.models.make_model import make_model
    from pdserve.models.store import models_dir

    out = models_dir() / "llama-1b-shape-seed0"
    if not (out / "config.json").is_file():
        make_model(out, preset="llama-1b")
    return out


def one_arm(model: Path, tp: int, threads: int, prefill_tokens: int) -> dict[str, float]:
    """This process runs the arm (pinned, so it must be a process of its own)."""
    import os

    import torch

    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.protocol.sampling import SamplingParams

    if tp == 1:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            threads=threads,
            tensor_parallel_size=tp,
            cache=CacheConfig(block_size=16, num_blocks=prefill_tokens // 16 + 64),
            scheduler=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=prefill_tokens,
                max_step_time_s=0,  # one step takes the whole prompt
                tpot_target_s=0,
            ),
        )
    )
    reduce_s = [0.0]
    group = engine.runner.group
    if group is not None:
        inner = group.all_reduce

        def timed(t: torch.Tensor) -> None:
            start = time.perf_counter()
            inner(t)
            reduce_s[0] += time.perf_counter() - start

        for layer in engine.runner.model.decoder_layers():
            layer.self_attn.reduce = layer.mlp.reduce = timed
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for streams in (1, 8):
        steps_left = DECODE_STEPS + WARM_STEPS + 1
        params = SamplingParams(max_tokens=steps_left, temperature=0.0, ignore_eos=True)
        for i in range(streams):
            prompt = torch.randint(0, vocab, (16,), generator=gen).tolist()
            engine.add_request(f"d{streams}-{i}", prompt, params)
        for _ in range(1 + WARM_STEPS):  # the prompts, then steps not timed
            engine.step()
        steps, reduce_s[0] = [], 0.0
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        out[f"tpot_ms_{streams}"] = statistics.median(steps) * 1e3
        if streams == 1:
            out["allreduce_share_1"] = reduce_s[0] / sum(steps)
    prompt = torch.randint(0, vocab, (prefill_tokens,), generator=gen).tolist()
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    start = time.perf_counter()
    engine.step()
    out["prefill_s"] = time.perf_counter() - start
    out.update(_hand_off(engine, "p"))
    engine.handoff.release("p")
    engine.close()
    return out


def _hand_off(engine: Any, rid: str) -> dict[str, float]:
    """The held prompt's KV to a one-process cache over zmq: bytes, gather, wire."""
    import torch

    from pdserve.kvtransfer import make_receiver, make_sender
    from pdserve.kvtransfer.base import KVPoll, TransferSpec

    ids = engine.handoff.held_block_ids(rid)
    start = time.perf_counter()
    src = engine.handoff.outgoing(rid, ids)  # a group: rank 0 gathers its ranks' heads
    gathered = time.perf_counter() - start
    layers = engine.status.kv_layers
    target = [torch.zeros((len(ids), *layer.shape[1:]), dtype=layer.dtype) for layer in layers]
    receiver = make_receiver("zmq", target)
    sender = make_sender("zmq")
    try:
        dst = list(range(len(ids)))
        secret = receiver.expect("kv", dst)
        start = time.perf_counter()
        sender.send(TransferSpec("kv", src, dst, receiver.address, secret=secret), layers)
        while receiver.poll("kv") not in (KVPoll.DONE, KVPoll.FAILED):
            time.sleep(0.0005)
        wire = time.perf_counter() - start
        if receiver.poll("kv") is not KVPoll.DONE:
            raise RuntimeError(f"hand-off failed: {receiver.failure_reason('kv')}")
    finally:
        sender.close()
        receiver.close()
    nbytes = sum(t.numel() * t.element_size() for t in target)
    return {
        "handoff_mb": nbytes / 1e6,
        "handoff_gather_ms": gathered * 1e3,
        "handoff_wire_ms": wire * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--model", type=Path, default=None, help="default: the llama-1b preset")
    parser.add_argument("--out", type=Path, default=None, help="write the table here too")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # an arm, in its process
    args = parser.parse_args(argv)
    model = args.model or model_dir()
    if args.one:
        tp, threads = ARMS[args.one]
        print(json.dumps(one_arm(model, tp, threads, args.prefill_tokens)))
        return 0
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS:  # arms alternate within a round
            cmd = [sys.executable, "-m", "pdserve.bench.experiments.tp_speed", "--one", arm]
            cmd += ["--model", str(model), "--prefill-tokens", str(args.prefill_tokens)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"{arm} failed:\n{done.stderr[-3000:]}")
            runs[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {arm}: {runs[arm][-1]}", flush=True)
    table = report(runs, args)
    print(table)
    if args.out:
        args.out.write_text(table)
    return 0


def report(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    med = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in runs.items()}
    one, two, tp2 = med["tp1-1thread"], med["tp1-2threads"], med["tp2-1thread-a-rank"]
    rows = [
        ("TPOT, 1 stream (ms)", "tpot_ms_1"),
        ("TPOT, 8 streams (ms)", "tpot_ms_8"),
        (f"prefill of {args.prefill_tokens} tokens (s)", "prefill_s"),
    ]
    lines = [
        f"Llama-3.2-1B-shaped model, float32, {args.rounds} rounds, medians "
        f"(python -m bench.experiments.tp_speed --rounds {args.rounds})",
        "",
        "| | TP 1, 1 thread | TP 1, 2 threads | TP 2, 1 core a rank | TP 2 / TP 1 (1 t) "
        "| TP 2 / TP 1 (2 t) |",
        "|---|---|---|---|---|---|",
    ]
    for label, key in rows:
        lines.append(
            f"| {label} | {one[key]:.1f} | {two[key]:.1f} | {tp2[key]:.1f} "
            f"| {tp2[key] / one[key]:.2f}x | {tp2[key] / two[key]:.2f}x |"
        )
    lines += [
        "",
        f"TP 2: all-reduces take {tp2['allreduce_share_1']:.1%} of a 1-stream decode step; the "
        f"{args.prefill_tokens}-token prompt's KV ({tp2['handoff_mb']:.0f} MB) leaves the group "
        f"in {tp2['handoff_gather_ms']:.0f} ms gathered on rank 0 + {tp2['handoff_wire_ms']:.0f} "
        f"ms over zmq to a TP-1 cache (TP 1 alone: {one['handoff_wire_ms']:.0f} ms over zmq).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
