"""DPO, CPO, SimPO, ORPO and KTO in their papers' usual forms."""

import torch
import torch.nn.functional as F

from ..log_probs import linear_log_probs


def token_log_probs(name, input, linear_weight, target, linear_bias, ignore_index, memory_budget, temperature=1.0):
    """Each target token's log-probability (0 where ignored) and the kept mask, (batch, seq)."""
    if input.dim() != 3 or target.shape != input.shape[:2]:
        raise ValueError(f"{name}: input must be (batch, seq, hidden) and target (batch, seq), got input "
                         f"{list(input.shape)} and target {list(target.shape)}")
    lp = linear_log_probs(input, linear_weight, target, linear_bias=linear_bias, temperature=temperature,
                          ignore_index=ignore_index, memory_budget=memory_budget)
    return lp, target != ignore_index


def _per_sequence(lp, kept, average):
    total = lp.sum(-1)
    return total / kept.sum(-1).clamp(min=1) if average else total


def sequence_log_probs(input, linear_weight, target, *, linear_bias=None, ignore_index=-100, average=False,
                       memory_budget=None):
    """Each sequence's log-probability of its target tokens from hidden states (batch, seq,
    hidden) and the head: the sum over kept tokens, or with average=True their mean (the
    length-normalised form of SimPO and ORPO). No logits are made; gradients flow to input,
    linear_weight and linear_bias. Use it under torch.no_grad() for a reference model's."""
    lp, kept = token_log_probs("pintail.losses.sequence_log_probs", input, linear_weight, target, linear_bias,
                                ignore_index, memory_budget)
    return _per_sequence(lp, kept, average)


def _halves(name, values):
    if values.shape[0] % 2:
        raise ValueError(f"{name}: the batch must be chosen then rejected completions, an even number of rows, "
                         f"got {values.shape[0]}")
    half = values.shape[0] // 2
    return values[:half], values[half:]


def _reference(name, label, value, like):
    if not isinstance(value, torch.Tensor) or value.shape != like.shape:
        raise ValueError(f"{name}: {label} must be a tensor of one log-probability per pair ({list(like.shape)}), "
                         f"got {list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
    return value.to(like.dtype)


def _smoothed_sigmoid_loss(z, label_smoothing):
    """-log sigmoid(z), with label smoothing e: the preference flipped with probability e (cDPO)."""
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def _check_smoothing(name, label_smoothing):
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"{name}: label_smoothing must be in [0, 0.5), got {label_smoothing}")


def dpo_loss(input, linear_weight, target, ref_chosen_logps, ref_rejected_logps, *, beta=0.1, label_smoothing=0.0,
             linear_bias=None, ignore_index=-100, memory_budget=None):
    """Direct Preference Optimization (Rafailov et al., 2023): the mean over pairs of
    -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), pi the policy's summed log-probs
    of the chosen and rejected completions, ref the reference model's (tensors of one value a
    pair, e.g. sequence_log_probs under no_grad); label_smoothing e gives conservative DPO."""
    name = "pintail.losses.dpo_loss"
    _check_smoothing(name, label_smoothing)
    lp, kept = token_log_probs(name, input, linear_weight, target, linear_bias, ignore_index, memory_budget)
    chosen, rejected = _halves(name, _per_sequence(lp, kept, False))
    margin = (chosen - _reference(name, "ref_chosen_logps", ref_chosen_logps, chosen)) - \
        (rejected - _reference(name, "ref_rejected_logps", ref_rejected_logps, rejected))
    return _smoothed_sigmoid_loss(beta * margin, label_smoothing).mean()


def _chosen_nll(lp, kept):
    """The negative log-likelihood of the chosen half, a mean over its kept tokens."""
    chosen_lp, _ = _halves("nll", lp)
    chosen_kept, _ = _halves("nll", kept)
    return -chosen_lp.sum() / chosen_kept.sum().clamp(min=1)


def cpo_loss(input, linear_weight, target, *, beta=0.1, alpha=1.0, label_smoothing=0.0, linear_bias=None,
             ignore_index=-100, memory_budget=None):
    """Contrastive Preference Optimization (Xu et al., 2024): -log sigmoid(beta * (pi_c - pi_r))
    (summed log-probs, no reference model), its mean over pairs, plus alpha times the chosen
    completions' negative log-likelihood (mean over their tokens)."""
    name = "pintail.losses.cpo_loss"
    _check_smoothing(name, label_smoothing)
    lp, kept = token_log_probs(name, input, linear_weight, target, linear_bias, ignore_index, memory_budget)
    chosen, rejected = _halves(name, _per_sequence(lp, kept, False))
    preference = _smoothed_sigmoid_loss(beta * (chosen - rejected), label_smoothing).mean()
    return preference + alpha * _chosen_nll(lp, kept)


def simpo_loss(input, linear_weight, target, *, beta=2.0, gamma=0.5, label_smoothing=0.0, linear_bias=None,
               ignore_index=-100, memory_budget=None):
    """SimPO (Meng et al., 2024): -log sigmoid(beta * (avg_c - avg_r) - gamma), avg the
    length-normalised (mean over kept tokens) log-probs, gamma the target reward margin; no
    reference model; the mean over pairs."""
    name = "pintail.losses.simpo_loss"
    _check_smoothing(name, label_smoothing)
    lp, kept = token_log_probs(name, input, linear_weight, target, linear_bias, ignore_index, memory_budget)
    chosen, rejected = _halves(name, _per_sequence(lp, kept, True))
    return _smoothed_sigmoid_loss(beta * (chosen - rejected) - gamma, label_smoothing).mean()


def orpo_loss(input, linear_weight, target, *, beta=0.1, linear_bias=None, ignore_index=-100, memory_budget=None):
    """ORPO (Hong et al., 2024): the chosen completions' negative log-likelihood (mean over their
    tokens) minus beta (the paper's lambda) times the mean over pairs of log sigmoid of the log
    odds ratio log(odds_c / odds_r), odds = p / (1 - p) of the length-normalised p."""
    name = "pintail.losses.orpo_loss"
    lp, kept = token_log_probs(name, input, linear_weight, target, linear_bias, ignore_index, memory_budget)
    chosen, rejected = _halves(name, _per_sequence(lp, kept, True))
    log_odds = (chosen - rejected) - (torch.log(-torch.expm1(chosen)) - torch.log(-torch.expm1(rejected)))
    return _chosen_nll(lp, kept) - beta * F.logsigmoid(log_odds).mean()


def kto_loss(input, linear_weight, target, ref_logps, desirable, *, beta=0.1, desirable_weight=1.0,
             undesirable_weight=1.0, kl=None, linear_bias=None, ignore_index=-100, memory_budget=None):
    """Kahneman-Tversky Optimization (Ethayarajh et al., 2024), unpaired: each completion is
    desirable or not (`desirable`, a bool per row); r = pi - ref (summed log-probs, ref a
    tensor of one value a row); the loss is desirable_weight * (1 - sigmoid(beta * (r - z)))
    for a desirable row, undesirable_weight * (1 - sigmoid(beta * (z - r))) otherwise, its mean
    over rows; z is `kl`, the reference point (an estimate of KL(policy || reference), taken
    without gradient and clamped at 0), 0 when None."""
    name = "pintail.losses.kto_loss"
    lp, kept = token_log_probs(name, input, linear_weight, target, linear_bias, ignore_index, memory_budget)
    logps = _per_sequence(lp, kept, False)
    reward = logps - _reference(name, "ref_logps", ref_logps, logps)
    if not isinstance(desirable, torch.Tensor) or desirable.shape != logps.shape or desirable.dtype != torch.bool:
        raise ValueError(f"{name}: desirable must be a bool tensor of one value a row ({list(logps.shape)})")
    z = torch.zeros((), dtype=reward.dtype, device=reward.device) if kl is None else \
        torch.as_tensor(kl, dtype=reward.dtype, device=reward.device).detach().clamp(min=0)
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (reward - z))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z - reward))))
    return losses.mean()
