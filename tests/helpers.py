"""Comparison helpers: pintail against a float64 computation of the same quantity.

One rule for the suite, entry by entry: |ours - truth| <= RTOL * (|truth| + scale), where
RTOL is about one unit in the last place of the output's dtype and `scale` is the
quantity's natural size (by default the root mean square of the truth), plus a bound on
the norm-wise relative error. A wrong chunk, a dropped term or a zeroed tail fails it
however small the entries it touches (tests/test_helpers.py feeds it such corruptions).
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# One unit in the last place at 1 (the machine epsilon) of each output dtype: an output
# rounded once to nearest errs by half of it; the bound leaves as much again for the float32
# arithmetic before that rounding.
RTOL = {torch.float64: 1e-12, torch.float32: 2.0**-19, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# The norm-wise relative error, below the entry-wise bound: an output whose every entry errs
# near that bound fails. 16-bit outputs: half (roundings of random sign add in quadrature);
# float32: 3/4 (errors of exp and log are partly systematic).
NORM_RTOL = {torch.float64: 1e-13, torch.float32: 0.75 * 2.0**-19, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rms(t):
    """Root mean square of the finite entries of t (0 for none)."""
    t = t.detach().double()
    t = t[torch.isfinite(t)]
    return t.square().mean().sqrt().item() if t.numel() else 0.0


def assert_matches(ours, truth, same_dtype=None, *, scale=None, rtol=None, norm_rtol=None):
    """`ours` equals the float64 `truth` entry by entry within rtol * (|truth| + scale), and
    its norm-wise relative error is at most norm_rtol (both by ours' dtype unless given);
    NaN and +-inf in the same places (a truth past the dtype's range counts as the infinity it
    rounds to). `same_dtype`: a tensor whose dtype ours must have
    (torch's result in the same dtype). `scale`: the natural size of the quantity, which
    bounds the absolute error where entries cancel to near 0: a number, or a tensor of one
    for each entry (default: rms of the truth)."""
    assert ours.shape == truth.shape, (ours.shape, truth.shape)
    if same_dtype is not None:
        assert ours.dtype == same_dtype.dtype, (ours.dtype, same_dtype.dtype)
    rtol = RTOL[ours.dtype] if rtol is None else rtol
    norm_rtol = NORM_RTOL[ours.dtype] if norm_rtol is None else norm_rtol
    # on ours' device: a GPU compares rows of 10^7 entries at once, the host takes seconds each
    got, want = ours.detach().double(), truth.detach().double().to(ours.device)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN in different places"
    rounded = want.to(ours.dtype).double()  # a truth past the dtype's range rounds to +-inf
    infinite = torch.isinf(rounded)
    assert torch.equal(got[infinite], rounded[infinite]), "infinities differ"
    finite = torch.isfinite(rounded)
    if not finite.any():
        return
    if isinstance(scale, torch.Tensor):  # entry by entry
        scale = scale.detach().double().to(ours.device).expand(want.shape)[finite]
    got, want = got[finite], want[finite]
    scale = rms(want) if scale is None else scale
    err = (got - want).abs()
    # Below the normal range the spacing is fixed: fp16 holds 1e-6 only to a multiple of
    # 6e-8, and an operand rounded there errs by that much absolutely, which the op's other
    # factors (of size 1 in these tests) carry into its result: 4 spacings. The float32
    # arithmetic of every kernel keeps nothing reliable below about 1e-37 (a GPU flushes
    # subnormals to 0).
    floor = 4 * torch.finfo(ours.dtype).smallest_normal * rtol
    if ours.dtype != torch.float64:
        floor = max(floor, 8 * torch.finfo(torch.float32).smallest_normal)
    allowed = rtol * (want.abs() + scale) + floor
    worst = (err - allowed).argmax()
    assert err[worst] <= allowed[worst], (
        f"entry {worst.item()} of {want.numel()}: |{got[worst].item():.6g} - {want[worst].item():.6g}| = "
        f"{err[worst].item():.3g} > {allowed[worst].item():.3g} (rtol {rtol:.3g}); "
        f"{(err > allowed).sum().item()} entries out")
    # norm-wise: ||ours - truth|| <= norm_rtol * (||truth|| + ||scale||), the scale's norm
    # taken as if it stood at every entry; over the entries in the dtype's normal range (below
    # it a result rounds to a fixed spacing, not a relative one: the floor above bounds those)
    normal = want.abs() >= torch.finfo(ours.dtype).smallest_normal
    if isinstance(scale, torch.Tensor):
        scale = scale[normal]
    got, want = got[normal], want[normal]
    size = want.norm().item() + (scale.norm().item() if isinstance(scale, torch.Tensor)
                                 else scale * want.numel() ** 0.5)
    if size > 0:
        relative = (got - want).norm().item() / size
        assert relative <= norm_rtol, f"norm-wise relative error {relative:.3g} > {norm_rtol:.3g}"


def assert_rows_sum_to_one(probabilities, dim=-1):
    """Each row of a softmax sums to 1 to the output dtype's rounding of its entries."""
    sums = probabilities.double().sum(dim)
    n = probabilities.shape[dim]
    allowed = RTOL[probabilities.dtype] * max(n, 1) ** 0.5
    assert ((sums - 1).abs() <= allowed).all(), f"row sums off by up to {(sums - 1).abs().max().item():.3g}"


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


class GemmFlops(TorchDispatchMode):
    """2 m n k of every matrix product (mm, addmm, in place or out= too) while active, and
    how many there were."""

    def __init__(self):
        super().__init__()
        self.flops = self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            matrices = [a for a in args if isinstance(a, torch.Tensor)]  # out_dtype's overload ends in a dtype
            a, b = matrices[-2:] if name != "mm" else matrices[:2]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            self.calls += 1
        return func(*args, **(kwargs or {}))
