"""A profile derived by a roofline, for hardware not measured here: a model's shape and a
device's figures give each step's time as the slower of its FLOPs and its bytes, each at a
stated efficiency, plus the tensor-parallel all-reduces and a fixed overhead a step.

    prefill(n)     max(FLOPs(n) / (tp · flops · prefill_mfu),
                       weights a rank reads / (mem_bw · decode_mbu))
                   + all-reduces of n tokens + step overhead
    decode(b, c)   max((weights a rank reads + b · c · KV a rank holds a token)
                           / (mem_bw · decode_mbu),
                       b · FLOPs a token at context c / (tp · flops · decode_mfu))
                   + all-reduces of b tokens + step overhead
    all-reduces    2 a layer (after attention, after the MLP) of tokens · hidden activations,
                   each 2 · link_latency + 2 · (tp−1)/tp · bytes / (link_bw · efficiency)
                   (the ring's bandwidth term; its latency as a two-phase, NVSwitch-era
                   all-reduce's, not 2·(tp−1) hops)
    kv_blocks      (mem_bytes · memory_utilization − weights / tp − activation reserve)
                   / (block_size · KV a rank holds a token)

A rank holds ceil(kv_heads / tp) KV heads: past kv_heads ranks the heads are replicated. A
TP group is within one node. Pipeline parallelism, prefix caching and speculative decoding
are not modelled; the simulator does those above the profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.coordinator.profile import MAX_BATCH, MAX_TOKENS, Profile
from pdserve.sim.devices import Device
from pdserve.sim.shapes import ModelShape

BATCHES = (1, 8, 32, 64, 128, 256, 512)
CONTEXTS = (512, 2048, 4096, 8192, 16384)
FIRST_PROMPT = 128


def _round(seconds: float) -> float:
    """Six significant digits: more than a roofline knows, few enough to read in the file."""
    return float(f"{seconds:.6g}")


def _check_int(value: object, key: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"derive {key}: {value!r} is not an integer in [{low}, {high}]")


def _check_number(
    value: object, key: str, low: float, high: float, *, open_low: bool = False
) -> None:
    ok = False
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        ok = (low < value if open_low else low <= value) and value <= high
    if not ok:
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise ValueError(f"efficiency {key}: {value!r} is not a number in {interval}")


@dataclass(frozen=True)
class Efficiency:
    """The fractions of a device's datasheet figures a serving engine reaches, and what it
    costs beside them. The defaults are for a tuned engine (vLLM, SGLang) on a datacenter
    GPU; each is written into the derived profile. They are estimates within publicly
    reported ranges, not measurements: measure (``pdserve profile``) where you can.

    ``prefill_mfu`` 0.5: a prefill is large GEMMs, which alone reach about 0.7-0.8 of an
    H100's dense bf16 peak; attention, norms, activations and launches bring a whole forward
    pass to the 0.4-0.6 commonly reported for 70B-class prefills on H100s.

    ``decode_mbu`` 0.7: model bandwidth utilization, as Databricks/MosaicML's "LLM Inference
    Performance Engineering: Best Practices" (2023) named it: the weights and KV read per
    step over the HBM peak. Tuned decode kernels reach about 0.6-0.8; a bare copy ~0.9.

    ``decode_mfu`` 0.5: a large decode batch turns compute-bound; its GEMMs have b rows,
    skinnier than a prefill's, so taken as no better than a prefill's utilization.

    ``step_overhead_s`` 2 ms: a step's fixed cost on the host (scheduling, input tensors,
    sampling, launches CUDA graphs do not hide): the cost vLLM (v0.6) and SGLang (v0.4)
    overlap with the GPU's work in their async schedulers; where it is hidden, lower it.

    ``allreduce_efficiency`` 0.7: NCCL's all-reduce bus bandwidth (nccl-tests) on NVLink
    reaches roughly 0.7-0.85 of the link's one-direction figure for large messages; small
    ones are latency-bound (the latency term).

    ``memory_utilization`` 0.9: vLLM's ``--gpu-memory-utilization`` default: the share of
    device memory the engine takes, leaving the CUDA context and other processes theirs.

    ``activation_reserve_bytes`` 4e9: per device, out of the engine's share: activations of
    the largest step, CUDA graphs' pools, NCCL buffers (vLLM measures this with a profile run
    at start-up; a few GB on an 80 GB device).
    """

    prefill_mfu: float = 0.5
    decode_mbu: float = 0.7
    decode_mfu: float = 0.5
    step_overhead_s: float = 2e-3
    allreduce_efficiency: float = 0.7
    memory_utilization: float = 0.9
    activation_reserve_bytes: float = 4e9

    def __post_init__(self) -> None:
        for field, low, high in (
            ("prefill_mfu", 0.0, 1.0),
            ("decode_mbu", 0.0, 1.0),
            ("decode_mfu", 0.0, 1.0),
            ("allreduce_efficiency", 0.0, 1.0),
            ("memory_utilization", 0.0, 1.0),
        ):
            _check_number(getattr(self, field), field, low, high, open_low=True)
        _check_number(self.step_overhead_s, "step_overhead_s", 0.0, 1.0)
        _check_number(self.activation_reserve_bytes, "activation_reserve_bytes", 0.0, 1e14)


@dataclass(frozen=True)
class Roofline:
    """One worker, a TP group of ``tp`` ``device``s serving ``shape``: its step times and KV
    capacity as the roofline puts them (continuous; ``derive_profile`` samples it)."""

    shape: ModelShape
    device: Device
    tp: int = 1
    efficiency: Efficiency = Efficiency()

    def __post_init__(self) -> None:
        n = self.device.devices_per_node
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or not 1 <= self.tp <= n:
            raise ValueError(
                f"tensor parallel size {self.tp!r} is not in [1, {n}] ({self.device.name} has "
                f"{n} devices a node): a TP group spans one node here"
            )

    def weight_bytes(self) -> float:
        """Weights a rank holds (the embedding table and lm head are split too)."""
        return self.shape.weight_bytes() / self.tp

    def streamed_weight_bytes(self) -> float:
        """Weights a rank reads a step: all it holds but the embedding table (a row a token)."""
        return self.shape.matmul_params() * self.shape.weight_bytes_per_param / self.tp

    def kv_bytes_per_token(self) -> float:
        """K and V of one token a rank holds: its ceil(kv_heads / tp) heads of each layer."""
        s = self.shape
        heads = -(-s.kv_heads // self.tp)
        return 2 * s.layers * heads * s.head_dim * s.kv_bytes_per_element

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks of ``block_size`` tokens the worker holds; ``ValueError`` with the
        figures if the weights leave none."""
        eff, dev = self.efficiency, self.device
        usable = dev.mem_bytes * eff.memory_utilization
        free = usable - self.weight_bytes() - eff.activation_reserve_bytes
        per_block = block_size * self.kv_bytes_per_token()
        blocks = math.floor(free / per_block)
        if blocks <= 0:
            raise ValueError(
                f"{self.shape.name} does not fit on {self.tp} x {dev.name}: each device holds "
                f"{self.weight_bytes() / 1e9:.3g} GB of weights and reserves "
                f"{eff.activation_reserve_bytes / 1e9:.3g} GB of its {usable / 1e9:.3g} GB "
                f"usable ({eff.memory_utilization:g} of {dev.mem_bytes / 1e9:.3g} GB), leaving "
                f"{free / 1e9:.3g} GB: not one KV block of {per_block / 1e6:.3g} MB"
            )
        return blocks

    def allreduce_seconds(self, tokens: int) -> float:
        """The step's all-reduces: two a layer of ``tokens`` · hidden activations."""
        if self.tp == 1:
            return 0.0
        dev, tp = self.device, self.tp
        size = tokens * self.shape.hidden * self.shape.activation_bytes
        bandwidth = dev.link_bw * self.efficiency.allreduce_efficiency
        one = 2 * dev.link_latency_s + 2 * (tp - 1) / tp * size / bandwidth
        return 2 * self.shape.layers * one

    def prefill_seconds(self, tokens: int) -> float:
        """One prefill of a ``tokens``-token prompt, alone in its step."""
        eff, dev = self.efficiency, self.device
        compute = self.shape.prefill_flops(tokens) / (self.tp * dev.flops * eff.prefill_mfu)
        memory = self.streamed_weight_bytes() / (dev.mem_bw * eff.decode_mbu)
        return max(compute, memory) + self.allreduce_seconds(tokens) + eff.step_overhead_s

    def decode_step_seconds(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` sequences, each attending to ``context`` tokens."""
        eff, dev = self.efficiency, self.device
        read = self.streamed_weight_bytes() + batch * context * self.kv_bytes_per_token()
        memory = read / (dev.mem_bw * eff.decode_mbu)
        flops = batch * self.shape.flops_per_token(context) / self.tp
        compute = flops / (dev.flops * eff.decode_mfu)
        return max(memory, compute) + self.allreduce_seconds(batch) + eff.step_overhead_s

    def describe(self) -> str:
        """One line naming the device's figures, the shape and every efficiency factor."""
        s, d, e = self.shape, self.device, self.efficiency
        return (
            f"roofline: {d.name} x{self.tp} ({d.flops / 1e12:g} TFLOP/s, "
            f"{d.mem_bw / 1e12:g} TB/s, {d.mem_bytes / 1e9:g} GB, link {d.link_bw / 1e9:g} GB/s "
            f"+ {d.link_latency_s * 1e6:g} us), {s.name} ({s.layers} layers, hidden {s.hidden}, "
            f"{s.heads}/{s.kv_heads} heads of {s.head_dim}, MLP {s.intermediate}, "
            f"vocab {s.vocab}{', tied' if s.tied_embeddings else ''}, "
            f"{s.params() / 1e9:.4g}B params of {s.weight_bytes_per_param:g} B, "
            f"KV {s.kv_bytes_per_element:g} B), prefill MFU {e.prefill_mfu:g}, "
            f"decode MBU {e.decode_mbu:g}, decode MFU {e.decode_mfu:g}, "
            f"step overhead {e.step_overhead_s * 1e3:g} ms, "
            f"all-reduce efficiency {e.allreduce_efficiency:g}, "
            f"memory utilization {e.memory_utilization:g}, "
            f"activation reserve {e.activation_reserve_bytes / 1e9:g} GB"
        )


def derive_profile(
    shape: ModelShape,
    device: Device,
    tp: int = 1,
    block_size: int = 16,
    efficiency: Efficiency = Efficiency(),
    max_prompt: int = 32768,
    batches: tuple[int, ...] = BATCHES,
    contexts: tuple[int, ...] = CONTEXTS,
) -> Profile:
    """The profile of one worker (a TP group of ``tp`` ``device``s) serving ``shape``, as the
    roofline puts it: prefill at powers of two from 128 to ``max_prompt`` (and
    ``max_prompt``); decode at each (batch, context) whose KV fits in the worker's blocks
    (the three needing least if fewer fit: a step's time holds whether or not it fits)."""
    roof = Roofline(shape, device, tp, efficiency)
    _check_int(block_size, "block_size", 1, 1 << 12)
    _check_int(max_prompt, "max_prompt", 2 * FIRST_PROMPT, MAX_TOKENS)
    for values, key, high in ((batches, "batches", MAX_BATCH), (contexts, "contexts", MAX_TOKENS)):
        if not values or len(set(values)) != len(values):
            raise ValueError(f"derive {key}: one or more distinct values, got {values!r}")
        for value in values:
            _check_int(value, key, 1, high)
    kv_blocks = roof.kv_blocks(block_size)

    prompts = [FIRST_PROMPT << i for i in range((max_prompt // FIRST_PROMPT).bit_length())]
    if prompts[-1] != max_prompt:
        prompts.append(max_prompt)
    # (blocks needed, context, batch): least KV first
    grid = sorted((b * -(-c // block_size), c, b) for c in contexts for b in batches)
    fits = [(c, b) for need, c, b in grid if need <= kv_blocks]
    points = sorted(fits if len(fits) >= 3 else [(c, b) for _, c, b in grid[:3]])
    return Profile(
        model=shape.name,
        device=device.name,
        threads=1,
        block_size=block_size,
        kv_blocks=kv_blocks,
        prefill=tuple((n, _round(roof.prefill_seconds(n))) for n in prompts),
        decode=tuple((b, c, _round(roof.decode_step_seconds(b, c))) for c, b in points),
        tensor_parallel_size=tp,
        derived=roof.describe(),
    )
