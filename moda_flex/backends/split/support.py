"""Which calls the split path computes exactly: those whose sequence part is a call of the vendor's kernels."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from ...variants import Variant
from .sequence import capability

# The vendor kernels' head dims: multiples of 8 up to FlashAttention's 256.
MAX_HEAD_DIM = 256
CUDA_DTYPES = (torch.float16, torch.bfloat16)


def unsupported_reason(q: Tensor, k: Tensor, variant: Variant) -> Optional[str]:
    """Why the split path cannot run this call, or None when it can.

    Args:
        q: (B, Hq, Tq, D) queries; k: (B, Hk, Tk, D) keys (shapes, dtype and device are read).
        variant: it needs a causal or full sequence mask (causal only at
            ``Tq == Tk``: the vendor kernels align it top-left, MoDA
            bottom-right), no window, documents or score, and depth slots of
            the token's own (all, the last S, or none of the sequence).
    """
    s = variant.structure
    if variant.score is not None:
        return f"score {variant.score.name!r} is not computed by the vendor kernels"
    if s is None or s.window is not None or s.documents is not None or s.depth_chunk is not None:
        return f"variant {variant.name!r} masks the sequence or depth beyond causal/full and a depth window"
    if s.sequence and s.causal and q.shape[2] != k.shape[2]:
        return f"a causal mask at Tq={q.shape[2]} < Tk={k.shape[2]} (the vendor kernels align it top-left)"
    D = q.shape[-1]
    if D % 8 or D > MAX_HEAD_DIM:
        return f"head dim D={D} is not a multiple of 8 up to {MAX_HEAD_DIM}"
    if q.device.type == "cuda":
        if q.dtype not in CUDA_DTYPES:
            return f"dtype {q.dtype} is not float16 or bfloat16"
        if capability(q.device) < (8, 0):
            return "the vendor kernels need compute capability 8.0 or newer"
        return None
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter computes bfloat16 dots wrongly: float32 there.
        return None if q.dtype == torch.float32 else f"dtype {q.dtype} under the interpreter (float32 only)"
    return f"device {q.device} needs CUDA (or CPU with TRITON_INTERPRET=1)"
