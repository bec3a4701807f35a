"""``benchmarks/kernels.py`` shadows the ``kernels`` package (Hugging Face's kernel hub) that transformers
probes for when it is imported; a script run from this folder has the folder first on ``sys.path``.
``unshadow()``: this folder off ``sys.path`` (its scripts are then imported as ``benchmarks.<name>``,
the repository root put first), and a ``kernels`` module already imported from here forgotten."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def unshadow() -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    mod = sys.modules.get("kernels")
    if mod is not None and os.path.dirname(os.path.abspath(getattr(mod, "__file__", "") or "")) == HERE:
        del sys.modules["kernels"]
