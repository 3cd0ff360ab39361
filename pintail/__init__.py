"""pintail: memory-bound GPU kernels for language-model training, in Triton."""

from . import nn
from .cross_entropy import cross_entropy
from .gated import geglu, swiglu
from .linear_cross_entropy import linear_cross_entropy
from .norm import layer_norm, rms_norm
from .rotary import apply_rotary, rotary
from .softmax import log_softmax, softmax
from .transformers import patch

__all__ = ["apply_rotary", "cross_entropy", "geglu", "layer_norm", "linear_cross_entropy", "log_softmax", "nn",
           "patch", "rms_norm", "rotary", "softmax", "swiglu"]
__version__ = "0.1.0"
