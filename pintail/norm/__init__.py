"""rms_norm and layer_norm: Triton kernels, autograd, torch.library registration.

Per row of N features (RMS: mean = 0), with w_eff = weight + weight_offset:
    rstd = 1 / sqrt(mean((x - mean)^2) + eps),  x^ = (x - mean) * rstd,  y = x^ * w_eff + bias
Backward, with g = dy * w_eff:
    dx = rstd * (g - x^ * mean(g x^))                (RMS)
    dx = rstd * (g - mean(g) - x^ * mean(g x^))      (LayerNorm)
    dweight = sum over rows of dy * x^,  dbias = sum over rows of dy
A fused residual (pre-norm blocks): h = x + residual is normalised and returned too; the
gradient reaching h from downstream adds to dx (and is also the residual's gradient).

Kernels, six plans by row length N (tables at the end of the kernels):
- rows: whole rows in registers. The forward reads a tile of rows once and writes it once;
  the backward is persistent, each program walking a fixed set of row tiles, writing dx
  and keeping dweight / dbias of its rows in registers, written once as a partial row.
  Where a row would leave its next_power_of_2(N) tile part empty, it can go as two tiles
  (rows_tail: 5120 = 4096 + 1024), so that no lane computes past the row.
- long: a program per row in two passes (statistics, then the output), the second pass
  re-reading the row (also RMSNorm's forward of rows of 513-16384, as one chunk); the
  backward (LayerNorm) on a grid of (row blocks x column chunks), each program keeping its
  chunk's dweight / dbias in registers, after a first small kernel has computed each row's
  sums mean(g x^), mean(g) (x and dy are read twice).
- packed (LayerNorm's forward of 16-bit rows of 28672-32768): the row in registers as
  32-bit words of two values, read once, the output written in parts.
- split (forward, the longest rows): ticket-ordered slices (pintail/_core/split.py), each
  publishing its sums, the output written `lag` rows behind from a re-read that hits L2:
  x read from HBM once, y written once.
- blocks (RMSNorm backward, rows past the rows plan): ticket-ordered (block of rows, slice)
  pairs; a block's slices exchange each row's sum of g x^ and write dx from registers: x
  and dy read once, dx written once.
- cluster (GPUs with thread-block clusters; the backward of rows of 8193-32768 without a
  residual's gradient, RMSNorm's forward of rows of 32769-262144 without a residual): a
  row across the CTAs of a cluster (pintail/_core/cluster.py), each holding its slice of x (and
  dy), the slices' sums (of x^2; of g and g x^) traded through distributed shared memory;
  every tensor read once and written once, one partial row of dweight / dbias a cluster.
The backward's partial rows of dweight / dbias are summed in a fixed order by one more
kernel (deterministic: no atomics), which writes them in the parameters' dtypes.
Means divide by multiplying with 1/N from the host: Triton's float32 division is approximate,
and sum(g)/1 must be g exactly (the LayerNorm gradient of a row of one element is 0).
"""

from .api import layer_norm, rms_norm

__all__ = ['layer_norm', 'rms_norm']
