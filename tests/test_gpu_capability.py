"""The GPU path where there is no GPU: its modules import without CUDA, flashinfer or cupy;
every capability check says why it is off (and what it found when on, faked here); asking for
a GPU backend by name fails with that reason."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from pdserve.engine import platform
from pdserve.engine.attention import TorchAttentionBackend, make_backend
from pdserve.engine.config import ConfigError
from pdserve.kvtransfer import make_receiver, make_sender
from pdserve.kvtransfer.base import TransferError

ROOT = Path(__file__).resolve().parents[1]
GPU_MODULES = [
    "pdserve.engine.platform",
    "pdserve.engine.attention.flashinfer_backend",
    "pdserve.engine.cuda_graphs",
    "pdserve.kvtransfer.gpu_wire",
    "pdserve.kvtransfer.gpu_sender",
    "pdserve.kvtransfer.gpu_receiver",
    "pdserve.kvtransfer.nccl_backend",
    "pdserve.bench.micro.gpu",
    "pdserve.bench.micro.gpu_model",
    "pdserve.bench.micro.gpu_attention",
    "pdserve.bench.micro.gpu_serving",
]


def test_gpu_modules_import_without_optional_packages() -> None:
    code = (
        f"import sys\nfor m in {GPU_MODULES!r}: __import__(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flashinfer', 'cupy')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # optional packages are imported only when used


@pytest.fixture
def no_cuda_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    return f"torch {torch.__version__} is a CPU-only build"


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch reports one usable H200 (nothing touches the device)."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=0: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=0: "NVIDIA H200")
    return f"NVIDIA H200 (sm_90), 1 GPU(s), torch {torch.__version__} CUDA 13.0"


def fake_module(monkeypatch, name: str, **attrs) -> None:
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))


def test_cuda_status(monkeypatch, no_cuda_build) -> None:
    assert platform.cuda_status() == (False, no_cuda_build)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.cuda_status() == (
        False,
        "torch.cuda.is_available() is False (no driver or no visible GPU)",
    )


def test_cuda_status_usable_and_broken(monkeypatch, fake_gpu) -> None:
    assert platform.cuda_status() == (True, fake_gpu)
    assert platform.cuda_status(1) == (False, "CUDA device 1 requested, 1 visible")

    def broken(d=0):
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(torch.cuda, "get_device_name", broken)
    assert platform.cuda_status() == (
        False,
        "CUDA probe failed: RuntimeError: CUDA driver version is insufficient",
    )


WRAPPERS = {"BatchPrefillWithPagedKVCacheWrapper": 1, "BatchDecodeWithPagedKVCacheWrapper": 1}


def test_flashinfer_status(monkeypatch, fake_gpu) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    usable, reason = platform.flashinfer_status()
    assert not usable and reason.startswith("flashinfer is not installed (")
    fake_module(monkeypatch, "flashinfer", __version__="0.6.1", **WRAPPERS)
    assert platform.flashinfer_status() == (True, "flashinfer 0.6.1")
    fake_module(monkeypatch, "flashinfer", __version__="0.9.0", **WRAPPERS)
    assert platform.flashinfer_status() == (True, "flashinfer 0.9.0 (outside the tested 0.5–0.7)")
    fake_module(monkeypatch, "flashinfer", __version__="0.6.1")
    assert platform.flashinfer_status() == (
        False,
        "flashinfer lacks BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper",
    )


def test_flashinfer_status_names_every_cause(monkeypatch, no_cuda_build) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    usable, reason = platform.flashinfer_status()
    assert not usable
    assert reason.startswith(f"no CUDA ({no_cuda_build}); flashinfer is not installed (")


def test_cupy_nccl_status(monkeypatch, fake_gpu) -> None:
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", None)
    usable, reason = platform.cupy_nccl_status()
    assert not usable and reason.startswith("cupy is not installed (")
    fake_module(monkeypatch, "cupy.cuda.nccl", available=False)
    assert platform.cupy_nccl_status() == (
        False,
        "cupy is installed without NCCL support (cupy.cuda.nccl.available)",
    )
    fake_module(monkeypatch, "cupy.cuda.nccl", available=True, get_version=lambda: 22703)
    assert platform.cupy_nccl_status() == (True, "cupy NCCL 22703")


def test_nixl_gpu_status(monkeypatch, fake_gpu) -> None:
    monkeypatch.setitem(sys.modules, "nixl_cu13", None)
    usable, reason = platform.nixl_gpu_status()
    assert not usable and reason.startswith("nixl_cu13 is not installed (")
    fake_module(monkeypatch, "nixl_cu13")
    monkeypatch.setattr(importlib.metadata, "version", {"nixl-cu13": "1.5.1"}.__getitem__)
    assert platform.nixl_gpu_status() == (True, "nixl-cu13 1.5.1")


def test_nixl_gpu_status_without_cuda(no_cuda_build) -> None:
    # `make test` installs nixl-cu13, so CUDA is all that is missing
    assert platform.nixl_gpu_status() == (False, f"no CUDA ({no_cuda_build})")


def test_make_backend_by_capability(monkeypatch, no_cuda_build) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert type(make_backend("auto", cpu)) is TorchAttentionBackend
    assert type(make_backend("auto", cuda)) is TorchAttentionBackend  # flashinfer unusable
    reason = platform.flashinfer_status()[1]
    with pytest.raises(ConfigError) as info:
        make_backend("flashinfer", cuda)
    assert str(info.value) == f"attention backend 'flashinfer' is unusable here: {reason}"
    with pytest.raises(ConfigError) as info:
        make_backend("flashinfer", cpu)
    assert str(info.value) == (
        "attention backend 'flashinfer' is unusable here: device is cpu, flashinfer needs a "
        f"CUDA device; {reason}"
    )
    with pytest.raises(ValueError, match=r"^unknown attention backend 'fa3'; available: auto"):
        make_backend("fa3", cuda)


def test_gpu_transfer_backends_name_the_reason(no_cuda_build) -> None:
    layers = [torch.zeros(4, 2, 4, 2, 8) for _ in range(2)]
    for make in (lambda: make_sender("nccl"), lambda: make_receiver("nccl", layers)):
        with pytest.raises(TransferError) as info:
            make()
        assert str(info.value).startswith(
            f"nccl KV transfer is unusable here: no CUDA ({no_cuda_build})"
        )
