"""Every GPU check and benchmark of issue 6 in one run; prints a table last.

    .venv/bin/python bench/micro/gpu.py                  # every row (several minutes on one GPU)
    .venv/bin/python bench/micro/gpu.py --json out.json  # capabilities and rows as JSON as well

Rows, in order (bench/micro/gpu_model.py, gpu_attention.py, gpu_serving.py):

    device copy bandwidth / bf16 matmul rate     the card's measured limits (what MBU/MFU use)
    flashinfer vs torch attention                relative error on random ragged bf16 batches
    greedy tokens, disagg nixl vs engine         ``pdserve serve --device cuda`` (1P1D, one
                                                 card) against the in-process engine, small model
    decode step, batch 1 / 8 / 64                random bf16 model with Llama-3-8B's shapes:
                                                 step time against (weights + KV read) / copy
                                                 bandwidth = MBU; CUDA graphs on
    prefill 4,096 tokens                         one step against the bf16 matmul rate = MFU
    host syncs per decode step                   torch's sync debug mode counts them
    transformers.generate side by side           the same shapes, batch 1, 512 + 128 tokens
    nixl transfer bandwidth                      prefill to decode process, one card, 512 MiB
    nccl transfer                                two GPUs: two processes; one: one rank to itself
    TTFT / TPOT via pdserve bench                the nixl cluster above
    layer-by-layer transfer overlap              whether it is on
    tp2 greedy tokens / decode step              a TP-2 group over NCCL against one process
                                                 (bench/micro/gpu_tp.py; two GPUs)

Without CUDA it exits 0 at once, every row ``skipped: <reason>`` (from engine/platform.py).
A row that fails says ``error: ...`` and the script exits 1; aims not met do not fail it.
flashinfer JIT-compiles its kernels at first use (minutes with the machine's nvcc); the
warm-up runs pay for that, not the timed ones. Written without a GPU: NOT yet run on one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.engine import platform


@dataclass
class Row:
    key: str
    check: str
    aim: str
    needs: str  # the capability it runs on: cuda | flashinfer | nixl | nccl | two_gpus
    result: str = ""


def rows() -> list[Row]:
    return [
        Row("copy_bw", "device copy bandwidth", "", "cuda"),
        Row("matmul", "bf16 matmul rate", "", "cuda"),
        Row("attention", "flashinfer vs torch attention (rel err)", "< 1e-2", "flashinfer"),
        Row("greedy", "greedy tokens, disagg nixl vs engine", "all equal", "nixl"),
        Row("decode_1", "decode step, batch 1 (8B shapes)", "MBU >= 80%", "cuda"),
        Row("decode_8", "decode step, batch 8 (8B shapes)", "", "cuda"),
        Row("decode_64", "decode step, batch 64 (8B shapes)", "", "cuda"),
        Row("prefill", "prefill 4,096 tokens (8B shapes)", "MFU >= 50%", "cuda"),
        Row("syncs", "host syncs per decode step", "<= 1", "cuda"),
        Row("transformers", "transformers.generate side by side", "", "cuda"),
        Row("nixl_bw", "nixl transfer bandwidth", ">= 70% of copy", "nixl"),
        Row("nccl", "nccl transfer", "bytes equal", "nccl"),
        Row("ttft_tpot", "TTFT / TPOT via pdserve bench", "", "nixl"),
        Row("overlap", "layer-by-layer transfer overlap", "on for long prompts", "cuda"),
        Row("tp_greedy", "tp2 greedy tokens vs TP 1 (NCCL)", "all equal", "two_gpus"),
        Row("tp_decode_1", "tp2 decode step, batch 1 (1B shapes)", "<= 0.6x TP 1", "two_gpus"),
    ]


def capabilities() -> dict[str, tuple[bool, str]]:
    return {
        "cuda": platform.cuda_status(),
        "flashinfer": platform.flashinfer_status(),
        "nixl": platform.nixl_gpu_status(),
        "nccl": platform.cupy_nccl_status(),
        "two_gpus": _two_gpus(),
    }


def _two_gpus() -> tuple[bool, str]:
    cuda = platform.cuda_status()
    if not cuda[0]:
        return False, f"no CUDA ({cuda[1]})"
    from pdserve.bench.micro.gpu_tp import two_gpus_status

    return two_gpus_status()


def run_sections(table: dict[str, Row], caps: dict[str, tuple[bool, str]]) -> None:
    """Each section fills its rows; one that raises marks its unfilled rows as errors."""
    from pdserve.bench.micro import gpu_attention, gpu_model, gpu_serving

    work: dict[str, float] = {}  # figures a section leaves for later ones
    sections: list[tuple[list[str], Callable[[], dict[str, str]]]] = [
        (["copy_bw", "matmul"], lambda: gpu_model.peaks(work)),
        (["attention"], gpu_attention.attention_errors),
        (
            ["decode_1", "decode_8", "decode_64", "prefill", "syncs", "transformers"],
            lambda: gpu_model.llama8b_rows(work),
        ),
        (["greedy", "ttft_tpot"], gpu_serving.serving_rows),
        (["nixl_bw"], lambda: gpu_serving.nixl_bandwidth(work)),
        (["nccl"], gpu_serving.nccl_row),
        (["overlap"], lambda: {"overlap": gpu_serving.OVERLAP}),
        (["tp_greedy", "tp_decode_1"], _tp_rows),
    ]
    for keys, section in sections:
        todo = [k for k in keys if caps[table[k].needs][0]]
        if not todo:
            continue
        start = time.monotonic()
        print(f"[gpu bench] {', '.join(todo)} ...", flush=True)
        try:
            for key, result in section().items():
                if key in todo:
                    table[key].result = result
        except Exception as exc:  # report it in the table, go on with the next section
            traceback.print_exc()
            for k in todo:
                table[k].result = table[k].result or f"error: {type(exc).__name__}: {exc}"
        print(f"[gpu bench] ... {time.monotonic() - start:.0f} s", flush=True)


def _tp_rows() -> dict[str, str]:
    from pdserve.bench.micro.gpu_tp import tp_rows

    return tp_rows()


def print_table(table: list[Row]) -> None:
    widths = [max(len(r.check) for r in table), max(len(r.result) for r in table)]
    widths[1] = min(max(widths[1], 6), 110)
    print(f"{'check':<{widths[0]}} | {'result':<{widths[1]}} | aim")
    print(f"{'-' * widths[0]}-+-{'-' * widths[1]}-+-{'-' * 20}")
    for r in table:
        print(f"{r.check:<{widths[0]}} | {r.result:<{widths[1]}} | {r.aim}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    caps = capabilities()
    table = {r.key: r for r in rows()}
    for row in table.values():
        usable, reason = caps[row.needs]
        if not usable:
            row.result = f"skipped: {reason}"
    if caps["cuda"][0]:
        print("capabilities:", *(f"  {k}: {v[1]}" for k, v in caps.items()), sep="\n")
        run_sections(table, caps)
    for row in table.values():
        row.result = row.result or "error: no result"
    print_table(list(table.values()))
    if args.json:
        out = {"capabilities": caps, "rows": [asdict(r) for r in table.values()]}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 1 if any(r.result.startswith("error:") for r in table.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
