"""Which calls the Triton kernels run, and the fused scores as the ops' arguments.

The kernels fuse the scores of :data:`FUSED_SCORES` (at most one of each,
joined with ``&`` in either order) and refuse the others; every other
statement of that fact points here.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from ...scores import Score
from ...variants import Variant

# Any head dim up to FlashAttention's 256: the kernels pad it to a power of two (at least 16) inside.
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The score kinds (:attr:`moda_flex.Score.terms`) the kernels fuse: a soft-cap on every logit, a depth bias on
# the depth logits.
FUSED_SCORES = ("softcap", "depth_bias")


def unsupported_reason(q: Tensor, variant: Variant) -> Optional[str]:
    """Why the Triton kernel cannot run this call, or None when it can.

    Args:
        q: (B, Hq, Tq, D) queries (only dtype, device and D are read).
        variant: the mask pair; it needs a :class:`moda_flex.Structure` whose
            depth reads are the token's own (``depth_chunk is None``) and
            whose documents are each one contiguous run, and no score
            but those of :data:`FUSED_SCORES`.
    """
    if variant.score is not None and not _fuses(variant.score):
        return (
            f"score {variant.score.name!r} is not fused into the kernels (they fuse {', '.join(FUSED_SCORES)} and "
            f"the two joined with &); use backend='flex' (or 'auto', which picks it on CUDA) or 'reference'"
        )
    structure = variant.structure
    if structure is None:
        return "the variant has no Structure (a custom predicate); use backend='flex'"
    if structure.depth_chunk is not None:
        return f"chunk-visible depth (depth_chunk={structure.depth_chunk}) is not fused; use backend='flex'"
    if not structure.keys_contiguous:
        return (
            "a document's positions are not one contiguous run (an id comes back after another document); "
            "the kernel reads each document as one run; use backend='flex' or 'reference'"
        )
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        return f"head dim D={q.shape[-1]} is outside 1..{MAX_HEAD_DIM}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not one of float16, bfloat16, float32"
    if q.device.type == "cuda":
        return None
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"device {q.device} needs CUDA (or CPU with TRITON_INTERPRET=1)"


def _fuses(score: Score) -> bool:
    """Whether the kernels run ``score``: at most one term of each of :data:`FUSED_SCORES`, in either order."""
    if score.terms is None:
        return False
    kinds = [kind for kind, _ in score.terms]
    return set(kinds) <= set(FUSED_SCORES) and len(set(kinds)) == len(kinds)


def score_args(score: Optional[Score], q_heads: int, slots: int) -> tuple[Optional[Tensor], float, bool]:
    """The fused score as the ops' arguments: the depth bias or None, the cap (0.0: none), bias before cap.

    The bias is (L,) or (Hq, L) as given (an input of the op, so that it gets
    its gradient); binding the score checks it against the call.
    """
    if score is None:
        return None, 0.0, False
    score.bind(q_heads, slots)
    bias, cap, bias_first = None, 0.0, False
    params = iter(score.params)
    for kind, value in score.terms:
        if kind == "softcap":
            cap = value
        else:  # depth_bias: reads the next tensor of params
            bias, bias_first = next(params), cap == 0.0
    return bias, cap, bias_first
