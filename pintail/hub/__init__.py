"""pintail's layers on Hugging Face's kernel path: transformers models whose norm class is
marked `@use_kernel_forward_from_hub("RMSNorm")` (and whose apply_rotary_pos_emb is marked
"rotary_pos_emb") run pintail's kernels there, in training and inference, with

    model = AutoModelForCausalLM.from_pretrained(name, use_kernels=True,
                                                 kernel_config=pintail.hub.kernel_config())

or with `kernels.kernelize(model, mode=...)` inside `kernels.use_kernel_mapping(layer_mapping())`.
Importing this package imports neither `kernels` nor transformers."""

import base64
import hashlib
import json
import os
from pathlib import Path

from .modes import DEVICES, every_mode


# transformers' layer name: pintail's class in pintail.hub.layers
LAYERS = {"RMSNorm": "RMSNorm", "rotary_pos_emb": "ApplyRotaryPosEmb"}

# A local kernel repository as `kernels` 0.19 loads one: build/<variant>/metadata.json and the
# variant's __init__.py, imported as a module named by the metadata's id, whose `layers` holds
# the layer classes. torch-universal is the variant of pure-Python kernels, taken on any system.
_VARIANT = Path("build", "torch-universal")
_INIT = "from pintail.hub import layers  # noqa: F401\n"
_METADATA = {"id": "pintail_hub", "name": "pintail", "version": 1,
             "license": "MIT", "python-depends": [], "backend": {"type": "cuda"},
             # the variant's files but this one (kernels warns at each load of a variant without it)
             "digest": {"algorithm": "sha256",
                        "files": {"__init__.py": base64.b64encode(hashlib.sha256(_INIT.encode()).digest()).decode()}}}
_FILES = {"__init__.py": _INIT, "metadata.json": json.dumps(_METADATA, indent=2) + "\n"}


def repository(root=None) -> Path:
    """The path of pintail's local kernel repository, written under `root` (by default the
    user's cache directory) when missing or stale (rewritten where their text differs): two
    small files that import pintail.hub.layers."""
    root = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pintail"
    path = root / "hub"
    variant = path / _VARIANT
    variant.mkdir(parents=True, exist_ok=True)
    for name, text in _FILES.items():
        file = variant / name
        if not file.exists() or file.read_text() != text:
            # written whole beside the variant (whose every file the digest covers), then renamed in:
            # processes that start together never read half a file
            partial = path / f".{name}.{os.getpid()}"
            partial.write_text(text)
            os.replace(partial, file)
    return path


def layer_mapping(layers=tuple(LAYERS), root=None):
    """A mapping for kernels.use_kernel_mapping / register_kernel_mapping, then kernels.kernelize."""
    from kernels import LocalLayerRepository

    path = repository(root)
    return {name: every_mode(LocalLayerRepository(path, layer_name=LAYERS[name])) for name in layers}


def kernel_config(layers=tuple(LAYERS), root=None):
    """A KernelConfig for from_pretrained(..., use_kernels=True, kernel_config=...), new at each
    call (transformers rewrites its mapping in place): the layers in `layers` that the model
    marks; one that marks none of them raises."""
    from .config import PintailKernelConfig

    path = repository(root)
    return PintailKernelConfig({name: f"{path}:{LAYERS[name]}" for name in layers}, use_local_kernel=True)


__all__ = ["DEVICES", "LAYERS", "kernel_config", "layer_mapping", "repository"]
