"""softmax and log_softmax along any dim: Triton kernels, launch heuristics, autograd,
and torch.library registration.

Bytes per element (the floor): forward reads x and writes y; backward reads y and dy and
writes dx. Every kernel here moves each of those once through HBM.

Plans, picked by row length N:
- rows: N fits on chip. A program loads a tile of whole rows into registers, reduces,
  and writes; one read, one write, one exp per element.
- cluster (GPUs with thread-block clusters, rows of 16385 to 262144): a row across the
  CTAs of a cluster, each slice in registers, the slices' (max, sum) or partial sums traded
  through distributed shared memory (pintail/_core/cluster.py); one read, one write, one exp per
  element. Shorter rows (forward up to 131072, backward up to 65536) go one cluster a row;
  longer ones on persistent clusters that load their next row's slice while they work. The
  persistent forward leaves its last rows to the two-pass plan on the SMs its clusters leave
  idle, launched behind them in the same stream (programmatic dependent launch, SIDE_ROWS).
  Elsewhere (GPUs without clusters) the plans below take these rows:
- packed (forward, bf16 / fp16 rows of even length from 28672 to 32768): a program a row
  holds the row in registers as 32-bit words of two values and unpacks them for each pass
  over the row; one read, one write, two exps per element.
- two pass (forward, rows of up to 64 KB: N up to 32768 in bf16 / fp16): a program a row
  reads it twice, the second time from L2 (the first read asks L2 to keep it); y written
  once, two exps per element.
- split: N is too long for one program (pintail/_core/split.py: ticket-ordered slices, the
  output written `lag` rows behind the reads). Each slice publishes its (max, sum of
  exp(x - max)); the lagged write combines them into the log-sum-exp. HBM traffic: x read
  once, y written once.
- own row (softmax backward, rows of 32769 to 524288 elsewhere): ticket-ordered slices too, but a
  program keeps its slice of y and dy in registers, publishes the slice's partial sum, and
  writes dx of that same slice once the row's other slices have published
  (pintail/_core/split.py). No L2 re-read: 0.82-0.84 of copy against the lagged plan's 0.80-0.81.
"""

from .api import log_softmax, softmax

__all__ = ['log_softmax', 'softmax']
