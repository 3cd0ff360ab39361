"""Preference and policy losses from hidden states and the head, without logits: each is a
few torch ops of O(batch x sequence) on top of linear_log_probs, whose cost they take.
Preference losses take a batch whose first half is the chosen completions and second half
the rejected ones, row for row; targets are the tokens each position predicts (shifted),
ignore_index on the prompt and padding."""

from .policy import grpo_loss
from .preference import cpo_loss, dpo_loss, kto_loss, orpo_loss, sequence_log_probs, simpo_loss

__all__ = ["cpo_loss", "dpo_loss", "grpo_loss", "kto_loss", "orpo_loss", "sequence_log_probs", "simpo_loss"]
