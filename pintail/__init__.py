"""pintail: memory-bound GPU kernels for language-model training, in Triton."""

from . import nn
from .softmax import log_softmax, softmax

__all__ = ["softmax", "log_softmax", "nn"]
__version__ = "0.1.0"
