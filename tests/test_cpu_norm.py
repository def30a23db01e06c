"""The fused residual-add + RMSNorm C kernel (engine/cpu_norm.py) against torch's rms_norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import cpu_norm
from pdserve.engine.cpu_norm import add_rms_norm


@pytest.fixture(autouse=True)
def _kernel_built() -> None:
    """Never skipped: `make test` installs a C compiler, so a kernel that did not build fails."""
    if cpu_norm._kernel() is None:
        pytest.fail("the RMSNorm C kernel did not build (make test installs gcc)")


@pytest.mark.parametrize("rows", [1, 5, 64, 130])
@pytest.mark.parametrize("dim", [576, 100])
def test_equals_torch_with_and_without_the_residual(rows: int, dim: int) -> None:
    g = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=g)
    r = torch.randn(rows, dim, generator=g)
    w = torch.randn(dim, generator=g)
    expected_x = x + r
    expected = F.rms_norm(expected_x.double(), (dim,), w.double(), 1e-5)
    out = add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(x, expected_x)  # the residual was added in place, exactly
    # float32 sum of squares over dim terms, then three roundings: a few ulps of each output
    torch.testing.assert_close(out.double(), expected, rtol=4 * dim * 2**-24, atol=1e-6)
    x_alone = torch.randn(rows, dim, generator=g)
    ref = F.rms_norm(x_alone.double(), (dim,), w.double(), 1e-5)
    torch.testing.assert_close(
        add_rms_norm(x_alone, None, w, 1e-5).double(), ref, rtol=4 * dim * 2**-24, atol=1e-6
    )


def test_a_rows_result_does_not_depend_on_the_other_rows_or_threads() -> None:
    x = torch.randn(200, 576)
    w = torch.randn(576)
    whole = add_rms_norm(x.clone(), None, w, 1e-6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for row in (0, 63, 199):
            alone = add_rms_norm(x[row : row + 1].clone(), None, w, 1e-6)
            assert torch.equal(alone[0], whole[row])
    finally:
        torch.set_num_threads(threads)


def test_what_the_kernel_does_not_take_runs_through_torch() -> None:
    w = torch.randn(64)
    for x in (
        torch.randn(3, 64, dtype=torch.bfloat16),
        torch.randn(64, 3).t(),
        torch.randn(2, 3, 64),
    ):
        r = torch.ones_like(x)
        expected = F.rms_norm(x + r, (64,), w.to(x.dtype), 1e-5)
        out = add_rms_norm(x, r, w.to(x.dtype), 1e-5)
        torch.testing.assert_close(out, expected)
