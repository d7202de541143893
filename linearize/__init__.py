"""linearize: turn a pretrained Transformer LLM into a hybrid linear-attention model.

The names below load on first use (``linearize.load_model`` imports torch and transformers then), so
``import linearize`` and the command line's ``--help`` stay fast. Using any of them registers the
converted model classes with transformers' Auto classes (so does ``import linearize.modeling``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

_EXPORTS = {
    "ConversionSpec": "spec",
    "FAMILIES": "modeling",
    "KINDS": "layers.registry",
    "LayerSpec": "spec",
    "MODES": "convert",
    "SpecError": "spec",
    "UnsupportedModelError": "modeling",
    "convert": "convert",
    "layer_modes": "convert",
    "load_model": "api",
    "new_parameters": "convert",
    "save_adapter": "api",
    "set_active": "convert",
    "set_mode": "convert",
}
"""Public name -> the module (below this package) that defines it."""

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


class _Package(types.ModuleType):
    def __getattr__(self, name: str):
        if name in _EXPORTS:
            value = getattr(importlib.import_module(f"{self.__name__}.{_EXPORTS[name]}"), name)
            super().__setattr__(name, value)
            return value
        if not name.startswith("_") and importlib.util.find_spec(f"{self.__name__}.{name}") is not None:
            return importlib.import_module(f"{self.__name__}.{name}")  # a submodule: linearize.api, linearize.hub, ...
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule linearize.convert sets the package's attribute `convert`: the
        # function of that name stays the package's `convert`.
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted({*super().__dir__(), *_EXPORTS})


sys.modules[__name__].__class__ = _Package
