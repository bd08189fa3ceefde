"""moda_flex: Mixture-of-Depths Attention for PyTorch."""

from . import nn  # layers: MoDAAttention, DepthKVProjection, KVCache, Block
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
    "nn",
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
