"""The ``torch.library`` ops of the Triton backend, their autograd, the eager path, and :func:`triton_attention`.

Layers: ``kernels/`` (``@triton.jit``) -> ``launch.py`` (grids, block
sizes from ``configs.py``) -> two custom ops ``moda_flex::triton_forward`` /
``triton_backward`` with registered autograd and fake implementations (so
``torch.compile(..., fullgraph=True)`` traces through them), and a plain
``autograd.Function`` for eager calls -> :func:`triton_attention`.
Autograd hands each depth entry its own gradient; the depth bias, an input
of the ops, gets its gradient too.
"""

from __future__ import annotations

import functools
from typing import Optional, get_type_hints

import torch
from torch import Tensor

from ...depth import DepthKV, as_list, grads_like, slot_count
from ...variants import Variant
from ..first_order import refuse_create_graph
from .configs import ConfigHook
from .launch import Options, backward, forward
from .support import score_args


# ---- torch.library ops -------------------------------------------------------------------------
# The non-tensor arguments are :class:`Options`, spelled out. ``bias`` is the (L,) or (Hq, L)
# depth bias or None; the backward computes its gradient only with ``bias_grad``.

# "float scale, bool causal, ...": the schema's options from Options' fields, whose types (float, bool, int)
# are named as in a schema.
_OPTIONS = ", ".join(f"{kind.__name__} {name}" for name, kind in get_type_hints(Options).items())


def _interpreter_upcast(tensors, depth_k, depth_v):
    """The Triton interpreter computes bfloat16 dots wrongly: on CPU run bfloat16 in float32."""
    if tensors[0].device.type == "cpu" and tensors[0].dtype == torch.bfloat16:
        return [t.float() for t in tensors], [t.float() for t in depth_k], [t.float() for t in depth_v], torch.bfloat16
    return tensors, depth_k, depth_v, None


def _run_forward(q, k, v, depth_k, depth_v, documents, bias, *options, config=None):
    (q, k, v), depth_k, depth_v, cast = _interpreter_upcast([q, k, v], depth_k, depth_v)
    out, lse = forward(q, k, v, depth_k, depth_v, documents, bias, Options(*options), config)
    return (out if cast is None else out.to(cast)), lse


def _run_backward(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad, *options,
                  config=None):  # fmt: skip
    (grad_out, q, k, v, out), depth_k, depth_v, cast = _interpreter_upcast([grad_out, q, k, v, out], depth_k, depth_v)
    *grads, dbias = backward(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad,
                             Options(*options), config)  # fmt: skip
    return (*grads, dbias) if cast is None else (*(g.to(cast) for g in grads), dbias)


class _EagerMoDA(torch.autograd.Function):
    """The eager path: forward and backward kernels with autograd's bookkeeping and nothing more.

    ``depth`` is the key entries then the value entries, ``n_depth`` of each.
    """

    @staticmethod
    def forward(ctx, q, k, v, documents, bias, opts, config, n_depth, *depth):
        depth_k, depth_v = list(depth[:n_depth]), list(depth[n_depth:])
        out, lse = _run_forward(q, k, v, depth_k, depth_v, documents, bias, *opts, config=config)
        ctx.save_for_backward(q, k, v, out, lse, documents, bias, *depth)
        ctx.num_depth, ctx.options, ctx.config = n_depth, opts, config
        ctx.bias_grad = ctx.needs_input_grad[4]
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        run_backward = functools.partial(_run_backward, config=ctx.config)
        dq, dk, dv, ddk, ddv, _, dbias = _autograd_backward(ctx, grad_out, grad_lse, run_backward)[:7]
        return dq, dk, dv, None, dbias, None, None, None, *ddk, *ddv


# Registered with torch.library.define / impl: the kernels run as they are. (A
# torch.library.custom_op wraps them in a Python check over every input tensor,
# which costs more than the kernels at the 2L depth entries of a model's call.)
torch.library.define(
    "moda_flex::triton_forward",
    "(Tensor q, Tensor k, Tensor v, Tensor[] depth_k, Tensor[] depth_v, Tensor? documents, Tensor? bias, "
    f"{_OPTIONS}) -> (Tensor, Tensor)",
)
torch.library.define(
    "moda_flex::triton_backward",
    "(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor[] depth_k, Tensor[] depth_v, "
    f"Tensor out, Tensor lse, Tensor? documents, Tensor? bias, bool bias_grad, {_OPTIONS}) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)


@torch.library.impl("moda_flex::triton_forward", ("cuda", "cpu"))
def _forward_op(q, k, v, depth_k, depth_v, documents, bias, *options):
    """out (B, Hq, Tq, D) and lse (B, Hq, Tq) float32."""
    return _run_forward(q, k, v, depth_k, depth_v, documents, bias, *options)


@torch.library.register_fake("moda_flex::triton_forward")
def _forward_fake(q, k, v, depth_k, depth_v, documents, bias, *options):
    B, Hq, Tq, D = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, Hq, Tq), dtype=torch.float32)


@torch.library.impl("moda_flex::triton_backward", ("cuda", "cpu"))
def _backward_op(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad, *options):
    """dq, dk, dv, the depth gradients as two (B, Hk, Tq, L, D) tensors whatever the depth form, and the bias's.

    The bias's gradient has its shape with ``bias_grad``, else it is empty.
    """
    return _run_backward(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad, *options)


@torch.library.register_fake("moda_flex::triton_backward")
def _backward_fake(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad, *options):
    fmt = torch.contiguous_format
    B, Hk, Tq, D = k.shape[0], k.shape[1], q.shape[2], q.shape[3]
    depth_shape = (B, Hk, Tq, slot_count(depth_k), D)
    return (
        torch.empty_like(q, memory_format=fmt),
        torch.empty_like(k, memory_format=fmt),
        torch.empty_like(v, memory_format=fmt),
        q.new_empty(depth_shape),
        q.new_empty(depth_shape),
        torch.empty_like(bias) if bias_grad else q.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, depth_k, depth_v, documents, bias, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, documents, bias, *depth_k, *depth_v)
    ctx.num_depth = len(depth_k)
    ctx.options = tuple(options)
    # Not ctx.needs_input_grad: here it lists the flattened inputs, whose positions move with the depth entries.
    ctx.bias_grad = bias is not None and bias.requires_grad


def _autograd_backward(ctx, grad_out, grad_lse, run_backward=None):
    """Gradients of q, k, v, depth_k, depth_v (depth in its input form), documents (None), the bias, the options.

    The eager path's backward too. The kernels' gradients have no graph: a backward under create_graph=True
    is refused, rather than return second derivatives that are silently wrong.
    """
    refuse_create_graph("triton")
    (q, k, v, out, lse, documents, bias), depth = ctx.saved_tensors[:7], ctx.saved_tensors[7:]
    depth_k, depth_v = list(depth[: ctx.num_depth]), list(depth[ctx.num_depth :])
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    run_backward = run_backward or torch.ops.moda_flex.triton_backward
    dq, dk, dv, ddk, ddv, dbias = run_backward(
        grad_out.contiguous(), grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, ctx.bias_grad,
        *ctx.options,
    )
    grads = (dq, dk, dv, grads_like(ddk, depth_k), grads_like(ddv, depth_v), None, dbias if ctx.bias_grad else None)
    return grads + (None,) * len(ctx.options)


torch.library.register_autograd("moda_flex::triton_forward", _autograd_backward, setup_context=_setup_context)


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: DepthKV,
    depth_v: DepthKV,
    variant: Variant,
    scale: float,
    *,
    config: Optional[ConfigHook] = None,
) -> tuple[Tensor, Tensor]:
    """Fused MoDA through the Triton kernels, for a call the registry has checked (inputs and support).

    Args:
        q: (B, Hq, Tq, D), fp16 / bf16 / fp32 (fp32 matmuls run as TF32 on GPU).
        k, v: (B, Hk, Tk, D), ``Tq <= Tk``, query ``i`` at position ``Tk - Tq + i``.
        depth_k, depth_v: (B, Hk, Tq, L, D), or a list of L (B, Hk, Tq, D)
            entries; any strides (read in place); L may be 0.
        variant: a variant with a supported structure and score (see
            :func:`.support.unsupported_reason`); a depth bias is (L,) or (Hq, L) and
            may require grad.
        scale: logit scale.
        config: a launch hook for tuning, ``config(kernel, default) -> config``
            (see :data:`ConfigHook`), applied to the forward and backward
            launches of this call; eager calls only.

    Returns:
        out (B, Hq, Tq, D) in q's dtype and lse (B, Hq, Tq) float32, natural
        log, ``-inf`` (and a zero output) for a row that sees no key, NaN
        (in both) for a row whose query or a visible entry holds a NaN or Inf
        (:mod:`moda_flex.nonfinite`). Both are differentiable with respect to
        q, k, v, depth_k, depth_v and the depth bias.
    """
    s = variant.structure
    # Document ids with their runs, (3, Bd, Tk) int32, computed once where the variant was made.
    documents = None if s.documents is None else s.documents.packed.to(q.device)
    depth_k, depth_v = as_list(depth_k), as_list(depth_v)
    L = slot_count(depth_k)
    depth_first = 0 if s.depth_window is None else max(0, L - s.depth_window)
    window = 0 if s.window is None else int(s.window)
    bias, softcap, bias_first = score_args(variant.score, q.shape[1], L)
    opts = Options(float(scale), bool(s.causal), window, depth_first, bool(s.sequence), float(softcap), bias_first)
    if torch.compiler.is_compiling():
        if config is not None:
            raise ValueError("config= tunes eager calls; torch.compile traces the op with the default launches")
        return torch.ops.moda_flex.triton_forward(q, k, v, depth_k, depth_v, documents, bias, *opts)
    # Eager: the same kernels behind a plain autograd.Function, without the
    # dispatcher round trips of a custom op (the call is host-bound at short lengths).
    return _EagerMoDA.apply(q, k, v, documents, bias, opts, config, len(depth_k), *depth_k, *depth_v)

