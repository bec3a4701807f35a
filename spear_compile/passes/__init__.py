"""The spear compiler: backend entry, pass manager, one FX pass per file."""
from .backend import compile_config, spear_backend
from .manager import PASSES, SpearPassManager

__all__ = ["PASSES", "SpearPassManager", "compile_config", "spear_backend"]
