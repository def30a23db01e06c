"""Quantized linear layers: fp32 through oneDNN (pdserve's float path) against the quantized
kernel (engine/quant/cpu_qlinear.c) with int8 and int4 weights, side by side in one run.

One "layer set" is what a decode step multiplies: a model's every linear layer (SmolLM2-135M's
shapes by default: 30 x (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) and the
576 x 49152 head), random weights, each called once with T activation rows. Per T, each
figure is the median over ``--rounds`` rounds of one pass over the set, the paths alternating
within a round (ms; "x" is fp32's time over the path's). The weights far exceed the caches, so
batch 1 reads them from memory as a decode step does.

    .venv/bin/python bench/micro/quant_linear.py                      # threads: torch's default
    .venv/bin/python bench/micro/quant_linear.py --threads 1 --batches 1 8 --layers 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pdserve.engine.quant.kernel import load_kernel
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.quant.weights import quantize_int4, quantize_int8

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
HEAD = (49152, 576)
Linear = Callable[[torch.Tensor], torch.Tensor]  # [T, in] -> [T, out]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--group-size", type=int, default=32, help="int4 weights per scale and min")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p.parse_args()


def onednn_linear(packed: torch.Tensor) -> Linear:
    """fp32 through oneDNN with a weight ``_reorder_linear_weight`` packed."""

    def linear(x: torch.Tensor) -> torch.Tensor:
        # torch.ops calls are untyped
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return out

    return linear


def layer_set(layers: int, group: int) -> dict[str, list[Linear]]:
    """path -> one callable per layer (fp32 packed for oneDNN, int8, int4)."""
    g = torch.Generator().manual_seed(0)
    shapes = LAYER * layers + [HEAD]
    paths: dict[str, list[Linear]] = {
        "fp32": [],
        "int8": [],
        f"int4-g{group}": [],
    }
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.05
        paths["fp32"].append(onednn_linear(torch.ops.mkldnn._reorder_linear_weight(w)))
        paths["int8"].append(QuantLinear(quantize_int8(w), None))
        paths[f"int4-g{group}"].append(QuantLinear(quantize_int4(w, group), None))
    return paths


def time_paths(
    paths: dict[str, list[Linear]], layers: int, batch: int, rounds: int
) -> dict[str, float]:
    """Median ms of one pass over the set per path, the paths alternating within a round."""
    xs = {k: torch.randn(batch, k) for k in {k for _, k in [*LAYER, HEAD]}}
    inputs = [xs[k] for _, k in LAYER * layers + [HEAD]]
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms up
            for name, fns in paths.items():
                start = time.perf_counter()
                for fn, x in zip(fns, inputs, strict=True):
                    fn(x)
                if r:
                    times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if load_kernel() is None:
        raise SystemExit("the quantized linear kernel did not build (see the log): nothing to time")
    paths = layer_set(args.layers, args.group_size)
    names = list(paths)
    print(
        f"{args.layers} layers + head, {torch.get_num_threads()} thread(s), "
        f"medians of {args.rounds} rounds (ms; x = fp32 / path)"
    )
    print(f"{'T':>5} " + " ".join(f"{n:>16}" for n in names))
    for batch in args.batches:
        ms = time_paths(paths, args.layers, batch, args.rounds)
        cells = [f"{ms[n]:9.1f} {ms['fp32'] / ms[n]:5.2f}x" for n in names]
        print(f"{batch:>5} " + " ".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
