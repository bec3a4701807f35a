"""Kernels and their PyTorch references.

One kernel family per file: ``<op>_ref`` (pure PyTorch, the numerical contract) beside
the Triton kernels that implement it on GPU. On CPU the registered ops run the
references; a Triton lowering must match its reference on the shapes in ``tests/lowering``.
"""
