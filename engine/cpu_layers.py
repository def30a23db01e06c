"""A decode step's decoder layers in one C call on the CPU (``cpu_layers.c``).

A batch-1 decode step of SmolLM2 on int8 activations spent ~2 ms of ~7 in Python between its
kernels (~25 calls a layer: modules, views, checks). ``NativeLayers.run`` makes the same kernel
calls from C, on the same buffers, in the same order (the C file draws them), so the hidden
states are the Python layers' bit for bit; a step of prefill rows, or a model it does not take,
goes through Python as before.

It takes (checked once, at ``build``): a float32 model on a CPU whose every decoder layer has
its four linear layers quantized on int8 activations (engine/quant/activations.py), no q/k
norms, no tensor-parallel sums; a float32 KV cache; and the norm, rope, attention and dot-product
kernels built, with SiLU's rounding matching torch's here. A step it takes: decode rows only,
with the attention kernel's plan (``TorchAttentionBackend.native_decode``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.engine import cpu_norm, cpu_rope
from pdserve.engine.attention import cpu_kernel
from pdserve.engine.attention.cpu_kernel import PARALLEL_MIN_ROWS, KernelPlan
from pdserve.engine.attention.torch_ops import KVSlots
from pdserve.engine.model import CausalLM, DecoderLayer
from pdserve.engine.native_build import FLAGS, find_compiler, open_library
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.quant.qdot import QDotLayer
from pdserve.engine.quant.qdot import load_kernel as load_qdot
from pdserve.envs import pdserve_home

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_layers.c")
BUILD_FLAGS = (*FLAGS, "-ffp-contract=off")  # every fma written as one, nothing contracted
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim")),
        ("inter", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("rope_fma", ctypes.c_int),
        ("silu_step", ctypes.c_int),
        *((name, ctypes.c_void_p) for name in ("norm", "qdot", "rope", "attn")),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("in_norm", "post_norm")),
        *((name, ctypes.c_void_p) for name in ("qkv", "o", "gate_up", "down", "kv")),
    ]


@functools.cache
def _library() -> tuple[ctypes.CDLL, int] | None:
    """The library and SiLU's vector step that matches torch here; None where either fails."""
    lib = open_library(
        SOURCE, find_compiler(), pdserve_home() / "kernels", logger, "decode layers", BUILD_FLAGS
    )
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pdserve_silu_mul.argtypes = [p, i64, i64, p, i64]
    lib.pdserve_silu_mul.restype = None
    fn = lib.pdserve_decode_layers
    fn.argtypes = [p, p, i32, p, i64, p, p, p, p, p, p, p, i32, i32, i32, i32]
    fn.restype = i32
    step = next((n for n in (32, 16, 8, 0) if _silu_matches_torch(lib, n)), None)
    if step is None:
        logger.info("SiLU in C rounds otherwise than torch here: decode layers through Python")
        return None
    return lib, step


def _silu_matches_torch(lib: ctypes.CDLL, step: int) -> bool:
    """Rows of 1,024 + 31 values: SLEEF's and libm's expf differ on ~4% of these, so a step
    other than ATen's shows on some of the values two steps disagree about."""
    gate_up = torch.randn(24, 2 * 1055, generator=torch.Generator().manual_seed(0)) * 8
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.empty(24, 1055)
    lib.pdserve_silu_mul(gate_up.data_ptr(), 24, 1055, out.data_ptr(), step)
    return torch.equal(out, F.silu(gate) * up)


def _address(fn: Any) -> int:  # a ctypes function: its address
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


class NativeLayers:
    """``run``: a decode-only step's hidden states through ``cpu_layers.c``."""

    def __init__(self, lib: ctypes.CDLL, model: _Model, layers: ctypes.Array[_Layer],
                 cause: CausalLM, kv_layers: list[torch.Tensor]) -> None:  # fmt: skip
        self._fn = lib.pdserve_decode_layers
        self._model, self._layers, self._cause, self._kv = model, layers, cause, kv_layers
        self._final = cause.norm.weight
        down = cause.decoder_layers()[0].mlp.down_proj
        assert isinstance(down, QuantLinear)  # build checked
        self._threads_of: QuantLinear = down
        self.kv_heads: int = model.kv_heads

    @classmethod
    def build(cls, model: CausalLM, kv_layers: list[torch.Tensor]) -> NativeLayers | None:
        """The model's layers for the C loop; None where it does not take them (docstring)."""
        cfg = model.config
        layers = model.decoder_layers()
        handles = [_handles(layer) for layer in layers]
        ok = (  # the model first: a model it cannot take builds no library
            len(layers) == len(model.layers) == len(kv_layers)
            and model.embed_tokens.weight.dtype == torch.float32
            and model.embed_tokens.weight.device.type == "cpu"
            and cfg.head_dim % 16 == 0
            and all(kv.dtype == torch.float32 and kv.is_contiguous() for kv in kv_layers)
            and all(_takes(layer) for layer in layers)
            and all(h is not None for h in handles)
        )
        if not ok:
            return None
        found = _library()
        qdot, norm, rope = load_qdot(), cpu_norm._kernel(), cpu_rope.kernel()
        attn = cpu_kernel.load_kernel()
        if found is None or qdot is None or norm is None or rope is None or attn is None:
            return None
        lib, step = found
        block_size = kv_layers[0].shape[2]
        shape = _Model(
            hidden=cfg.hidden_size,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            inter=cfg.intermediate_size,
            block_size=block_size,
            eps=layers[0].input_layernorm.eps,
            scale=layers[0].self_attn.scale,
            rope_fma=int(rope.fma),
            silu_step=step,
            norm=_address(norm),
            qdot=_address(qdot.lib.pdserve_qdot_call),
            rope=_address(rope.fn),
            attn=_address(attn._fn),
        )
        table = (_Layer * len(layers))()
        for entry, layer, kv, four in zip(table, layers, kv_layers, handles, strict=True):
            entry.in_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, handle in zip(("qkv", "o", "gate_up", "down"), four or [], strict=True):
                setattr(entry, name, handle.address)
            entry.kv = kv.data_ptr()
        logger.info("decode steps: the decoder layers in one C call (engine/cpu_layers.c)")
        return cls(lib, shape, table, model, kv_layers)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: KVSlots, plan: KernelPlan
    ) -> torch.Tensor:  # [T, E]
        """The hidden states of a step of decode rows (``slots``, ``plan``: the backend's)."""
        model = self._cause
        x = model.embed_tokens(input_ids)  # [T, E], the residual stream from here
        cos, sin = model.rotary(positions, x.dtype)  # [T, 1, D]
        out = torch.empty_like(x)
        t = x.shape[0]
        threads = torch.get_num_threads()
        own = self._threads_of.threads
        big = plan.tokens * self.kv_heads >= PARALLEL_MIN_ROWS
        status = self._fn(
            ctypes.addressof(self._model),
            ctypes.addressof(self._layers),
            len(self._layers),
            x.data_ptr(),
            t,
            self._final.data_ptr(),
            out.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.blocks.data_ptr(),
            slots.offsets.data_ptr(),
            plan.data.data_ptr(),
            plan.num_seqs,
            own(t) if own else threads,
            threads if big else 1,
            threads,
        )
        if status:
            raise MemoryError(f"decode layers: no memory for a step of {t} rows")
        return out


def _handles(layer: DecoderLayer) -> list[QDotLayer] | None:
    """The layer's four linear layers' kernel handles, in the C loop's order; None unless all
    four run on integer activations."""
    attn, mlp = layer.self_attn, layer.mlp
    found: list[QDotLayer] = []
    for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        handle = module._layer if isinstance(module, QuantLinear) else None
        if handle is None:
            return None
        found.append(handle)
    return found


def _takes(layer: DecoderLayer) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    return (
        attn.q_norm is None
        and attn.reduce is None
        and mlp.reduce is None
        and all(w.dtype == torch.float32 and w.is_contiguous() and w.is_cpu for w in norms)
    )
