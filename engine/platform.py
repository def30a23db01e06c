"""What this machine can run on the GPU path, and why not when it cannot.

Each check returns ``(usable, reason)``: the reason names the device or version when usable,
the cause when not. Checks never raise and import optional packages (flashinfer, cupy, nixl)
only when called, so importing this module costs nothing beyond torch. The attention backends,
``make_backend``, the kvtransfer registry and ``bench/micro/gpu.py`` all ask here.

Supported ranges: flashinfer 0.5–0.7 (the wrapper ``plan``/``run`` API this code is written
against); cupy with NCCL for CUDA 12/13; nixl-cu13 1.5 (CUDA 13).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

Status = tuple[bool, str]

FLASHINFER_TESTED = ((0, 5), (0, 7))  # inclusive (major, minor) range


def cuda_status(device: int = 0) -> Status:
    """Whether torch can run on CUDA ``device``: its name and compute capability, or why not."""
    try:
        import torch

        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} is a CPU-only build"
        if not torch.cuda.is_available():
            return False, "torch.cuda.is_available() is False (no driver or no visible GPU)"
        count = torch.cuda.device_count()
        if device >= count:
            return False, f"CUDA device {device} requested, {count} visible"
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        return True, (
            f"{name} (sm_{major}{minor}), {count} GPU(s), torch {torch.__version__} "
            f"CUDA {torch.version.cuda}"
        )
    except Exception as exc:  # a broken driver raises from many places
        return False, f"CUDA probe failed: {type(exc).__name__}: {exc}"


def flashinfer_status() -> Status:
    """flashinfer's paged wrappers importable on a CUDA machine; version noted."""
    mod, problems = _cuda_module("flashinfer")
    if mod is not None:
        missing = [
            name
            for name in (
                "BatchPrefillWithPagedKVCacheWrapper",
                "BatchDecodeWithPagedKVCacheWrapper",
            )
            if not hasattr(mod, name)
        ]
        if missing:
            problems.append(f"flashinfer lacks {', '.join(missing)}")
    if problems:
        return False, "; ".join(problems)
    version = str(getattr(mod, "__version__", "unknown"))
    note = "" if _in_range(version, FLASHINFER_TESTED) else " (outside the tested 0.5–0.7)"
    return True, f"flashinfer {version}{note}"


def cupy_nccl_status() -> Status:
    """cupy with its NCCL binding (``cupy.cuda.nccl``) on a CUDA machine."""
    mod, problems = _cuda_module("cupy.cuda.nccl")
    if mod is not None and not getattr(mod, "available", True):
        problems.append("cupy is installed without NCCL support (cupy.cuda.nccl.available)")
    if problems:
        return False, "; ".join(problems)
    try:
        version = str(mod.get_version())
    except Exception:
        version = "unknown"
    return True, f"cupy NCCL {version}"


def nixl_gpu_status() -> Status:
    """NIXL (``nixl-cu13``) on a CUDA machine, where the nixl backend moves KV in GPU memory.
    (On CPU the backend needs only the package; ``kvtransfer.nixl_agent`` says so.)"""
    _, problems = _cuda_module("nixl_cu13")
    if problems:
        return False, "; ".join(problems)
    try:
        version = importlib.metadata.version("nixl-cu13")
    except Exception:
        version = "unknown"
    return True, f"nixl-cu13 {version}"


# Any: an optional package, untyped here, whose functions the callers call by name
def _cuda_module(name: str) -> tuple[Any, list[str]]:
    """Module ``name`` (None if it does not import) and what stands in its way so far: no
    CUDA, no module. Both are reported together, so one message names every missing piece."""
    cuda_ok, cuda_reason = cuda_status()
    mod, import_reason = _try_import(name)
    problems = [] if cuda_ok else [f"no CUDA ({cuda_reason})"]
    if mod is None:
        problems.append(import_reason)
    return mod, problems


def _try_import(name: str) -> tuple[object | None, str]:
    try:
        return importlib.import_module(name), ""
    except ImportError as exc:
        top = name.split(".")[0]
        return None, f"{top} is not installed ({exc})"
    except Exception as exc:  # a present but broken package (missing libs, bad CUDA)
        return None, f"{name} failed to import: {type(exc).__name__}: {exc}"


def _in_range(version: str, bounds: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return bounds[0] <= (major, minor) <= bounds[1]
