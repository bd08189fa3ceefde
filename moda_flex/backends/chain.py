"""One gradient buffer for a depth stream's entries: each layer's backward adds its depth gradients to it.

A depth entry written by layer ``j`` is read by every later layer, and its
gradient is the sum of theirs. Given the entries as leaves of their own,
autograd sums them entry by entry: a model of N layers pays about N^2 / 2
small additions a step. A :class:`moda_flex.DepthStream` can carry a
gradient path beside its entries instead (``DepthStream.append`` extends
it; :func:`moda_flex.depth.buffers_gradients` says when a stream has one): a
tensor of the stream's shape, (2, B, Hk, T, n, D), that is never stored
(it expands one element) and whose gradient, flowing back from layer to
layer, is the buffer of every entry's gradient so far::

    forward    path_0 -> attention 1 -> path_1' -> append (k_1, v_1) -> path_2 -> attention 2 -> ...
    backward   G (2, B, Hk, T, n, D) <- layer n's depth gradients added in place <- ... -> the entry's k, v get G[:, ..., j, :]

The call here reads the stream and passes the path on: its backward takes
the buffer G that the later layers filled and has the kernel add this
layer's depth gradients into it (``DEPTH_ADD``: one pass over the slots,
no separate summation); appending entry ``j`` hands ``G[:, ..., j, :]``,
complete by then, to the entry's k and v. The entries themselves get no
gradient from the call. Nothing is hidden: the buffer is the path's
gradient, so ``torch.compile`` (where inductor re-inplaces the ops' writes
into one buffer), activation checkpointing and a stream read twice
(autograd sums the two buffers) keep the gradients exact.

Compiled on CUDA with static shapes the call takes the traced ops
(:mod:`.traced`), and the layer's depth gradients are added to the buffer
out of place: an op that wrote into a slice of the buffer would leave
inductor to clone the slice for its kernels (and it read past it: an
illegal address on an H100). The traced backward ``<name>_traced_backward_add``
has the kernel read the buffer the later readers filled (``Addend``) and
write the sum into a fresh one (:mod:`.grad_sides`): the same passes over
the layer's slots as the in-place add, and a few layers' buffers alive at a
time, where each entry's own sum, fused by inductor into one late kernel,
holds every layer's depth gradients.

It runs the two kernels ``auto`` takes for a model's calls on CUDA:
``split`` and ``capture`` (:data:`KERNELS`). Any other backend reads the
stream's entries as a sequence, each given its own gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..depth import DepthKV, as_list
from . import capture, split
from .first_order import refuse_create_graph
from .split import ops as split_ops
from .split import sequence
from .split.ops import Grads, Inputs, Into
from .traced import traceable

# The kernel backends (:data:`moda_flex.backends.KERNELS`) that add into a stream's gradient buffer: each module
# defines the ops ``moda_flex::<name>_forward`` and ``<name>_backward_into``.
_MODULES = {"split": split, "capture": capture}
KERNELS = tuple(_MODULES)


def _ops(kernel: str, traced: bool):
    """The forward op of ``kernel`` and its backward-into op; with ``traced``, its traced forward and backward
    ops (:mod:`.traced`), whose backward returns a fresh buffer."""
    ops = torch.ops.moda_flex
    if traced:
        return getattr(ops, f"{kernel}_traced_forward"), getattr(ops, f"{kernel}_traced_backward_add")
    return getattr(ops, f"{kernel}_forward"), getattr(ops, f"{kernel}_backward_into")


def _traced(*tensors: Tensor) -> bool:
    """Whether a call takes the traced ops: compiled, on CUDA, with static shapes (:func:`.traced.traceable`)."""
    return torch.compiler.is_compiling() and traceable(*tensors)


class _ReadStream(torch.autograd.Function):
    """A kernel call over a stream's entries that passes the stream's gradient path on (see the module)."""

    @staticmethod
    def forward(ctx, path, kernel, opts, return_lse, hand_on, n_depth, q, k, v, *depth):
        inputs = Inputs(q, k, v, list(depth[:n_depth]), list(depth[n_depth:]))
        traced = _traced(q, k, v, *depth)
        forward_op, _ = _ops(kernel, traced)
        out, lse = forward_op(*inputs, *opts)
        ctx.save_for_backward(out, lse, q, k, v, *depth)
        ctx.set_materialize_grads(False)  # an output no loss reached: None, not zeros (eagerly)
        ctx.kernel, ctx.traced, ctx.options, ctx.n_depth = kernel, traced, opts, n_depth
        ctx.path = (path.shape, path.dtype)
        ctx.return_lse, ctx.hand_on = return_lse, hand_on
        # The lse and the path only when asked for: compiled, an output's gradient is zeros rather than None, and
        # a zero gradient of the lse would cost the backward its extra pass, of the path a buffer filled and added.
        path = (path.new_empty(()).expand(path.shape),) if hand_on else ()
        return (out, lse, *path) if return_lse else (out, *path)

    @staticmethod
    def backward(ctx, grad_out, *more):
        more = list(more)  # the gradients of the outputs forward returned after out
        grad_lse = more.pop(0) if ctx.return_lse else None
        grad_path = more.pop(0) if ctx.hand_on else None
        refuse_create_graph("auto")
        out, lse, q, k, v, *depth = ctx.saved_tensors
        inputs = Inputs(q, k, v, depth[: ctx.n_depth], depth[ctx.n_depth :])
        no_depth = (None,) * len(depth)
        if grad_out is None and grad_lse is None:
            return grad_path, None, None, None, None, None, None, None, None, *no_depth
        grads = Grads(grad_out, grad_lse, out, lse)
        _, backward_op = _ops(ctx.kernel, ctx.traced)
        if ctx.traced:  # the sum out of place: the kernel reads the later readers' buffer, writes a fresh one
            dq, dk, dv, buffer = backward_op(*grads, *inputs, *ctx.options, grad_path)
        else:
            shape, dtype = ctx.path
            add = grad_path is not None
            buffer = grad_path if add else out.new_empty(shape, dtype=dtype)  # the last reader writes it first
            dq, dk, dv = backward_op(*grads, *inputs, *ctx.options, *Into(buffer, add))
        return buffer, None, None, None, None, None, dq, dk, dv, *no_depth


def read_stream(kernel: str, path: Tensor, q: Tensor, k: Tensor, v: Tensor, depth_k: DepthKV, depth_v: DepthKV,
                variant, scale: float, return_lse: bool,
                hand_on: bool = True) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:  # fmt: skip
    """MoDA over a stream's entries by ``kernel`` (one of :data:`KERNELS`), their gradients added into the
    gradient buffer that ``path`` carries.

    Args:
        kernel: ``"split"`` or ``"capture"``, a backend that runs the call.
        path: the stream's gradient path, (2, B, Hk, Tq, L, D).
        q, k, v, variant, scale: as the kernel's function takes them.
        depth_k, depth_v: the stream's L entries, each (B, Hk, Tq, D).
        return_lse: whether the caller takes the lse.
        hand_on: whether a later layer reads the stream: else no path goes on, and the backward writes the
            buffer rather than adding to one.

    Returns:
        out (B, Hq, Tq, D), lse (B, Hq, Tq) float32 (None unless ``return_lse``), and the path to pass on
        (None without ``hand_on``).
    """
    depth_k, depth_v = as_list(depth_k), as_list(depth_v)
    opts = split_ops.call_options(q, k, len(depth_k), variant, scale)
    out, *rest = _ReadStream.apply(path, kernel, opts, return_lse, hand_on, len(depth_k), q, k, v, *depth_k,
                                   *depth_v)  # fmt: skip
    lse = sequence.lse_view(rest.pop(0)) if return_lse else None
    return out, lse, rest[0] if hand_on else None
