"""Runtime: latency tables, the SLO chunk scheduler and the serving engine (later issues).

Kernel-level measurements already drive compilation: ``benchmarks/kernels.py`` writes the
per-GPU tuned kernel configs and fused/overlapped crossovers under
``spear_compile/lowering/tuned/``, which the Triton wrappers and the phase-dispatch pass read.
"""
