"""pintail's layers in the Hugging Face `kernels` layer contract: `kernels.kernelize` binds a
layer's `forward` to a model's module of the same layer name, so each class here has a forward
that reads the module's own state, no constructor and no members beyond the two mode flags."""

import torch
from torch import nn

from ..norm import rms_norm
from ..rotary import apply_rotary


class RMSNorm(nn.Module):
    """transformers' `@use_kernel_forward_from_hub("RMSNorm")` modules (Llama's rule, which all
    133 such classes in transformers 5.25 have): weight * normalised(x).to(x.dtype), in the
    dtype those two promote to."""

    can_torch_compile = True  # pintail's ops are torch.library ops with fake implementations
    has_backward = True

    def forward(self, hidden_states):
        shape, dtype = (hidden_states.shape[-1],), hidden_states.dtype
        if torch.promote_types(self.weight.dtype, dtype) == dtype:
            return rms_norm(hidden_states, shape, self.weight, self.variance_epsilon, out_dtype=dtype)
        # a wider weight (float32 beside 16-bit activations) multiplies the row rounded to their dtype
        return self.weight * rms_norm(hidden_states, shape, None, self.variance_epsilon)


class ApplyRotaryPosEmb(nn.Module):
    """transformers' `@use_kernel_forward_from_hub("rotary_pos_emb")` function
    apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1): q and k in one launch where cos and
    sin are per token and span the head (Llama's form); any other form (gpt-oss's half-width
    cos) runs the model's own function, which is the forward of the module this is bound to."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        if cos.dim() != 3 or not cos.shape[-1] == q.shape[-1] == k.shape[-1] or unsqueeze_dim not in (1, 2):
            return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)
        return apply_rotary(q, k, cos, sin, layout="bhsd" if unsqueeze_dim == 1 else "bshd")
