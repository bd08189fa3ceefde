"""moda_flex: Mixture-of-Depths Attention for PyTorch."""

# The layers (MoDAAttention, DepthKVProjection, KVCache, Block) stay under
# moda_flex.nn and out of __all__: `from moda_flex import *` must not rebind
# the `nn` a model file has from `from torch import nn`.
from . import nn
from .depth import DepthStream
from .attention import moda_attention
from .context_parallel import context_parallel_moda_attention, gather_sequence, shard_sequence, zigzag_positions
from .scores import Score, alibi, depth_alibi, depth_bias, softcap
from .variants import (
    Structure,
    Variant,
    causal,
    chunk_depth,
    depth_only,
    depth_window,
    document,
    full,
    sliding_window,
)

__all__ = [
    "moda_attention",
    "DepthStream",
    "context_parallel_moda_attention",
    "shard_sequence",
    "gather_sequence",
    "zigzag_positions",
    "Variant",
    "Structure",
    "causal",
    "full",
    "sliding_window",
    "depth_window",
    "chunk_depth",
    "depth_only",
    "document",
    "Score",
    "softcap",
    "alibi",
    "depth_bias",
    "depth_alibi",
]
