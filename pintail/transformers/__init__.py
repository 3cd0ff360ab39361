"""pintail for Hugging Face transformers: `pintail.patch(model)` runs pintail's norms, rotary
embedding and fused head + loss inside a causal language model. Importing this package does
not import transformers; patching a model does."""

from .patch import FAMILIES, patch

__all__ = ["FAMILIES", "patch"]
