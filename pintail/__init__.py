"""pintail: memory-bound GPU kernels for language-model training, in Triton."""

from . import hub, losses, nn
from .cross_entropy import cross_entropy
from .distillation import linear_distillation_loss
from .gated import geglu, swiglu
from .linear_cross_entropy import linear_cross_entropy
from .log_probs import linear_log_probs, log_probs
from .norm import layer_norm, rms_norm
from .rotary import apply_rotary, rotary
from .softmax import log_softmax, softmax
from .transformers import patch

__all__ = ["apply_rotary", "cross_entropy", "geglu", "hub", "layer_norm", "linear_cross_entropy",
           "linear_distillation_loss", "linear_log_probs", "log_probs", "log_softmax", "losses", "nn", "patch",
           "rms_norm", "rotary", "softmax", "swiglu"]
__version__ = "0.1.0"
