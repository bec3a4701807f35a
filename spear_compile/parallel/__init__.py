"""Tensor parallelism over ``torch.distributed``: shard a quantized, error-compensated Llama-style model
(``sharding.py``) into column- and row-parallel layers (``layers.py``). The row-parallel EC layer reduces
its stacked partial ``[y_i | A_i x_i]`` before the gate (``ops/peer_reduce_ref.py`` says why); the spear
backend fuses that into ``spear::ec_linear_peer_reduce`` (``passes/fuse_peer_reduce.py``)."""
from .layers import RowParallelLinear, RowShardEC
from .sharding import load_sharded, shard_column, shard_llama_, shard_row, tp_group

__all__ = ["RowParallelLinear", "RowShardEC", "load_sharded", "shard_column", "shard_llama_", "shard_row",
           "tp_group"]
