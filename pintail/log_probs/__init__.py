"""log_probs and linear_log_probs: each row's log-probability of its target and the entropy
of its distribution, from logits or from hidden states and a head without the logits.

Per row of logits x (V classes), with z = cap(x) / T (cap: softcap * tanh(x / softcap), or
x), lse = m + log(sum_j exp(z_j - m)) and p = softmax(z):
    lp = z_t - lse,  H = -sum_j p_j log p_j = log-sum - sum_j exp(z_j - m) (z_j - m) / sum_j exp(z_j - m)
    d lp / dz_k = [k == t] - p_k,  d H / dz_k = -p_k (log p_k + H)
and dz/dx = (1 - tanh^2) / T. The forward folds a row in one pass (the max, the sum of exp
and the entropy's sum, both rescaled as the max moves); the backward reads it again.
"""

from .api import linear_log_probs, log_probs

__all__ = ["log_probs", "linear_log_probs"]
