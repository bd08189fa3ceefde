"""Launchers, autograd and the ``torch.library`` ops of the Triton backend.

Layers: ``kernels.py`` (``@triton.jit``) -> the launchers here (grid, block
sizes) -> two custom ops ``moda_flex::triton_forward`` / ``triton_backward``
with registered autograd and fake implementations (so ``torch.compile(...,
fullgraph=True)`` traces through them) -> :func:`triton_attention`.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from ..variants import Variant, document_runs

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The smallest M of a Tensor Core dot: the depth phase works on tiles of
# max(pow2(G), 16) rows, the rows of 16 / pow2(G) consecutive tokens when G < 16.
_MIN_DOT_ROWS = 16


def unsupported_reason(q: Tensor, variant: Variant) -> Optional[str]:
    """Why the Triton kernel cannot run this call, or None when it can.

    Args:
        q: (B, Hq, Tq, D) queries (only dtype, device and D are read).
        variant: the mask pair; it needs a :class:`moda_flex.Structure` whose
            depth reads are the token's own (``depth_chunk is None``) and
            whose documents are each one contiguous run.
    """
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
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head dim D={q.shape[-1]} is not one of {SUPPORTED_HEAD_DIMS}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not one of float16, bfloat16, float32"
    if q.device.type == "cuda":
        return None
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"device {q.device} needs CUDA (or CPU with TRITON_INTERPRET=1)"


def triton_attention(
    q: Tensor, k: Tensor, v: Tensor, depth_k: Tensor, depth_v: Tensor, variant: Variant, scale: float
) -> tuple[Tensor, Tensor]:
    """Fused MoDA through the Triton kernels. Inputs are already validated.

    Args:
        q: (B, Hq, Tq, D), fp16 / bf16 / fp32 (fp32 matmuls run as TF32 on GPU).
        k, v: (B, Hk, Tk, D), ``Tq <= Tk``, query ``i`` at position ``Tk - Tq + i``.
        depth_k, depth_v: (B, Hk, Tq, L, D), any strides (read in place); L may be 0.
        variant: a variant with a supported structure (see :func:`unsupported_reason`).
        scale: logit scale.

    Returns:
        out (B, Hq, Tq, D) in q's dtype and lse (B, Hq, Tq) float32, natural
        log, ``-inf`` (and a zero output) for a row that sees no key. Both are
        differentiable with respect to q, k, v, depth_k and depth_v.
    """
    reason = unsupported_reason(q, variant)
    if reason is not None:
        raise NotImplementedError(f"backend 'triton' cannot run variant {variant.name!r}: {reason}")
    s = variant.structure
    B, Tk = q.shape[0], k.shape[2]
    doc_ids = None
    if s.doc_ids is not None:
        doc_ids = s.doc_ids
        if doc_ids.dim() != 2 or doc_ids.shape[0] not in (1, B) or doc_ids.shape[1] != Tk:
            raise ValueError(
                f"variant {variant.name!r}: doc_ids must have shape (1 or B={B}, Tk={Tk}), got {tuple(doc_ids.shape)}"
            )
        doc_ids = doc_ids.to(device=q.device, dtype=torch.int32).contiguous()
    L = depth_k.shape[3]
    depth_first = 0 if s.depth_window is None else max(0, L - s.depth_window)
    window = 0 if s.window is None else int(s.window)
    return torch.ops.moda_flex.triton_forward(
        q, k, v, depth_k, depth_v, doc_ids, float(scale), bool(s.causal), window, depth_first, bool(s.sequence)
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _config(q: Tensor, G: int, which: str, has_depth: bool = True) -> dict:
    """Block sizes and launch options for ``which`` in {"fwd", "dkdv", "dq"}.

    Chosen on an H200 at T=16384, G=8, D=64 (benchmarks/tune_moda.py,
    benchmarks/NOTES.md).
    """
    GP = _next_pow2(G)
    if q.device.type != "cuda":
        # The interpreter: few, small programs.
        return dict(BLOCK_M=max(16, GP), BLOCK_N=16, BLOCK_C=16)
    D = q.shape[-1]
    if which == "fwd" and has_depth:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_C=32, num_warps=4, num_stages=3)
    elif which == "fwd":
        cfg = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_C=32, num_warps=8, num_stages=3)
    elif which == "dkdv":
        cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_C=32, num_warps=4, num_stages=3)
    if D == 128:
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], 64)
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    cfg["BLOCK_M"] = max(cfg["BLOCK_M"], GP, _MIN_DOT_ROWS)
    return cfg


def _doc_bounds(doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """First position and one-past-last position of each position's document, (B', Tk) int32.

    Documents are contiguous runs of equal ids (``unsupported_reason`` refuses others).
    """
    return document_runs(doc_ids)


def _doc_args(doc_ids: Optional[Tensor], like: Tensor):
    if doc_ids is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=like.device)
        return dummy, dummy, dummy, 0
    lo, hi = _doc_bounds(doc_ids)
    return doc_ids, lo, hi, (doc_ids.stride(0) if doc_ids.shape[0] > 1 else 0)


def _forward(q, k, v, depth_k, depth_v, doc_ids, scale, causal, window, depth_first, sequence):
    from . import kernels

    B, Hq, Tq, D = q.shape
    Hk, Tk, L = k.shape[1], k.shape[2], depth_k.shape[3]
    G = Hq // Hk
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, Hq, Tq), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    cfg = _config(q, G, "fwd", has_depth=L > depth_first)
    GP = _next_pow2(G)
    block_t = cfg["BLOCK_M"] // GP
    doc, doc_lo, doc_hi, sdoc = _doc_args(doc_ids, q)
    grid = (_cdiv(Tq, block_t), B * Hk)
    kernels._fwd_kernel[grid](
        q, k, v, depth_k, depth_v, doc, doc_lo, doc_hi, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *depth_k.stride(), *depth_v.stride(),
        sdoc, *out.stride(), *lse.stride(),
        Hk, Tq, Tk, L, depth_first, window, scale * math.log2(math.e),
        G=G, GP=GP, DEPTH_ROWS=max(GP, _MIN_DOT_ROWS), HEAD_DIM=D,
        CAUSAL=causal, WINDOW=window > 0, DOC=doc_ids is not None,
        HAS_SEQ=sequence and Tk > 0, HAS_DEPTH=L > depth_first,
        **cfg,
    )
    return out, lse


def _backward(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, doc_ids, scale, causal, window,
              depth_first, sequence):
    from . import kernels

    B, Hq, Tq, D = q.shape
    Hk, Tk, L = k.shape[1], k.shape[2], depth_k.shape[3]
    G = Hq // Hk
    GP = _next_pow2(G)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    alloc = torch.zeros if depth_first > 0 else torch.empty  # masked slots get a zero gradient
    ddk = alloc(depth_k.shape, device=q.device, dtype=q.dtype)
    ddv = alloc(depth_k.shape, device=q.device, dtype=q.dtype)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), ddk.zero_(), ddv.zero_()
    # delta_i = rowsum(dO_i * O_i) - dLSE_i: dS = P * (dP - delta) also carries the lse gradient.
    delta = torch.empty_like(lse)
    rows = B * Hq * Tq
    glse = None if grad_lse is None else grad_lse.float().contiguous()
    out2, grad_out2 = out.reshape(rows, D), grad_out.reshape(rows, D)
    kernels._bwd_delta_kernel[(_cdiv(rows, 64),)](
        out2, grad_out2, delta if glse is None else glse, delta, rows, *out2.stride(), *grad_out2.stride(),
        HAS_GLSE=glse is not None, HEAD_DIM=D, BLOCK_R=64,
    )
    doc, doc_lo, doc_hi, sdoc = _doc_args(doc_ids, q)
    qk_scale = scale * math.log2(math.e)
    has_seq = sequence and Tk > 0
    if has_seq:
        cfg = _config(q, G, "dkdv")
        grid = (_cdiv(Tk, cfg["BLOCK_N"]), B * Hk)
        kernels._bwd_dkdv_kernel[grid](
            q, k, v, grad_out, lse, delta, doc, doc_lo, doc_hi, dk, dv,
            *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *lse.stride(),
            sdoc, *dk.stride(),
            Hk, Tq, Tk, window, scale, qk_scale,
            G=G, GP=GP, HEAD_DIM=D, CAUSAL=causal, WINDOW=window > 0, DOC=doc_ids is not None,
            **cfg,
        )
    else:
        dk.zero_()
        dv.zero_()
    cfg = _config(q, G, "dq", has_depth=L > depth_first)
    grid = (_cdiv(Tq, cfg["BLOCK_M"] // GP), B * Hk)
    kernels._bwd_dq_kernel[grid](
        q, k, v, depth_k, depth_v, grad_out, lse, delta, doc, doc_lo, doc_hi, dq, ddk, ddv,
        *q.stride(), *k.stride(), *v.stride(), *depth_k.stride(), *depth_v.stride(),
        *grad_out.stride(), *lse.stride(), sdoc, *dq.stride(), *ddk.stride(),
        Hk, Tq, Tk, L, depth_first, window, scale, qk_scale,
        G=G, GP=GP, DEPTH_ROWS=max(GP, _MIN_DOT_ROWS), HEAD_DIM=D,
        CAUSAL=causal, WINDOW=window > 0, DOC=doc_ids is not None,
        HAS_SEQ=has_seq, HAS_DEPTH=L > depth_first,
        **cfg,
    )
    return dq, dk, dv, ddk, ddv


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- torch.library ops -------------------------------------------------------------------------
# Non-tensor arguments: ``window`` 0 means unbounded; ``depth_first`` is the first visible depth
# slot; ``sequence`` False drops the sequence keys (depth-only).


def _interpreter_upcast(tensors):
    """The Triton interpreter computes bfloat16 dots wrongly: on CPU run bfloat16 in float32."""
    if tensors[0].device.type == "cpu" and tensors[0].dtype == torch.bfloat16:
        return [None if t is None else t.float() for t in tensors], torch.bfloat16
    return tensors, None


@torch.library.custom_op("moda_flex::triton_forward", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, depth_k: Tensor, depth_v: Tensor, doc_ids: Optional[Tensor],
    scale: float, causal: bool, window: int, depth_first: int, sequence: bool,
) -> tuple[Tensor, Tensor]:
    (q, k, v, depth_k, depth_v), cast = _interpreter_upcast([q, k, v, depth_k, depth_v])
    out, lse = _forward(q, k, v, depth_k, depth_v, doc_ids, scale, causal, window, depth_first, sequence)
    return (out if cast is None else out.to(cast)), lse


@_forward_op.register_fake
def _forward_fake(q, k, v, depth_k, depth_v, doc_ids, scale, causal, window, depth_first, sequence):
    B, Hq, Tq, D = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, Hq, Tq), dtype=torch.float32)


@torch.library.custom_op("moda_flex::triton_backward", mutates_args=())
def _backward_op(
    grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, depth_k: Tensor,
    depth_v: Tensor, out: Tensor, lse: Tensor, doc_ids: Optional[Tensor],
    scale: float, causal: bool, window: int, depth_first: int, sequence: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    (grad_out, q, k, v, depth_k, depth_v, out), cast = _interpreter_upcast([grad_out, q, k, v, depth_k, depth_v, out])
    grads = _backward(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, doc_ids, scale, causal, window,
                      depth_first, sequence)
    return tuple(grads) if cast is None else tuple(g.to(cast) for g in grads)


@_backward_op.register_fake
def _backward_fake(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, doc_ids, scale, causal, window,
                   depth_first, sequence):
    fmt = torch.contiguous_format
    return (
        torch.empty_like(q, memory_format=fmt),
        torch.empty_like(k, memory_format=fmt),
        torch.empty_like(v, memory_format=fmt),
        q.new_empty(depth_k.shape),
        q.new_empty(depth_k.shape),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, depth_k, depth_v, doc_ids, scale, causal, window, depth_first, sequence = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, depth_k, depth_v, out, lse, doc_ids)
    ctx.options = (scale, causal, window, depth_first, sequence)


def _autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, depth_k, depth_v, out, lse, doc_ids = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = torch.ops.moda_flex.triton_backward(
        grad_out.contiguous(), grad_lse, q, k, v, depth_k, depth_v, out, lse, doc_ids, *ctx.options
    )
    return (*grads, None, None, None, None, None, None)


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)
