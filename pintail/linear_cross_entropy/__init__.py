"""linear_cross_entropy: the language-model head and its cross-entropy without the logits.

x (M, K) times the head W (V, K), plus a bias, gives logits (M, V) that are never held
whole. The forward runs the vocabulary in chunks of C classes: a GEMM writes a chunk's
logits into one reused (M, C) buffer and a kernel folds them into every row's running
(max, sum of exp), its smoothing sum and its target's logit (cross_entropy's online
log-sum-exp); after the last chunk each row has its loss and (max, log-sum). The backward
computes each chunk's logits again, a kernel writes their gradient over them (from the
row's log-sum-exp, as cross_entropy's backward), and GEMMs take from it dx += G W[chunk]
(float32 sum over the chunks for 16-bit x) and dW[chunk] = G^T x (complete at once: no
float32 re-reads of dW). Four GEMMs in all, against three for the composition, and a
workspace of one chunk; the formulas are cross_entropy's (pintail/cross_entropy/__init__.py).
"""

from .api import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
