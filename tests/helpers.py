"""Comparison helpers: pintail against torch, with a float64 computation as the truth."""

import torch

# Relative to the largest magnitude in the truth; torch in the same dtype is the other bar.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_matches(ours, truth, torch_same_dtype, unit=1e-2, factor=2):
    """`ours` equals the float64 `truth` up to the dtype's tolerance, or errs no more than
    `factor` times what torch errs in the same dtype; NaN and +-inf in the same places. The tolerance
    is relative to the largest magnitude in the truth, or to `unit` where that is smaller
    (a truth of exact zeros still allows rounding of the terms that cancel to it)."""
    assert ours.shape == truth.shape, (ours.shape, truth.shape)
    assert ours.dtype == torch_same_dtype.dtype, (ours.dtype, torch_same_dtype.dtype)
    ours64, truth64 = ours.detach().double().cpu(), truth.detach().double().cpu()
    torch64 = torch_same_dtype.detach().double().cpu()
    assert torch.equal(torch.isnan(ours64), torch.isnan(truth64)), "NaN in different places"
    infinite = torch.isinf(truth64)
    assert torch.equal(ours64[infinite], truth64[infinite]), "infinities differ"
    finite = torch.isfinite(truth64)
    if not finite.any():
        return
    err = (ours64[finite] - truth64[finite]).abs().max().item()
    torch_err = (torch64[finite] - truth64[finite]).abs().max().item()
    scale = max(truth64[finite].abs().max().item(), unit)
    allowed = max(factor * torch_err, TOLERANCE[ours.dtype] * scale)
    assert err <= allowed, f"max error {err:.3g} > allowed {allowed:.3g} (torch errs {torch_err:.3g})"


def boundary_shifts(dtype, boundary):
    """The SHIFTs `cluster.window` may give rows of `dtype` at a `boundary` of 16 to 128 bytes:
    the elements of 16 bytes up to those of `boundary` bytes, by powers of 2 (which one
    depends on the tensors' alignment and strides)."""
    size = torch.empty((), dtype=dtype).element_size()
    return {16 // size * 2**k for k in range(8) if 16 * 2**k <= boundary}


def line_aligned_rows(n, width, offset=0, dtype=torch.bfloat16, device="cpu"):
    """A view `offset` elements into 4 rows of `width` elements, n wide, whose storage starts
    on a 128-byte boundary whatever the allocator's alignment."""
    wide = torch.empty(4, width + 64, dtype=dtype, device=device)
    wide = wide[:, (-wide.data_ptr() % 128) // wide.element_size():]
    return wide[:, offset:offset + n]
