"""Packed int4 weights, quantizers, ``QuantLinear`` and the registered ops."""
from . import ops  # noqa: F401  (registers spear::w4a16_linear / spear::ec_linear)
from .format import LAYOUTS, QuantFormatError, QuantizedWeight, pack_int4, unpack_int4
from .linear import QuantLinear
from .rtn import quantize_rtn

__all__ = ["LAYOUTS", "QuantFormatError", "QuantizedWeight", "QuantLinear", "pack_int4", "quantize_rtn", "unpack_int4"]
