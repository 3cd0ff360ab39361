"""cross_entropy: Triton kernels, autograd, torch.library registration.

The loss works on rows: logits x[M, V] (classes along a row) and a target per row. The
kernels produce per-row results (the loss of each row and its log-sum-exp, lse). In eager
mode a one-program kernel after the forward reduces them (sum, or mean over kept rows or
their weights, in a fixed order) and the backward kernel takes the 0-d gradient and the
mean's denominator; under torch.compile the reduction is traced
torch ops and the backward kernel gets the gradient of each row's loss.

Class-index targets, per row with target t, class weights w (all 1 without weights),
W = sum(w), smoothing e, V classes, logp = x - lse, lse = m + log(sum_j exp(x_j - m)) with m
the row's max (kept as the pair (m, log-sum) per row: x - m is exact where x is near m, so
losses and probabilities stay accurate for logits of 1e4, as torch's log_softmax):
    loss = (1 - e) * w_t * (lse - x_t) + (e / V) * (W * lse - sum_j w_j x_j) + z * lse^2
    dloss/dx_k = p_k * ((1 - e) w_t + (e / V) W + 2 z lse) - (1 - e) w_t [k == t] - (e / V) w_k
Probability targets y, smoothed y' = (1 - e) y + e / V, B = sum_j w_j y'_j:
    loss = B * lse - sum_j w_j y'_j x_j + z * lse^2
    dloss/dx_k = p_k * (B + 2 z lse) - w_k y'_k
Softcap c: every logit is first c * tanh(x / c); the gradient gains a factor 1 - tanh^2.

Bytes: the forward reads the logits once (one program per row, an online log-sum-exp with
one exp per element: a scalar max per chunk, exp2 of pre-shifted logits); the backward reads
them again and writes the gradient (a program per row and chunk). No (M, V) temporaries.
"""

from .api import cross_entropy

__all__ = ['cross_entropy']
