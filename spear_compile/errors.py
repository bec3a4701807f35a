"""The exceptions a caller of spear_compile can catch, in one place.

Every check in the library raises one of these (or a plain ``ValueError`` / ``TypeError`` for a bad
argument of a public function), with a message that names what is wrong: the module, tensor,
shape, dtype, file or field. ``README.md`` ("What is checked, and where") lists the checks.

* :class:`QuantFormatError` (a ``ValueError``): a quantized layer, weight or activation has the wrong
  shape, dtype, group size or layout (``QuantLinear``, the ``spear::`` ops, ``quantize_``, ``attach_``).
* :class:`ArtifactError` (a ``RuntimeError``): ``save`` refused a target or ``load`` found a missing,
  truncated, corrupted, edited or mismatched artifact. Nothing is half written or half loaded.
* :class:`UnmatchedECError` (a ``RuntimeError``): ``torch.compile(backend="spear")`` found an error
  compensator registered for a weight that no pass could rewrite; compiling would drop it silently.
  ``torch.compile`` reports it wrapped in ``torch._dynamo.exc.BackendCompilerFailed`` (its
  ``inner_exception``).
"""
from __future__ import annotations


class QuantFormatError(ValueError):
    """A quantized tensor or its companion has the wrong shape, dtype or layout."""


class ArtifactError(RuntimeError):
    """An artifact directory is missing, corrupted, truncated or does not match its config."""


class UnmatchedECError(RuntimeError):
    """An error compensator was attached or registered, but the compiled graph would not apply it."""


__all__ = ["ArtifactError", "QuantFormatError", "UnmatchedECError"]
