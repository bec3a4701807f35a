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
* :class:`AdmissionError` (a ``RuntimeError``): the serving engine refused a request at once (its queue
  is full, or the request needs more KV cache than exists); ``limit`` names the limit, ``value`` the
  value that broke it.
* :class:`EngineError` (a ``RuntimeError``): an accepted request failed (the generation loop stopped or
  died, or the model raised).
* :class:`PeerTimeoutError` (a ``TimeoutError``): a tensor-parallel reduction timed out because a peer
  died or never reached it; ``rank`` is this rank, ``missing`` the ranks that did not arrive.
"""
from __future__ import annotations


class QuantFormatError(ValueError):
    """A quantized tensor or its companion has the wrong shape, dtype or layout."""


class ArtifactError(RuntimeError):
    """An artifact directory is missing, corrupted, truncated or does not match its config."""


class UnmatchedECError(RuntimeError):
    """An error compensator was attached or registered, but the compiled graph would not apply it."""


class AdmissionError(RuntimeError):
    """The engine refused a request: ``limit`` (``"max_queue"``, ``"kv_tokens"``, ``"kv_blocks"``) and the
    ``value`` that exceeded it; the message says both and what to change."""

    def __init__(self, message: str, limit: str = "", value=None) -> None:
        super().__init__(message)
        self.limit, self.value = limit, value


class EngineError(RuntimeError):
    """An accepted request could not complete."""


__all__ = ["AdmissionError", "ArtifactError", "EngineError", "PeerTimeoutError", "QuantFormatError", "UnmatchedECError"]


class PeerTimeoutError(TimeoutError):
    """A tensor-parallel peer did not take part in a reduction in time (it died, or never reached the
    same op): ``rank`` is this process's rank, ``missing`` the ranks that did not arrive (empty when they
    could not be told apart). Raised instead of hanging."""

    def __init__(self, message: str, rank: int = -1, missing: tuple = ()) -> None:
        super().__init__(message)
        self.rank, self.missing = rank, tuple(missing)
