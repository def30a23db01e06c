"""gpu.py's serving and transfer rows: greedy tokens and TTFT/TPOT through a real
``pdserve serve --device cuda --transfer-backend nixl`` cluster (1 prefill + 1 decode
worker sharing the card, built-in ``small`` model, bf16), and the KV transfer backends between
two processes (nixl on one card, GPU memory read over UCX's CUDA transports; nccl across two
cards, or one rank to itself on one). NOT yet run on a GPU.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import tempfile
import time
import urllib.request
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol  # the server's answers are JSON, read by key

import torch

from pdserve.bench.experiments.cluster import ServeProcess
from pdserve.bench.micro.kv_curve import peers_of, regions_frames

OVERLAP = (
    "off: the prefill worker hands KV over after the prompt's last chunk (nccl's sender waits "
    "on a CUDA event per send, so a per-layer send could slot in there)"
)
# UCX moves GPU memory only over its CUDA transports; nixl_agent's default (sm,cma,tcp) is for
# host memory. Set before any NIXL agent starts here or in a child (they inherit it).
GPU_UCX_TLS = "sm,cma,cuda_copy,cuda_ipc,tcp"
SERVE_FLAGS = ["--device=cuda", "--dtype=bfloat16", "--kv-cache-memory=2G"]
GREEDY_PROMPTS, GREEDY_TOKENS = [5, 17, 64, 200, 333, 512, 1000, 2048], 32


# ---- the cluster -----------------------------------------------------------------------------


def _get(url: str, timeout: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer


def _post(url: str, body: dict[str, object], timeout: float = 300.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer


def serving_rows() -> dict[str, str]:
    from pdserve.models.make_model import default_model_dir

    model = default_model_dir("small")
    os.environ.setdefault("UCX_TLS", GPU_UCX_TLS)
    with tempfile.TemporaryDirectory() as tmp:
        # flashinfer JIT and CUDA graph capture, twice: allow 15 minutes
        flags = [*SERVE_FLAGS, "--transfer-backend=nixl", "--ready-timeout=900"]
        cluster = ServeProcess(model, flags, log=Path(tmp) / "serve.log", ready_timeout_s=900)
        try:
            return {
                "greedy": _greedy_row(cluster.url, model),
                "ttft_tpot": _bench_row(cluster.url, model, Path(tmp) / "bench.json"),
            }
        finally:
            cluster.stop()


def _greedy_row(url: str, model: Path) -> str:
    """One request at a time on each side, so both run the same batch shapes."""
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.protocol.sampling import SamplingParams

    name = _get(f"{url}/v1/models")["data"][0]["id"]
    tok = Tokenizer.from_dir(model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2000, (n,), generator=g).tolist() for n in GREEDY_PROMPTS]
    config = EngineConfig(
        model=str(model), dtype="bfloat16", device="cuda", cache=CacheConfig(kv_cache_memory=2**30)
    )
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    equal = 0
    for prompt in prompts:
        body = {
            "model": name,
            "prompt": prompt,
            "max_tokens": GREEDY_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        served = _post(f"{url}/v1/completions", body)["choices"][0]["text"]
        local = tok.decode(engine.generate([prompt], params)[0].new_token_ids)
        equal += served == local
    backend = engine.runner.backend.name
    return f"{equal}/{len(prompts)} equal ({GREEDY_TOKENS} tokens each, bf16, {backend})"


def _bench_row(url: str, model: Path, out: Path) -> str:
    from pdserve.launch.worker_commands import pdserve_command

    cmd = [*pdserve_command(), "bench", f"--base-url={url}", "--num-prompts=64"]
    cmd += ["--random-input-len=512", "--random-output-len=128", "--max-concurrency=16"]
    cmd += ["--ignore-eos", f"--tokenizer={model}", f"--save-result={out}", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"pdserve bench exited {done.returncode}: {done.stderr[-2000:]}")
    r = json.loads(out.read_text())
    return (
        f"TTFT mean {r['mean_ttft_ms']:.1f} / p99 {r['p99_ttft_ms']:.1f} ms, TPOT mean "
        f"{r['mean_tpot_ms']:.2f} / p99 {r['p99_tpot_ms']:.2f} ms (64 x 512 -> 128, 16 at once)"
    )


# ---- transfers between two processes ----------------------------------------------------------

LAYERS, BLOCKS, SENT = 32, 1024, 256  # Llama-3-8B KV layout; 256 blocks = 4,096 tokens
BLOCK = (2, 16, 8, 128)
DEVICE = "cuda"


class _Factory(Protocol):
    """``torch.zeros``, ``torch.empty``: a tensor of a shape, dtype and device."""

    def __call__(self, *size: int, dtype: torch.dtype, device: str) -> torch.Tensor: ...


def _layer(make: _Factory) -> torch.Tensor:
    return make(BLOCKS, *BLOCK, dtype=torch.bfloat16, device=DEVICE)


def _pattern(layers: list[torch.Tensor]) -> None:
    """Block b of layer l holds the constant (l * 7 + b) % 251: landed bytes are checkable."""
    for i, layer in enumerate(layers):
        values = (i * 7 + torch.arange(layer.shape[0], device=layer.device)) % 251
        layer.copy_(values.view(-1, 1, 1, 1, 1).expand_as(layer).to(layer.dtype))


def _receiver_main(conn: Connection, backend: str, device: int) -> None:
    """Child process: a KV cache and a receiver; expects and checks what the parent sends."""
    from pdserve.kvtransfer import make_receiver

    if DEVICE == "cuda":
        torch.cuda.set_device(device)
    layers = [_layer(torch.zeros) for _ in range(LAYERS)]
    with make_receiver(backend, layers) as receiver:
        conn.send((receiver.address, regions_frames("decode", receiver)))
        if peers := conn.recv():  # nixl: the sender's regions, as the coordinator announces them
            receiver.update_peers(peers_of(peers), [])
        while (msg := conn.recv()) is not None:
            rid, src_ids, dst_ids = msg
            conn.send(receiver.expect(rid, dst_ids, 60.0))  # ready: the transfer secret
            deadline = time.monotonic() + 60
            while not (state := receiver.poll(rid)).finished and time.monotonic() < deadline:
                time.sleep(0.0002)
            idx = torch.tensor(dst_ids, device=DEVICE)
            want = [(i * 7 + torch.tensor(src_ids, device=DEVICE)) % 251 for i in range(LAYERS)]
            ok = all(
                torch.equal(layer[idx][:, 0, 0, 0, 0].float(), w.float())
                for layer, w in zip(layers, want, strict=True)
            )
            conn.send((state.value, ok))
            receiver.release(rid)


def _transfers(backend: str, receiver_device: int) -> list[tuple[str, float, bool]]:
    """(kind, seconds from send to sender DONE, bytes right) per timed transfer."""
    from pdserve.kvtransfer import make_sender
    from pdserve.kvtransfer.base import KVPoll, TransferSpec

    os.environ.setdefault("UCX_TLS", GPU_UCX_TLS)
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_receiver_main, args=(child_conn, backend, receiver_device))
    child.start()
    results = []
    try:
        if not conn.poll(300):
            raise RuntimeError(f"{backend} receiver process did not start")
        address, receiver_peers = conn.recv()
        src = [_layer(torch.empty) for _ in range(LAYERS)]
        _pattern(src)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        g = torch.Generator().manual_seed(0)
        # nixl registers the cache it offers from and loads the reader's regions up front
        sender = make_sender("nixl", kv_layers=src) if backend == "nixl" else make_sender(backend)
        with sender:
            if receiver_peers:
                sender.update_peers(peers_of(receiver_peers), [])
            conn.send(regions_frames("prefill", sender))
            for i in range(6):  # the first one pays for the handshake
                kind = "scattered" if i % 2 else "contiguous"
                if kind == "contiguous":
                    src_ids = list(range(SENT * (i % 3), SENT * (i % 3 + 1)))
                    dst_ids = list(range(BLOCKS - SENT, BLOCKS))
                else:
                    src_ids = torch.randperm(BLOCKS, generator=g)[:SENT].tolist()
                    dst_ids = torch.randperm(BLOCKS, generator=g)[:SENT].tolist()
                rid = f"{backend}-{i}"
                conn.send((rid, src_ids, dst_ids))
                secret = conn.recv()
                start = time.perf_counter()
                spec = TransferSpec(rid, src_ids, dst_ids, address, 60.0, secret=secret)
                sender.send(spec, src)
                while not (state := sender.poll(rid)).finished:
                    time.sleep(0.0001)
                seconds = time.perf_counter() - start
                got, ok = conn.recv()
                if state is not KVPoll.DONE or got != "done":
                    raise RuntimeError(f"{rid}: sender {state.value}, receiver {got}: "
                                       f"{sender.failure_reason(rid)}")  # fmt: skip
                sender.release(rid)
                if i:
                    results.append((kind, seconds, ok))
    finally:
        conn.send(None)
        child.join(60)
        if child.is_alive():
            child.kill()
    return results


def _rate_row(results: list[tuple[str, float, bool]], copy_rate: float | None) -> str:
    nbytes = LAYERS * SENT * 2 * 16 * 8 * 128 * 2
    parts = []
    for kind in ("contiguous", "scattered"):
        best = min(s for k, s, _ in results if k == kind)
        rate = nbytes / best
        share = f" = {rate / copy_rate:.0%} of copy" if copy_rate else ""
        parts.append(f"{kind} {rate / 1e9:.0f} GB/s{share}")
    right = "bytes right" if all(ok for *_, ok in results) else "BYTES WRONG"
    return f"{', '.join(parts)} ({nbytes >> 20} MiB, {right})"


def nixl_bandwidth(work: dict[str, float]) -> dict[str, str]:
    results = _transfers("nixl", torch.cuda.current_device())
    return {"nixl_bw": _rate_row(results, work.get("copy_rate"))}


def nccl_row() -> dict[str, str]:
    if torch.cuda.device_count() >= 2:
        return {"nccl": _rate_row(_transfers("nccl", 1), None) + ", GPU 0 -> GPU 1"}
    from pdserve.kvtransfer.nccl_backend import nccl_self_test

    equal, detail, rate = nccl_self_test(0)
    verdict = "bytes equal" if equal else "BYTES DIFFER"
    return {
        "nccl": f"{verdict}, {rate:.0f} GB/s ({detail}; one GPU, so the two-process "
        "backend path is not exercised)"
    }
