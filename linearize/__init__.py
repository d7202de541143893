"""linearize: turn a pretrained Transformer LLM into a hybrid linear-attention model."""

from .api import load_model, save_adapter
from .convert import MODES, convert, layer_modes, new_parameters, set_active, set_mode
from .layers.registry import KINDS
from .modeling import FAMILIES, UnsupportedModelError
from .spec import ConversionSpec, LayerSpec, SpecError

__all__ = [
    "ConversionSpec",
    "FAMILIES",
    "KINDS",
    "LayerSpec",
    "MODES",
    "SpecError",
    "UnsupportedModelError",
    "convert",
    "layer_modes",
    "load_model",
    "new_parameters",
    "save_adapter",
    "set_active",
    "set_mode",
]
__version__ = "0.1.0"
