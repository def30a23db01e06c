"""pdserve against vLLM's CPU build on the same cores, side by side in one run.

For each model, each round starts every server in turn (vLLM, pdserve colocated, pdserve
disaggregated), runs the same client (``pdserve bench``, random dataset, ``--ignore-eos``,
greedy, every request sent at once under ``--max-concurrency``) at each concurrency, and stops
it; rounds alternate the servers so drift on the machine hits all of them alike. Medians over
rounds go into ``bench/results/peers.json``, a markdown table and a PNG beside it.

    bench/experiments/peers/setup_vllm.sh                # once: vLLM in .peers/vllm
    .venv/bin/python bench/experiments/peers/compare.py  # SmolLM2-135M, then small; ~25 min
    .venv/bin/python bench/experiments/peers/compare.py --models small --rounds 1 --concurrency 8

Both get the whole machine: vLLM its default (one compute thread here), pdserve its serve
defaults (the cores split between its workers). A benchmark, never part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

from pdserve.bench.experiments.cluster import ServeProcess  # noqa: E402
from pdserve.bench.experiments.peers.mbu import mbu, read_bandwidth, weight_bytes  # noqa: E402
from pdserve.launch.serve import pdserve_command  # noqa: E402
from pdserve.runtime.sockets import free_port  # noqa: E402

SERVERS = ("vllm", "colocated", "disagg")
METRICS = ("output_throughput", "median_tpot_ms", "median_ttft_ms", "p99_tpot_ms")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "small"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-client", type=int, default=3, help="requests = this x C")
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--vllm-venv", default=str(ROOT / ".peers/vllm"))
    p.add_argument("--out", default=str(ROOT / "bench/results/peers.json"))
    return p.parse_args()


class VLLMServer:
    """``vllm serve DIR --dtype float32`` from its own venv; healthy on return."""

    def __init__(self, venv: Path, model: str, log: Path, ready_timeout_s: float = 300) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1"}
        env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if Path(TCMALLOC).exists():
            env["LD_PRELOAD"] = TCMALLOC
        cmd = [str(venv / "bin/vllm"), "serve", model, "--dtype=float32", f"--port={self.port}"]
        cmd += ["--host=127.0.0.1", f"--served-model-name={Path(model).name}"]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.log = log
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return
            except OSError:
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"vllm serve not healthy in {ready_timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(server: str, model: str, args: argparse.Namespace, log: Path):
    if server == "vllm":
        return VLLMServer(Path(args.vllm_venv), model, log)
    flags = ["--mode=colocated"] if server == "colocated" else []
    return ServeProcess(model, flags, log=log)


def bench_once(url: str, model: str, c: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [*pdserve_command(), "bench", f"--base-url={url}", f"--tokenizer={model}"]
    cmd += ["--dataset=random", f"--random-input-len={args.input_len}"]
    cmd += [f"--random-output-len={args.output_len}", "--ignore-eos", "--temperature=0"]
    cmd += [f"--num-prompts={c * args.prompts_per_client}", f"--max-concurrency={c}"]
    cmd += ["--request-rate=inf", f"--warmup={min(c, 4)}", "--no-progress", f"--save-result={out}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    saved = json.loads(out.read_text())  # one row as it is; a sweep as {"rows": [...]}
    row = saved["rows"][0] if "rows" in saved else saved
    return {k: row[k] for k in (*METRICS, "completed", "failed")}


def run_model(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    from pdserve.models.store import resolve_model

    model = resolve_model(name)
    runs: dict[str, dict[int, list[dict]]] = {s: {c: [] for c in args.concurrency} for s in SERVERS}
    for r in range(args.rounds):
        order = args.servers[r % len(args.servers) :] + args.servers[: r % len(args.servers)]
        for server in order:
            print(f"== {name} round {r + 1}: {server}", flush=True)
            proc = start(server, model, args, tmp / f"{server}.log")
            try:
                for c in args.concurrency:
                    row = bench_once(proc.url, model, c, args, tmp / "row.json")
                    runs[server][c].append(row)
                    print(
                        f"   C={c:<3} {row['output_throughput']:8.1f} tok/s  median TPOT "
                        f"{row['median_tpot_ms']:6.1f} ms  failed {row['failed']}",
                        flush=True,
                    )
            finally:
                proc.stop()
    out: dict = {
        s: {str(c): _median(rows) for c, rows in by_c.items() if rows} for s, by_c in runs.items()
    }
    out["weight_bytes"] = weight_bytes(model)
    return out


def _median(rows: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in rows) for k in METRICS}
    out["failed"] = sum(r["failed"] for r in rows)
    out["rounds"] = [r["output_throughput"] for r in rows]
    return out


def table(report: dict) -> str:
    lines = [
        "| model | C | vLLM out tok/s | pdserve colocated | pdserve disagg "
        "| median TPOT ms vLLM / colocated / disagg |",
        "|---|---|---|---|---|---|",
    ]
    for model, res in report["models"].items():
        for c in map(str, report["concurrency"]):
            v = res.get("vllm", {}).get(c)
            cells = []
            for s in ("colocated", "disagg"):
                r = res.get(s, {}).get(c)
                if r is None:
                    cells.append("-")
                    continue
                ratio = f" ({r['output_throughput'] / v['output_throughput']:.2f}x)" if v else ""
                cells.append(f"{r['output_throughput']:.1f}{ratio}")
            tpot = " / ".join(
                f"{res[s][c]['median_tpot_ms']:.1f}" if c in res.get(s, {}) else "-"
                for s in SERVERS
            )
            vv = f"{v['output_throughput']:.1f}" if v else "-"
            lines.append(f"| {model} | {c} | {vv} | {cells[0]} | {cells[1]} | {tpot} |")
    return "\n".join(lines) + "\n\n" + mbu_lines(report)


def mbu_lines(report: dict) -> str:
    """Batch-1 MBU of each server, against the best read bandwidth measured (1 or 2 threads)."""
    bandwidth = max(report["machine"]["read_bandwidth_gbs"].values()) * 1e9
    lines = []
    for model, res in report["models"].items():
        cells = [
            f"{s} {mbu(res['weight_bytes'], res[s]['1']['median_tpot_ms'], bandwidth):.0%}"
            for s in SERVERS
            if "1" in res.get(s, {})
        ]
        if cells:
            lines.append(
                f"- {model}: batch-1 decode MBU {', '.join(cells)} "
                f"({res['weight_bytes'] / 1e6:.0f} MB of weights a step, read bandwidth "
                f"{bandwidth / 1e9:.1f} GB/s)"
            )
    return "\n".join(lines)


def plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        res = report["models"][model]
        for s in SERVERS:
            cs = [c for c in report["concurrency"] if str(c) in res.get(s, {})]
            ys = [res[s][str(c)]["output_throughput"] for c in cs]
            if cs:
                ax.plot(cs, ys, marker="o", label=s)
        ax.set(title=model, xlabel="concurrent requests", ylabel="output tokens/s", xscale="log")
        ax.legend()
    fig.suptitle(f"{report['date']}: {report['workload']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    args = parse_args()
    if "vllm" in args.servers and not (Path(args.vllm_venv) / "bin/vllm").exists():
        setup = "bench/experiments/peers/setup_vllm.sh"
        print(f"vLLM is not installed: run {setup} first", file=sys.stderr)
        return 2
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "command": shlex.join(
            [".venv/bin/python", "bench/experiments/peers/compare.py", *sys.argv[1:]]
        ),
        "workload": f"random {args.input_len} -> {args.output_len} tokens, ignore_eos, greedy, "
        f"{args.prompts_per_client} x C requests at concurrency C, medians of {args.rounds}",
        "concurrency": args.concurrency,
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg(),
            "read_bandwidth_gbs": {
                f"{t} thread(s)": read_bandwidth(t) / 1e9 for t in (1, os.cpu_count() or 1)
            },
        },
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            report["models"][name] = run_model(name, args, Path(tmp))
    report["machine"]["loadavg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    text = table(report)
    out.with_suffix(".md").write_text(f"{report['command']}\n\n{report['workload']}\n\n{text}\n")
    plot(report, out.with_suffix(".png"))
    print(text)
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
