"""GRPO's clipped policy loss with a KL penalty to a reference (Shao et al., 2024)."""

import torch

from .preference import token_log_probs


def grpo_loss(input, linear_weight, target, advantages, *, old_log_probs=None, ref_log_probs=None, beta=0.04,
              epsilon=0.2, epsilon_high=None, temperature=1.0, loss_type="grpo", linear_bias=None, ignore_index=-100,
              memory_budget=None):
    """GRPO from hidden states (batch, seq, hidden) and the head, no logits. Per kept token,
    ratio = exp(lp - old_log_probs) (old: the sampling policy's log-probs, (batch, seq); None:
    lp itself without gradient, a single update) and the loss
    -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL, A the row's
    advantage (`advantages`, one a row) and KL = exp(ref - lp) - (ref - lp) - 1 to the
    reference's log-probs `ref_log_probs` (needed where beta > 0). loss_type "grpo": the mean
    over each row's kept tokens, then over rows; "token": the mean over all kept tokens (DAPO's
    form). temperature divides the logits, as the sampler's did."""
    name = "pintail.losses.grpo_loss"
    if loss_type not in ("grpo", "token"):
        raise ValueError(f"{name}: loss_type must be 'grpo' or 'token', got {loss_type!r}")
    if beta and ref_log_probs is None:
        raise ValueError(f"{name}: beta={beta} weighs a KL term to the reference: pass ref_log_probs (or beta=0)")
    if not isinstance(advantages, torch.Tensor) or advantages.shape != target.shape[:1]:
        raise ValueError(f"{name}: advantages must be a tensor of one value a row ({target.shape[0]}), got "
                         f"{list(advantages.shape) if isinstance(advantages, torch.Tensor) else advantages!r}")
    for label, value in (("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs)):
        if value is not None and value.shape != target.shape:
            raise ValueError(f"{name}: {label} must have target's shape {list(target.shape)}, got {list(value.shape)}")
    lp, kept_mask = token_log_probs(name, input, linear_weight, target, linear_bias, ignore_index, memory_budget,
                                    temperature)
    kept = kept_mask.to(lp.dtype)
    zero = lp.new_zeros(())  # ignored tokens: ratio 1, KL 0, whatever old and ref hold there
    old = lp.detach() if old_log_probs is None else old_log_probs.to(lp.dtype)
    ratio = torch.exp(torch.where(kept_mask, lp - old, zero))
    A = advantages.to(lp.dtype)[:, None]
    high = epsilon if epsilon_high is None else epsilon_high
    per_token = -torch.minimum(ratio * A, ratio.clamp(1 - epsilon, 1 + high) * A)
    if beta:
        log_ratio = torch.where(kept_mask, ref_log_probs.to(lp.dtype) - lp, zero)
        per_token = per_token + beta * (torch.exp(log_ratio) - log_ratio - 1)
    per_token = torch.where(kept_mask, per_token, zero)
    if loss_type == "token":
        return per_token.sum() / kept.sum().clamp(min=1)
    return (per_token.sum(-1) / kept.sum(-1).clamp(min=1)).mean()
