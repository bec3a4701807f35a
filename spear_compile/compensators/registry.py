"""Which EC belongs to which quantized weight.

Two ways an EC reaches a layer:

* ``QuantLinear`` (ours): ``attach_`` sets ``module.ec``; its forward then calls
  ``spear::ec_linear`` with the EC's parameters as inputs, so eager, any backend and
  ``backend="spear"`` agree, and calibration can differentiate through it.
* Foreign quantized modules (hand-written / HF-style dequantize-then-linear, torchao
  int4): their forward is not ours, so the EC is registered against the module's
  integer weight tensor. The ``spear`` backend finds the graph input that *is* that
  tensor and rewrites the matched linear into ``spear::ec_linear`` with the EC as
  constants. Eager forward of such a module does not include the EC.

The registry holds tensors weakly (by identity), so it never keeps a model alive.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..quant.format import QuantFormatError
from ..quant.linear import QuantLinear
from .ec import ErrorCompensator

_FOREIGN: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_ec(weight: torch.Tensor, ec: ErrorCompensator, name: str = "") -> None:
    """Register ``ec`` for the integer weight tensor ``weight`` of a foreign quantized module."""
    _FOREIGN[weight] = (ec, name)


def lookup_ec(weight: torch.Tensor) -> Optional[tuple[ErrorCompensator, str]]:
    return _FOREIGN.get(weight)


def _integer_weight(module: nn.Module, fqn: str) -> torch.Tensor:
    cands = [t for _, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
             if t is not None and not t.is_floating_point()]
    if len(cands) != 1:
        raise QuantFormatError(
            f"attach_: module {fqn!r} ({type(module).__name__}) is not a QuantLinear and has {len(cands)} integer "
            "tensors; expected exactly one packed/integer weight to register the EC against"
        )
    return cands[0]


def attach_(model: nn.Module, ecs: Mapping[str, ErrorCompensator]) -> nn.Module:
    """Attach error compensators by module name; checks every shape before changing anything."""
    if not isinstance(ecs, Mapping):
        raise TypeError(f"attach_: ecs must map module names to ErrorCompensators, got {type(ecs).__name__}")
    modules = dict(model.named_modules())
    plan = []
    for fqn, ec in ecs.items():
        if fqn not in modules:
            raise KeyError(f"attach_: no module named {fqn!r} in {type(model).__name__}")
        mod = modules[fqn]
        if not isinstance(ec, ErrorCompensator):
            raise TypeError(f"attach_: value for {fqn!r} is {type(ec).__name__}, expected ErrorCompensator")
        if isinstance(mod, QuantLinear):
            ec.check_fits(mod.in_features, mod.out_features, f"attach_ {fqn}")
            if ec.A.device != mod.qweight.device:
                raise QuantFormatError(f"attach_ {fqn}: the EC is on {ec.A.device}, the layer on {mod.qweight.device} "
                                       f"(move it with ec.to(...))")
            plan.append((mod, ec, None))
        else:
            plan.append((mod, ec, _integer_weight(mod, fqn)))
    for (mod, ec, weight), fqn in zip(plan, ecs):
        if weight is None:
            mod.ec = ec
        else:
            register_ec(weight, ec, fqn)
    return model


def detach_(model: nn.Module) -> nn.Module:
    """Remove every EC attached to ``QuantLinear`` modules of ``model``."""
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.ec = None
    return model
