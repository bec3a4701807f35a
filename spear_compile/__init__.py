"""spear_compile: error-compensated 4-bit LLMs as a ``torch.compile`` backend.

    import spear_compile as spear
    spear.quantize_(model, spear.QuantConfig(bits=4, group_size=None))
    cmodel = torch.compile(model, backend="spear")

See README.md and docs/design.md for the method and the compiler.
"""
from . import quant  # noqa: F401  (registers the spear:: ops)
from .api import attach_, detach_, quantize_, quantized_linears
from .artifacts import ArtifactError, load, save
from .compensators import ErrorCompensator, register_ec
from .config import CompileConfig, ECConfig, QuantConfig
from .errors import UnmatchedECError
from .passes import compile_config, spear_backend
from .passes.backend import register as _register_backend
from .quant import QuantFormatError, QuantLinear

from ._version import __version__

_register_backend()

from . import errors, inspect, parallel  # noqa: E402,F401  (spear.inspect.capture, spear.errors.*, spear.parallel.*)
from .tuner import tune  # noqa: E402  (spear.tune(model): the kernels measured for the model's shapes)

__all__ = [
    "ArtifactError", "CompileConfig", "ECConfig", "ErrorCompensator", "QuantConfig", "QuantFormatError", "QuantLinear",
    "attach_", "compile_config", "detach_", "load", "quantize_", "quantized_linears", "register_ec", "save", "spear_backend",
    "UnmatchedECError", "errors", "inspect", "tune",
]
