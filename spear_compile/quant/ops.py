"""The spear ops with their CUDA implementations registered: import this (``spear_compile.quant`` does)
rather than ``spear_compile.ops.schemas`` alone, so that the ops run their kernels on CUDA."""
from ..dispatch.cuda import register_cuda_kernels
from ..dispatch.cuda_peer_reduce import register_peer_reduce_cuda
from ..ops import tp_schemas  # noqa: F401  (the tensor-parallel ops)
from ..ops.schemas import *  # noqa: F401,F403
from ..ops.schemas import (_check_ec_cat, _check_ec_glu, _check_glu, check_ec_shapes, check_norm,  # noqa: F401
                           out_features)

register_cuda_kernels()
register_peer_reduce_cuda()
