"""One FlexAttention call: the public function inside a compiled graph, eager otherwise (differentiable on CPU)."""

from __future__ import annotations

import functools
import math
import warnings

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from .scoring import no_score_mod


def run_flex(query, key, value, block_mask: BlockMask, scale, score_mod=None, params=(), *, need_lse: bool,
              enable_gqa: bool, kernel_options=None):  # fmt: skip
    """flex_attention on one part; returns out and the natural-log lse (None unless ``need_lse``).

    ``score_mod(score, b, h, row, col, *params)`` or None; the public
    function reads ``params`` from a closure, the eager op as buffers.
    Inside a compiled graph this is the public function, which the graph
    compiles.
    """
    closed = None if score_mod is None else (lambda score, b, h, row, col: score_mod(score, b, h, row, col, *params))
    flex = functools.partial(
        flex_attention,
        query,
        key,
        value,
        score_mod=closed,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        kernel_options=kernel_options,
    )
    if torch.compiler.is_compiling():
        if not need_lse:
            return flex(), None
        out, aux = flex(return_aux=AuxRequest(lse=True))
        return out, aux.lse
    needs_grad = any(t.requires_grad for t in (query, key, value, *params)) and torch.is_grad_enabled()
    if query.device.type == "cpu" and needs_grad:
        return eager_flex_with_grad(query, key, value, block_mask, scale, score_mod, params)
    with warnings.catch_warnings():
        # Eager FlexAttention warns that it materializes scores; at test sizes
        # that is the point.
        warnings.simplefilter("ignore", UserWarning)
        out, aux = flex(return_aux=AuxRequest(lse=True))
    return out, aux.lse


def eager_flex_with_grad(query, key, value, block_mask, scale, score_mod=None, params=()):
    """FlexAttention's eager operator, differentiable on CPU.

    The public ``flex_attention`` refuses CPU inputs that require grad, yet its
    eager implementation (the higher-order op, plain PyTorch inside, which
    repeats the KV heads for grouped queries) has a working backward. Calling
    the op directly lets this backend, and the CPU tests of every gradient,
    run there; CUDA always takes the public function.

    Args:
        query: (B, H, Tq, D); key, value: (B, H or a divisor of it, Tk, D).
        block_mask: the ``BlockMask`` over (Tq, Tk).
        scale: logit scale.
        score_mod: ``(score, b, h, row, col, *params) -> score`` or None.
        params: the tensors ``score_mod`` reads, as FlexAttention's score buffers.

    Returns:
        out (B, H, Tq, D) and lse (B, H, Tq), natural log.
    """
    from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_op
    from torch.nn.attention.flex_attention import _apply_kernel_options

    kernel_options = _apply_kernel_options(query, key, value, True, None)
    score_mod = no_score_mod if score_mod is None else score_mod
    out, lse = flex_attention_op(
        query, key, value, score_mod, block_mask.as_tuple(), scale, kernel_options, tuple(params)
    )[:2]
    # The op keeps its statistics in base 2.
    return out, lse * math.log(2.0)
