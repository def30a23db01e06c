"""``QuantLinear``: a linear layer whose weight is a ``QuantWeight`` (engine/quant/weights.py).

    forward(x [T, K] float32 | bfloat16 | float16) -> [T, N] in x's dtype
      CPU, kernel built   the C kernel (kernel.py) on float32 rows: x converted to float32 and
                          the result back, when x is another dtype
      int activations     after ``use_integer_activations``: integer dot products (qdot.py) on
                          the weight repacked into that kernel's layout (the original dropped)
      otherwise           through torch: dequantize a tile of rows, matmul (logged once)
      torch.compile       the kernel as the custom op ``pdserve::qlinear`` (or ``pdserve::qdot``;
                          a fake implementation gives inductor the output's shape)

The module holds no float copy of the weight: ``weight_bytes`` is what a forward reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from pdserve.engine.quant.kernel import KINDS, QLinearKernel, load_kernel
from pdserve.engine.quant.qdot import PackedWeight, QDotKernel, QDotLayer, pack
from pdserve.engine.quant.weights import QuantWeight, dequantize

logger = logging.getLogger(__name__)

TORCH_TILE_ROWS = 4096  # rows the torch path dequantizes at a time (bounds its float copy)


class QuantLinear(nn.Module):
    """``y = x W^T + b``, W quantized; the bias (if any) is kept in float32. Its tensors are
    buffers viewed as integers: a model-wide ``.to(dtype)`` leaves them alone."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight: QuantWeight | PackedWeight = weight
        self.out_features, self.in_features = weight.shape
        # the same memory as buffers: torch.compile takes a module's buffers as constants of
        # known shape (a dataclass's tensors would be graph inputs of symbolic shape); float16
        # viewed as int16, so that a model-wide .to(dtype) leaves them as they are
        self.register_buffer("codes", weight.data, persistent=False)
        self.register_buffer("scales", weight.scales.view(torch.int16), persistent=False)
        mins = None if weight.mins is None else weight.mins.view(torch.int16)
        self.register_buffer("mins", mins, persistent=False)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {self.out_features} rows")
        bits = None if bias is None else bias.detach().float().contiguous().view(torch.int32)
        self.register_buffer("bias_bits", bits, persistent=False)  # float32, kept as such
        on_cpu = weight.data.device.type == "cpu"
        self._kernel: QLinearKernel | None = load_kernel() if on_cpu else None
        self._layer: QDotLayer | None = None  # the integer path: constants, kernel, bits
        # the threads a call over so many rows may use now (engine/core_board.py); None: torch's
        self.threads: Callable[[int], int] | None = None
        if self._kernel is None:
            _log_torch_path_once(weight.data.device)

    def use_integer_activations(self, kernel: QDotKernel, bits: int) -> None:
        """From now on: activations quantized to ``bits`` (8 or 16) integers, integer dot
        products through ``kernel``; the weight repacked into its layout, the original dropped."""
        if isinstance(self.weight, PackedWeight):
            return
        packed = pack(self.weight)
        self.weight = packed
        self.codes = packed.codes
        self.scales = packed.scales.view(torch.int16)
        self.mins = None if packed.mins is None else packed.mins.view(torch.int16)
        self._layer = kernel.layer(packed, self.bias, bits)

    @property
    def bias(self) -> torch.Tensor | None:
        """[N] float32, or None."""
        bits = self.bias_bits
        return bits.view(torch.float32) if isinstance(bits, torch.Tensor) else None

    @property
    def weight_bytes(self) -> int:
        """Bytes of the quantized weight (codes, scales, mins) and the bias."""
        bias = 0 if self.bias is None else self.bias.nbytes
        return self.weight.nbytes + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        layer = self._layer
        if (  # the serving path: float32 rows [T, K] on integer activations, few checks
            layer is not None
            and x.dtype == torch.float32
            and x.dim() == 2
            and x.is_contiguous()
            and x.device.type == "cpu"
            and not torch.compiler.is_compiling()
        ):
            out = torch.empty(x.shape[0], self.out_features)
            layer.run(x, out, self.threads(x.shape[0]) if self.threads else torch.get_num_threads())
            return out
        dtype, lead = x.dtype, x.shape[:-1]
        xf = x.reshape(-1, self.in_features).float()  # [T, K]; a view when it can be
        if xf.stride(-1) != 1:
            xf = xf.contiguous()
        w = self.weight
        if isinstance(w, PackedWeight) and layer is not None:
            if torch.compiler.is_compiling():
                out = torch.ops.pdserve.qdot(
                    xf, self.codes, self.scales, self.mins, self.bias, w.n, w.k, layer.bits
                )
            else:
                out = torch.empty(xf.shape[0], w.n, dtype=torch.float32)
                threads = self.threads(xf.shape[0]) if self.threads else None
                layer.kernel.run(xf, w, self.bias, out, threads, bits=layer.bits)
        elif self._kernel is None or xf.device.type != "cpu" or isinstance(w, PackedWeight):
            out = self._torch_forward(xf)
        elif torch.compiler.is_compiling():
            kind, n = KINDS[w.kind], w.shape[0]
            out = torch.ops.pdserve.qlinear(
                xf, self.codes, self.scales, self.mins, self.bias, kind, w.group, n
            )
        else:
            out = torch.empty(xf.shape[0], self.out_features, dtype=torch.float32)
            threads = self.threads(xf.shape[0]) if self.threads else None
            self._kernel.run(xf, w, self.bias, out, threads)
        out = out.reshape(*lead, self.out_features)
        return out if dtype == torch.float32 else out.to(dtype)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, PackedWeight):
            raise RuntimeError("an integer-activation layer runs on a CPU, through its kernel")
        tiles = []
        for start in range(0, self.out_features, TORCH_TILE_ROWS):
            rows = slice(start, start + TORCH_TILE_ROWS)
            mins = None if w.mins is None else w.mins[rows]
            tile = QuantWeight(w.kind, w.data[rows], w.scales[rows], mins, w.group, w.name)
            tiles.append(x @ dequantize(tile).t())
        out = torch.cat(tiles, dim=1) if len(tiles) > 1 else tiles[0]
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        path = "kernel" if self._kernel is not None else "torch"
        if self._layer is not None:
            path = f"int{self._layer.bits} activations, {self._layer.kernel.path}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.weight.name}, {path}"
        )


_logged: set[str] = set()


def _log_torch_path_once(device: torch.device) -> None:
    """Said once a process per device type (the kernel module logs why it did not build)."""
    if device.type not in _logged:
        _logged.add(device.type)
        logger.info("quantized linear layers on %s run through torch (dequantize + matmul)", device)


@torch.library.custom_op("pdserve::qlinear", mutates_args=())
def qlinear_op(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: int,
    group: int,
    n: int,
) -> torch.Tensor:
    """The kernel as an op torch.compile can keep in a graph (x float32 [T, K] -> [T, n]);
    scales and mins are float16 viewed as int16 (QuantLinear's buffers)."""
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("pdserve::qlinear needs the quantized linear kernel")
    name = {v: k for k, v in KINDS.items()}[kind]
    halves = scales.view(torch.float16), None if mins is None else mins.view(torch.float16)
    w = QuantWeight(name, data, *halves, group, name)
    if w.shape != (n, x.shape[1]):
        raise ValueError(f"pdserve::qlinear: weight {w.shape} for {n} outputs of {x.shape[1]}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    kernel.run(x, w, bias, out)
    return out


@torch.library.custom_op("pdserve::qdot", mutates_args=())
def qdot_op(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    k: int,
    bits: int,
) -> torch.Tensor:
    """The integer dot-product kernel as an op torch.compile keeps in a graph (x float32
    [T, k] -> [T, n]); the packed weight's tensors as ``QuantLinear`` holds them."""
    from pdserve.engine.quant.qdot import load_kernel as load_qdot

    kernel = load_qdot()
    if kernel is None:
        raise RuntimeError("pdserve::qdot needs the integer dot-product kernel")
    kind = "i8" if mins is None else "u4"
    halves = scales.view(torch.float16), None if mins is None else mins.view(torch.float16)
    w = PackedWeight(kind, codes, *halves, n, k, kind)
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    kernel.run(x, w, bias, out, bits=bits)
    return out


@qdot_op.register_fake
def _qdot_fake(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    k: int,
    bits: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


@qlinear_op.register_fake
def _(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: int,
    group: int,
    n: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)
