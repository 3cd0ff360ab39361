"""linear_distillation_loss: a teacher's and a student's distributions over the vocabulary
compared from their hidden states and heads, without either's logits.

Per row, with log-probabilities lp_s = log_softmax(s / T), lp_t = log_softmax(t / T) and
a = dloss/dp_s (a constant per row aside):
    beta = 0: loss = sum p_t (lp_t - lp_s),           dloss/ds = (p_s - p_t) / T
    beta = 1: loss = sum p_s (lp_s - lp_t),           a = lp_s - lp_t
    else:     loss = beta sum p_t (lp_t - lm) + (1 - beta) sum p_s (lp_s - lm),
              lm = log(beta p_t + (1 - beta) p_s),   a = (1 - beta) (lp_s - lm)
and dloss/ds_k = p_s,k (a_k - sum_j p_s,j a_j) / T: the kernel takes each row in three passes
(the two log-sum-exps, the loss and sum p_s a, the gradient).
"""

from .api import linear_distillation_loss

__all__ = ["linear_distillation_loss"]
