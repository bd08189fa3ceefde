"""moda_flex: Mixture-of-Depths Attention for PyTorch."""

from . import nn  # layers: MoDAAttention, DepthKVProjection, KVCache, Block
from .depth import DepthStream
from .attention import moda_attention
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
]
