"""An op package's submodules (plans, api, kernels), with the shared loss layer's for the
losses, seen as one namespace, through which the tools read kernels and plan tables and set
tables (in every module that holds the name, so the module that reads it sees the change)."""

import importlib
import importlib.util

SUBMODULES = ("plans", "api", "kernels", "kernels_forward", "kernels_backward")
SHARED = {"cross_entropy": ("_loss.plans", "_loss.kernels"),
          "linear_cross_entropy": ("_loss.plans", "_loss.kernels", "_loss.chunks")}


class Op:
    def __init__(self, name):
        names = [f"pintail.{name}.{sub}" for sub in SUBMODULES] + [f"pintail.{m}" for m in SHARED.get(name, ())]
        modules = [importlib.import_module(m) for m in names if importlib.util.find_spec(m) is not None]
        object.__setattr__(self, "_modules", modules)

    def __getattr__(self, attr):
        for module in self._modules:
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(attr)

    def __setattr__(self, attr, value):
        holders = [module for module in self._modules if hasattr(module, attr)]
        if not holders:
            raise AttributeError(attr)
        for module in holders:
            setattr(module, attr, value)
