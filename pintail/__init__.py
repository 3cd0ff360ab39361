"""pintail: memory-bound GPU kernels for language-model training, in Triton."""

from . import nn
from .cross_entropy import cross_entropy
from .softmax import log_softmax, softmax

__all__ = ["cross_entropy", "softmax", "log_softmax", "nn"]
__version__ = "0.1.0"
