"""linear_cross_entropy: the language-model head and its cross-entropy without the logits.

x (M, K) times the head W (V, K), plus a bias, gives logits (M, V) that are held whole only
where the memory budget allows. Three plans (plans.py chooses within the budget):
- token chunks (tokens.py; the default with gradients and reduction "mean" or "sum"): m rows
  at a time over the whole vocabulary. A GEMM writes the rows' logits into a reused buffer,
  a kernel folds each row into its loss and log-sum-exp, another writes the gradient of the
  summed loss over the logits, and GEMMs take from it the rows' dx and dW += G^T x (float32
  sums). The backward scales them by the incoming gradient. Three GEMMs.
- vocabulary chunks (api.py): chunks of classes for every row; the forward folds each chunk
  into every row's running (max, sum of exp) state, the backward computes each chunk's
  logits again and takes dx += G W[chunk] and dW[chunk] = G^T x. Four GEMMs, the least
  workspace; reduction "none" and calls without gradients take it.
- kept logits (api.py, eager): a budget of the whole logits keeps them for the backward.
The per-element formulas are cross_entropy's (pintail/cross_entropy/__init__.py).
"""

from .api import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
