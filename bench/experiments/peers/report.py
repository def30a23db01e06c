"""``compare.py``'s report as text and a plot: throughput and TPOT per server, pdserve int4's
ratios to llama.cpp and vLLM, failed requests and connection resets per server, batch-1 MBU."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any  # the report is JSON, read back from its file

from pdserve.bench.experiments.peers.mbu import mbu

TITLES = {
    "vllm": "vLLM fp32",
    "llamacpp": "llama.cpp",
    "colocated": "pdserve fp32",
    "colocated-int8": "pdserve int8",
    "colocated-int4": "pdserve int4",
    "colocated-gguf": "pdserve GGUF",
    "colocated-gguf-1w": "pdserve GGUF 1 worker",
    "disagg": "pdserve disagg fp32",
    "serve-a32": "pdserve make serve, fp32 activations",
    "serve-own-cores": "pdserve make serve, no lent cores",
    "serve-a8": "pdserve make serve, int8 activations",
    "serve": "pdserve make serve",
}
RATIOS = (
    ("serve", "llamacpp"),
    ("serve-a8", "llamacpp"),
    ("serve", "vllm"),
    ("serve", "serve-a32"),
    ("colocated-int4", "llamacpp"),
    ("colocated-gguf", "llamacpp"),
    ("colocated-gguf-1w", "llamacpp"),
    ("colocated-int4", "vllm"),
)
# what httpx says when a server drops a connection it had accepted
RESET_MARKERS = ("reset", "disconnected", "RemoteProtocolError", "ReadError", "ConnectError")


def is_reset(error: str) -> bool:
    return any(m.lower() in error.lower() for m in RESET_MARKERS)


def _servers(report: dict[str, Any]) -> list[str]:
    return [s for s in TITLES if any(s in res for res in report["models"].values())]


def _cell(res: dict[str, Any], server: str, c: str, key: str) -> float | None:
    row = res.get(server, {}).get(c)
    return None if row is None else row[key]


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _grid(report: dict[str, Any], key: str, ratios: bool) -> list[str]:
    servers = _servers(report)
    pairs = [(a, b) for a, b in RATIOS if a in servers and b in servers] if ratios else []
    extra = [f"{TITLES[a]} / {TITLES[b]}" for a, b in pairs]
    head = ["model", "C", *(TITLES[s] for s in servers), *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, res in report["models"].items():
        for c in map(str, report["concurrency"]):
            cells = [_fmt(_cell(res, s, c, key)) for s in servers]
            for a, b in pairs:
                x, y = _cell(res, a, c, key), _cell(res, b, c, key)
                cells.append(f"{x / y:.2f}x" if x is not None and y else "-")
            lines.append(f"| {model} | {c} | " + " | ".join(cells) + " |")
    return lines


def errors_lines(report: dict[str, Any]) -> list[str]:
    """Failed requests per server over every round and concurrency, resets among them."""
    lines = []
    for model, res in report["models"].items():
        cells = []
        for s in _servers(report):
            rows = res.get(s, {})
            if not rows:
                continue
            sent = sum(r["requests"] for r in rows.values())
            failed = sum(r["failed"] for r in rows.values())
            resets = sum(r["resets"] for r in rows.values())
            warm = sum(r["warmup_failed"] for r in rows.values())
            cells.append(
                f"{TITLES[s]} {failed} of {sent} ({resets} connection resets; "
                f"{warm} failed in warmups)"
            )
        lines.append(f"- {model}: failed requests, all rounds: " + "; ".join(cells))
        for s in _servers(report):
            for c, row in res.get(s, {}).items():
                for err, n in row["errors"].items():
                    lines.append(f"  - {TITLES[s]} C={c}: {n} x {err[:160]}")
    return lines


def mbu_lines(report: dict[str, Any]) -> list[str]:
    """Batch-1 MBU of each server: the bytes its decode step reads over its median TPOT at
    C = 1, against the best read bandwidth measured (1 or all threads)."""
    bandwidth = max(report["machine"]["read_bandwidth_gbs"].values()) * 1e9
    lines = []
    for model, res in report["models"].items():
        cells = [
            f"{TITLES[s]} {mbu(nbytes, res[s]['1']['median_tpot_ms'], bandwidth):.0%} "
            f"of {nbytes / 1e6:.0f} MB"
            for s, nbytes in res["step_bytes"].items()
            if "1" in res.get(s, {})
        ]
        if cells:
            lines.append(
                f"- {model}: batch-1 decode MBU {', '.join(cells)} "
                f"(read bandwidth {bandwidth / 1e9:.1f} GB/s)"
            )
    return lines


def table(report: dict[str, Any]) -> str:
    parts = [
        "Output tokens/s (median over rounds):",
        "",
        *_grid(report, "output_throughput", ratios=True),
        "",
        "Median TPOT ms:",
        "",
        *_grid(report, "median_tpot_ms", ratios=False),
        "",
        *errors_lines(report),
        *mbu_lines(report),
    ]
    return "\n".join(parts)


def plot(report: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        res = report["models"][model]
        for i, s in enumerate(TITLES):  # one colour per server in every panel
            cs = [c for c in report["concurrency"] if str(c) in res.get(s, {})]
            if cs:
                ys = [res[s][str(c)]["output_throughput"] for c in cs]
                ax.plot(cs, ys, marker="o", color=f"C{i}", label=TITLES[s])
        ax.set(title=model, xlabel="concurrent requests", ylabel="output tokens/s", xscale="log")
        ax.set_xticks(report["concurrency"], [str(c) for c in report["concurrency"]])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    title = f"{report['date']}: {report['workload']}"
    fig.suptitle(textwrap.fill(title, 75 * len(models)), fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
