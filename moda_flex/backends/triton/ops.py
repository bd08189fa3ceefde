"""The ``torch.library`` ops of the Triton backend, their autograd, the eager path, and :func:`triton_attention`.

Layers: ``kernels/`` (``@triton.jit``) -> ``launch.py`` (grids, block
sizes from ``configs.py``) -> two custom ops ``moda_flex::triton_forward`` /
``triton_backward`` with registered autograd and fake implementations (so
``torch.compile(..., fullgraph=True)`` traces through them), and a plain
``autograd.Function`` for eager calls -> :func:`triton_attention`. Compiled
on CUDA, a call of static shapes takes the traced ops of :mod:`.traced`
instead, whose kernels the compiled graph launches itself.
Autograd hands each depth entry its own gradient; the depth bias, an input
of the ops, gets its gradient too.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ...depth import DepthKV, as_list, grads_like, slot_count
from ...variants import Variant
from ..first_order import refuse_create_graph
from ..launch import traceable
from ..layouts import unit_last
from ..records import define, define_traced_pair, restored, saved, unpack
from . import traced
from .configs import ConfigHook
from .launch import Grads, Inputs, Options, backward, forward, gradients, outputs
from .support import score_args


def _interpreter_upcast(inputs: Inputs, *more: Tensor) -> tuple[Inputs, list[Tensor], Optional[torch.dtype]]:
    """The Triton interpreter computes bfloat16 dots wrongly: on CPU run bfloat16 in float32.

    Returns the inputs and ``more`` in the dtype to run, and the dtype to cast results back to (or None).
    """
    q = inputs.q
    if q.device.type != "cpu" or q.dtype != torch.bfloat16:
        return inputs, list(more), None
    up = inputs._replace(q=q.float(), k=inputs.k.float(), v=inputs.v.float(),
                         depth_k=[t.float() for t in inputs.depth_k], depth_v=[t.float() for t in inputs.depth_v])  # fmt: skip
    return up, [t.float() for t in more], torch.bfloat16


def _run_forward(inputs: Inputs, opts: Options, config: Optional[ConfigHook] = None) -> tuple[Tensor, Tensor]:
    inputs, _, cast = _interpreter_upcast(inputs)
    out, lse = forward(inputs, opts, config)
    return (out if cast is None else out.to(cast)), lse


def _run_backward(grads: Grads, inputs: Inputs, opts: Options, config: Optional[ConfigHook] = None):
    inputs, (grad_out, out), cast = _interpreter_upcast(inputs, grads.grad_out, grads.out)
    *result, dbias = backward(grads._replace(grad_out=grad_out, out=out), inputs, opts, config)
    return (*result, dbias) if cast is None else (*(g.to(cast) for g in result), dbias)


# ---- torch.library ops -------------------------------------------------------------------------
# Defined (records.define) and implemented with torch.library: the kernels run as they are. (A
# torch.library.custom_op wraps them in a Python check over every input tensor,
# which costs more than the kernels at the 2L depth entries of a model's call.)
# Their arguments are the records of launch.py, field by field.
# The forward gives out (B, Hq, Tq, D) and lse (B, Hq, Tq) float32; the backward what launch.gradients describes.
# (Each runs the module's function as it is at the call: tests count the launches.)
define("triton_forward", Inputs, Options, returns=2, run=lambda *records: _run_forward(*records),
       fake=lambda inputs, opts: outputs(inputs))  # fmt: skip
define("triton_backward", Grads, Inputs, Options, returns=6, run=lambda *records: _run_backward(*records),
       fake=lambda grads, inputs, opts: gradients(inputs, grads.bias_grad))  # fmt: skip


def _save(ctx, inputs: Inputs, opts: Options, out: Tensor, lse: Tensor, bias_grad: bool) -> None:
    """What the backward needs: the inputs, the results, the options, and whether the bias wants a gradient."""
    flat, ctx.depth_lengths = saved(inputs)
    ctx.save_for_backward(out, lse, *flat)
    ctx.options = opts
    ctx.bias_grad = bias_grad


def _setup_context(ctx, inputs, output):
    inputs, opts = unpack(inputs, Inputs, Options)
    # Not ctx.needs_input_grad: here it lists the flattened inputs, whose positions move with the depth entries.
    _save(ctx, inputs, opts, *output, bias_grad=inputs.bias is not None and inputs.bias.requires_grad)


def _autograd_backward(ctx, grad_out, grad_lse, run_backward=None):
    """Gradients of the op's arguments: q, k, v, depth_k, depth_v (depth in its input form), documents (None),
    the bias, the options (None).

    The eager path's backward too. The kernels' gradients have no graph: a backward under create_graph=True
    is refused, rather than return second derivatives that are silently wrong.
    """
    refuse_create_graph("triton")
    out, lse, *flat = ctx.saved_tensors
    inputs = restored(Inputs, flat, ctx.depth_lengths)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = Grads(unit_last(grad_out), grad_lse, out, lse, ctx.bias_grad)
    if run_backward is None:
        dq, dk, dv, ddk, ddv, dbias = torch.ops.moda_flex.triton_backward(*grads, *inputs, *ctx.options)
    else:
        dq, dk, dv, ddk, ddv, dbias = run_backward(grads, inputs, ctx.options)
    depth_k, depth_v = grads_like(ddk, inputs.depth_k), grads_like(ddv, inputs.depth_v)
    return (dq, dk, dv, depth_k, depth_v, None, dbias if ctx.bias_grad else None) + (None,) * len(ctx.options)


torch.library.register_autograd("moda_flex::triton_forward", _autograd_backward, setup_context=_setup_context)


# Launched by the compiled graph itself (.traced); the autograd is the eager op's, its backward the traced one.
traced_forward, traced_backward = define_traced_pair(
    "triton_traced", Inputs, Grads, Options, forward=traced.forward_body, backward=traced.backward_body,
    returns=6, autograd_backward=_autograd_backward, setup_context=_setup_context,
)


class _EagerMoDA(torch.autograd.Function):
    """The eager path: the same launches and autograd's bookkeeping, without the dispatcher's round trips.

    ``depth`` is the key entries then the value entries, ``n_depth`` of each.
    """

    @staticmethod
    def forward(ctx, q, k, v, documents, bias, opts, config, n_depth, *depth):
        inputs = Inputs(q, k, v, list(depth[:n_depth]), list(depth[n_depth:]), documents, bias)
        out, lse = _run_forward(inputs, opts, config)
        _save(ctx, inputs, opts, out, lse, bias_grad=ctx.needs_input_grad[4])
        ctx.config = config
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        run_backward = functools.partial(_run_backward, config=ctx.config)
        dq, dk, dv, ddk, ddv, _, dbias = _autograd_backward(ctx, grad_out, grad_lse, run_backward)[:7]
        return dq, dk, dv, None, dbias, None, None, None, *ddk, *ddv


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
        log, ``-inf`` (and a zero output) for a row that sees no key. Both
        are differentiable with respect to
        q, k, v, depth_k, depth_v and the depth bias.
    """
    depth_k, depth_v = as_list(depth_k), as_list(depth_v)
    documents, bias, opts = _call_arguments(q, depth_k, variant, scale)
    if torch.compiler.is_compiling():
        if config is not None:
            raise ValueError("config= tunes eager calls; torch.compile traces the op with the default launches")
        if traceable(q, k, v, *depth_k, *depth_v):  # launched from the compiled graph itself
            return traced_forward(q, k, v, depth_k, depth_v, documents, bias, *opts)
        return torch.ops.moda_flex.triton_forward(*Inputs(q, k, v, depth_k, depth_v, documents, bias), *opts)
    # Eager: the same kernels behind a plain autograd.Function, without the
    # dispatcher round trips of a custom op (the call is host-bound at short lengths).
    return _EagerMoDA.apply(q, k, v, documents, bias, opts, config, len(depth_k), *depth_k, *depth_v)


def merged_backward(grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, depth_k: DepthKV,
                    depth_v: DepthKV, out: Tensor, lse: Tensor, variant: Variant, scale: float) -> tuple:  # fmt: skip
    """The gradients of a call whose rows are part of longer rows, given those rows' merged ``out`` and ``lse``
    (:func:`moda_flex.backends.merged_backward`): dq, dk, dv, and the depth gradients as two (B, Hk, Tq, L, D)
    tensors.

    Args:
        grad_out, out: (B, Hq, Tq, D) in q's dtype; grad_lse, lse: (B, Hq, Tq) float32; the rest as
            :func:`triton_attention` takes them.
    """
    depth_k, depth_v = as_list(depth_k), as_list(depth_v)
    documents, bias, opts = _call_arguments(q, depth_k, variant, scale)
    # the op reads dlse and writes delta with the lse's strides
    grads = Grads(grad_out.contiguous(), grad_lse.contiguous(), out, lse.contiguous(), bias_grad=False)
    *result, _ = torch.ops.moda_flex.triton_backward(*grads, *Inputs(q, k, v, depth_k, depth_v, documents, bias), *opts)
    return tuple(result)


def _call_arguments(q: Tensor, depth_k: list[Tensor], variant: Variant, scale: float):
    """A call's documents ((3, Bd, Tk) int32 ids with their runs, computed once where the variant was made) or
    None, its depth bias or None, and its :class:`Options`, from the variant and the depth in the ops' form."""
    s = variant.structure
    documents = None if s.documents is None else s.documents.packed.to(q.device)
    L = slot_count(depth_k)
    bias, softcap, bias_first = score_args(variant.score, q.shape[1], L)
    opts = Options(scale=float(scale), causal=bool(s.causal), window=0 if s.window is None else int(s.window),
                   depth_first=s.first_slot(L), sequence=bool(s.sequence), softcap=float(softcap),
                   bias_first=bias_first)
    return documents, bias, opts
