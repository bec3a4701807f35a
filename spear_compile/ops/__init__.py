"""The spear custom ops (``schemas``) and their PyTorch references (``refs``): the bottom layer, importing
no kernel. The ops' CUDA implementations are registered by ``dispatch/cuda.py`` (``quant/ops.py``
imports both, so importing the package gives ops that run their kernels on CUDA)."""
