"""The servers ``compare.py`` starts: each healthy when made, stopped by ``stop()``.

    vllm            vllm serve DIR --dtype float32 (its own venv; its default threads)
    llamacpp        llama-server -m GGUF -t <all cores> -np <max concurrency> (continuous batching)
    colocated       pdserve serve --mode colocated --quantization none (float32)
    colocated-int8  ... --quantization int8   (per-output-channel int8, from the float weights)
    colocated-int4  ... --quantization int4   (group-32 int4, from the float weights)
    colocated-gguf  ... --quantization auto   (the model directory's GGUF blocks kept: Q4_1/Q8_0)
    colocated-gguf-1w  the GGUF arm as one worker with a thread per core (as llama.cpp runs)
    disagg          pdserve serve --quantization none (1 prefill + 1 decode worker, float32)
    serve           pdserve serve with no flags: what `make serve` starts (1 prefill + 1 decode,
                    the GGUF kept, int16 activations where the host builds them, cores lent)
    serve-a8        the same on int8 activations (llama.cpp's arithmetic)
    serve-a32       the same on float32 activations and without lent cores (as before issue 41)
    serve-own-cores the same as serve but each worker on its own thread (--no-lend-cores)

llama.cpp and the GGUF arm serve ``<model dir>/model.gguf`` (or ``--gguf``); a model with none
skips them. Every server gets the whole machine, in the way it is best used: llama.cpp one
process of ``os.cpu_count()`` threads, vLLM its default, pdserve its ``serve`` defaults.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Protocol

from pdserve.bench.experiments.cluster import ServeProcess
from pdserve.runtime.sockets import free_port

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
PDSERVE_FLAGS = {
    "colocated": ["--mode=colocated", "--quantization=none"],
    "colocated-int8": ["--mode=colocated", "--quantization=int8"],
    "colocated-int4": ["--mode=colocated", "--quantization=int4"],
    "colocated-gguf": ["--mode=colocated", "--quantization=auto"],
    "colocated-gguf-1w": [
        "--mode=colocated",
        "--quantization=auto",
        "--prefill=0",
        "--decode=1",
        f"--threads={os.cpu_count() or 1}",
    ],
    "disagg": ["--quantization=none"],
    "serve": [],
    "serve-a32": ["--quant-activations=float32", "--no-lend-cores"],
    "serve-own-cores": ["--no-lend-cores"],
    "serve-a8": ["--quant-activations=int8"],
}
SERVERS = ("vllm", "llamacpp", *PDSERVE_FLAGS)
NEEDS_GGUF = (
    "llamacpp",
    "colocated-gguf",
    "colocated-gguf-1w",
    "serve",
    "serve-a32",
    "serve-own-cores",
)
# the form of the weights each server holds (what a decode step reads, for mbu.step_bytes)
WEIGHTS = {
    "vllm": "none",
    "llamacpp": "gguf",
    "colocated": "none",
    "colocated-int8": "int8",
    "colocated-int4": "int4",
    "colocated-gguf": "gguf",
    "colocated-gguf-1w": "gguf",
    "disagg": "none",
    "serve": "gguf",
    "serve-a32": "gguf",
    "serve-own-cores": "gguf",
    "serve-a8": "gguf",
}


class Server(Protocol):
    url: str

    def stop(self) -> None: ...


class PeerProcess:
    """A peer's server command (output to ``log``), healthy once ``/health`` answers 200.

    The limit is generous: vLLM compiles its model with inductor at start, minutes on two busy
    cores (its cache under ~/.cache/vllm makes later starts quicker)."""

    def __init__(
        self, cmd: list[str], env: dict[str, str], log: Path, ready_timeout_s: float = 900
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        with log.open("w") as out:  # a session of its own: stop() ends its children too
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{cmd[0]} exited with {self.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return
            except OSError:  # not listening yet, or 503 while the model loads
                time.sleep(1)
        self.stop()
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{cmd[0]} not healthy in {ready_timeout_s:.0f} s:\n{tail}")

    def stop(self) -> None:
        """SIGTERM to its process group (vLLM's engine core outlives a server stopped while it
        starts), then SIGKILL to what is left of it once the leader exits or 60 s pass."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return  # the group is gone
            try:
                self.proc.wait(60)
                time.sleep(1)  # children a moment to follow; the next killpg finds them
            except subprocess.TimeoutExpired:
                pass


def vllm(venv: Path, model: Path, log: Path) -> PeerProcess:
    """``vllm serve DIR --dtype float32``, tcmalloc preloaded as vLLM's CPU docs ask."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1"}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if Path(TCMALLOC).exists():
        env["LD_PRELOAD"] = TCMALLOC
    cmd = [str(venv / "bin/vllm"), "serve", str(model), "--dtype=float32", "--port={port}"]
    cmd += ["--host=127.0.0.1", f"--served-model-name={model.name}"]
    return PeerProcess(cmd, env, log)


def llamacpp(binary: Path, model: Path, gguf: Path, slots: int, ctx: int, log: Path) -> PeerProcess:
    """``llama-server`` on the GGUF: every core, ``slots`` parallel sequences batched together
    (continuous batching is its default), ``ctx`` tokens of KV shared by the slots, served
    under the model directory's name as vLLM is."""
    threads = str(os.cpu_count() or 1)
    cmd = [str(binary), "-m", str(gguf), "-t", threads, "-tb", threads, "-np", str(slots)]
    cmd += ["-c", str(ctx), "--host", "127.0.0.1", "--port", "{port}", "--alias", model.name]
    return PeerProcess(cmd, dict(os.environ), log)


def start(
    server: str, model: Path, gguf: Path | None, args: argparse.Namespace, log: Path
) -> Server:
    """One server of ``SERVERS`` on ``model``; healthy on return."""
    if server == "vllm":
        return vllm(Path(args.vllm_venv), model, log)
    if server == "llamacpp":
        if gguf is None:
            raise ValueError(f"{model.name} has no GGUF for llama.cpp")
        slots = max(args.concurrency)
        ctx = slots * 2 * (args.input_len + args.output_len)  # room for retokenised prompts
        return llamacpp(Path(args.llama_server), model, gguf, slots, ctx, log)
    return ServeProcess(model, PDSERVE_FLAGS[server], log=log)
