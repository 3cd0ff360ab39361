"""An op package's submodules (plans, api, kernels) seen as one namespace, through which the
tools read kernels and plan tables and set tables (each in the module that defines it)."""

import importlib
import importlib.util

SUBMODULES = ("plans", "api", "kernels", "kernels_forward", "kernels_backward")


class Op:
    def __init__(self, name):
        modules = [importlib.import_module(f"pintail.{name}.{sub}") for sub in SUBMODULES
                   if importlib.util.find_spec(f"pintail.{name}.{sub}") is not None]
        object.__setattr__(self, "_modules", modules)

    def __getattr__(self, attr):
        for module in self._modules:
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(attr)

    def __setattr__(self, attr, value):
        for module in self._modules:  # plans first: the api reads its tables through that module
            if hasattr(module, attr):
                setattr(module, attr, value)
                return
        raise AttributeError(attr)
