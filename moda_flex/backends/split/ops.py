"""Launchers, the ``torch.library`` ops and autograd of the split path.

MoDA's one softmax over ``[sequence | depth]`` factorizes through the
log-sum-exp, so the sequence part runs on the vendor's kernel and only the
depth part on ours::

    forward   (o_s, lse_s) = vendor attention over the sequence        (sequence.py)
              out, lse     = the depth slots folded into (o_s, lse_s)  (one depth kernel: the merge is fused)
    backward  dq_d, dK_d, dV_d                                         (one depth kernel)
              dq, dk, dv   = the vendor's backward, given them and the MERGED out and lse
              dq + dq_d    (by the caller: a compiled graph adds where it reads dq)

The vendor's backward, handed the merged lse, computes ``P = exp(s - lse)``,
the sequence columns of the one softmax, and ``delta = rowsum(dO * O)`` of
the merged output: exactly the sequence part's share of the gradients.

Two ops, ``moda_flex::split_forward`` and ``moda_flex::split_backward``,
with fake implementations (so ``torch.compile(fullgraph=True)`` traces them)
and registered autograd; an eager call runs the same work behind a plain
``autograd.Function``.
Compiled on CUDA, a call of static shapes takes two traced ops instead
(``split_traced_forward`` / ``_backward``, :mod:`..launch`), whose kernels
the compiled graph launches itself (flat wrappers, :mod:`.flat`). A
gradient of the returned lse adds ``-dLSE`` to ``delta``: the depth kernel
takes it as it is, the vendor's backward through two extra head lanes
(:func:`_sequence_backward_with_lse`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import wrap_triton

from ...depth import as_list, empty_grads, grads_like, slot_count
from ..blocks import cdiv, next_pow2
from ..first_order import refuse_create_graph
from ..layouts import new_out, unit_last
from ..records import ATTENTION, define, define_traced_pair, restored, saved, unpack
from ..launch import by_triton, launch_flat, pointer_depth, traceable
from . import sequence

_LOG2E = math.log2(math.e)
_MIN_DOT_ROWS = 16  # the least M of a Tensor Core dot


# A call's tensors, in the order the ops take them: those of every kernel call (records.ATTENTION).
Inputs = NamedTuple("Inputs", ATTENTION)


class Grads(NamedTuple):
    """What the backward takes beyond the forward's :class:`Inputs` and :class:`Options`."""

    grad_out: Optional[Tensor]  # None: no gradient reached that output
    grad_lse: Optional[Tensor]
    out: Tensor  # the forward's results, the lse in the vendor's layout
    lse: Tensor





class DqParts(NamedTuple):
    """dq (B, Hq, Tq, D) of a backward in two parts, the vendor's and the depth kernel's, or one."""

    dq: Tensor
    more: Optional[Tensor]  # added to dq; None: dq is whole

    def summed(self) -> Tensor:
        return self.dq if self.more is None else self.dq.add_(self.more)

    def apart(self) -> tuple[Tensor, Tensor]:
        """The two parts, contiguous, as an op that leaves their sum to its caller returns them (zeros for a
        missing second)."""
        return self.dq.contiguous(), torch.zeros_like(self.dq) if self.more is None else self.more.contiguous()


class Options(NamedTuple):
    """A call's non-tensor arguments, in the order the ops take them."""

    scale: float
    causal: bool  # the sequence mask is causal (top-left: Tq == Tk), else full
    sequence: bool  # False: no sequence keys (depth-only)
    depth_first: int  # the first visible depth slot
    kernel: str  # the vendor's op (sequence.KERNELS), chosen once per call: the backward must take the forward's


# Groups up to this size run the per-token kernels (a token's rows against its own slots, on the CUDA cores);
# larger ones fill the Tensor Core tiles' 16 rows with whole tokens' heads. H100, CUDA-graphed calls: at G=3
# the per-token kernels took 0.88x the tiles' time (the Table 6 call, L=12 and 24), at G=8 1.6x (T=1024) and
# 1.13x (T=16384); G=4 lies between, unmeasured.
TOKEN_KERNELS_MAX_GROUP = 4
# (token, head, lane) entries of a per-token program's tiles, BLOCK_T * GP * DP: 32 a thread of its 4 warps
# (H100, the Table 6 call at L=12, CUDA-graphed: 0.40 ms; 16 a thread, with 4 or 8 warps, 0.81-2.1;
# the backward at half the forward's tokens and warps, 0.396 against 0.401)
_TOKEN_TILE = 4096
# The per-token kernels' registers a thread: the backward's 152 (Triton 3.6, G=3, D=64) let 3 programs share
# an SM, 128 lets 4 (H100, the Table 6 call, CUDA-graphed: L=47 0.809 -> 0.774 ms, L=12 0.399 ->
# 0.391); the forward, two slots a step, gains a little too (L=47 0.756 -> 0.751, L=12 0.382 -> 0.381)
_TOKEN_REGISTERS = 128


def _layout(q: Tensor, kv_heads: int, slots: int, backward: bool = False, design: Optional[str] = None) -> dict:
    """The depth kernels' design (``kernels.FORWARD``), constants and launch options, of the forward's kernel
    or the ``backward``'s (the same today): G heads per KV head padded to
    GP, BLOCK_T tokens a program, the head dim's lanes DP.

    ``"tokens"`` (the default for G up to :data:`TOKEN_KERNELS_MAX_GROUP`): per-token products on
    (BLOCK_T, GP, DP) tiles, the forward two slots a step. ``"tiles"``: Tensor Core tiles of 16 rows, BLOCK_C
    (token, slot) columns a step; two warps and 32 columns at G >= 8 and D <= 64, else four warps and 64
    columns; one stage (chosen on an H100, CUDA-graphed: T=16384 at G=8 and the Table 6 call
    at G=3; more stages were slower at both).
    """
    G, D = q.shape[1] // kv_heads, q.shape[-1]
    GP, DP = next_pow2(G), max(16, next_pow2(D))
    design = design or ("tokens" if G <= TOKEN_KERNELS_MAX_GROUP else "tiles")
    if design == "tokens":
        return dict(design=design, G=G, GP=GP, BLOCK_T=max(1, _TOKEN_TILE // (GP * DP)), D=D, DP=DP,
                    num_warps=4, num_stages=1, maxnreg=_TOKEN_REGISTERS)  # fmt: skip
    BLOCK_T = max(1, _MIN_DOT_ROWS // GP)
    warps = 2 if GP >= 8 and DP <= 64 else 4
    return dict(design=design, G=G, GP=GP, BLOCK_T=BLOCK_T,
                BLOCK_C=min(16 * warps, max(16, next_pow2(BLOCK_T * slots))), D=D, DP=DP, num_warps=warps,
                num_stages=1)  # fmt: skip


def _depth_kernel(kernels: dict, layout: dict):
    """The kernel of ``layout``'s design among ``kernels`` (``FORWARD`` or ``BACKWARD``), and the layout less
    its design: the kernel's constants and launch options."""
    options = dict(layout)
    return kernels[options.pop("design")], options


def _has_sequence(k: Tensor, opts: Options) -> bool:
    return opts.sequence and k.shape[2] > 0


def _outputs(q: Tensor, k: Tensor, opts: Options) -> tuple[Tensor, Tensor]:
    """A call's out and lse, unwritten, as the forward op and its fake both return them: out (B, Hq, Tq, D) in
    the layout of :func:`..layouts.new_out`, lse float32, contiguous, in the vendor's shape (cuDNN's
    (B, Hq, Tq, 1), else (B, Hq, Tq)), whatever layouts the vendor's own results have (the CPU op's lse is
    (B, Tq, Hq) in memory)."""
    B, Hq, Tq, _ = q.shape
    lse_shape = (B, Hq, Tq, 1) if _has_sequence(k, opts) and opts.kernel == "cudnn" else (B, Hq, Tq)
    return new_out(q), q.new_empty(lse_shape, dtype=torch.float32)


def _forward(q: Tensor, k: Tensor, v: Tensor, depth_k: list[Tensor], depth_v: list[Tensor], opts: Options,
             wrap=by_triton):  # fmt: skip
    """out (B, Hq, Tq, D) and lse (natural log), in the layouts of :func:`_outputs`; ``wrap``: how the
    kernels are launched (:func:`..launch.launch_flat`)."""
    from . import kernels

    out, lse = _outputs(q, k, opts)
    q, k, v = (unit_last(t) for t in (q, k, v))
    B, Tq = q.shape[0], q.shape[2]
    Hk, L = k.shape[1], slot_count(depth_k)
    has_sequence = _has_sequence(k, opts)
    if has_sequence:
        out_s, lse_s = sequence.forward(opts.kernel, q, k, v, opts.causal, opts.scale)
    else:  # nothing of the sequence is read
        out_s, lse_s = out, lse
    if out.numel() == 0:
        return out, lse
    (ls, sls), (lo, slo) = sequence.lse_argument(lse_s), sequence.lse_argument(lse)
    kernel, layout = _depth_kernel(kernels.FORWARD, _layout(q, Hk, L))
    grid = (cdiv(Tq, layout["BLOCK_T"]), B * Hk)
    depth = pointer_depth(depth_k, depth_v, L, q.device)
    launch_flat(kernel, grid, wrap,
        Q=q, OS=out_s, LS=ls, O=out, LO=lo, **depth,
        sq=q.stride(), sos=out_s.stride(), sls=sls, so=out.stride(), slo=slo,
        Hk=Hk, Tq=Tq, L=L, depth_first=opts.depth_first, qk_scale=opts.scale * _LOG2E,
        **layout, HAS_SEQ=has_sequence, CAUSAL=opts.causal,
    )  # fmt: skip
    return out, lse


def _like_out(grad_out: Tensor, out: Tensor) -> Tensor:
    """dO in out's layout, which the vendor's backward reads alike: itself where it has it, else a copy."""
    if grad_out.stride() == out.stride():
        return grad_out
    return torch.empty_like(out).copy_(grad_out)


def _sequence_backward_with_lse(q, k, v, out, grad_out, lse, grad_lse, opts: Options):
    """The vendor's backward with ``delta = rowsum(dO * O) - dLSE``.

    The ops compute delta themselves, from dO and O. Two extra head lanes
    carry the lse's gradient into it: ``O`` gets ``-dLSE`` (split into a
    part its dtype holds and the rest, for precision), ``dO`` gets ones there,
    and q, k, v get zeros, which changes no logit and no other product.
    """
    D = q.shape[-1]
    pad = (-D) % 8  # the padded head dim a multiple of 8, with at least 2 extra lanes
    pad = pad if pad >= 2 else pad + 8
    q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    glse = sequence.lse_view(grad_lse).float()
    high = glse.to(out.dtype)
    low = (glse - high.float()).to(out.dtype)
    extra_out = torch.stack([-high, -low], dim=-1)  # (B, Hq, Tq, 2)
    out = torch.cat([out, extra_out, out.new_zeros(*out.shape[:3], pad - 2)], dim=-1)
    extra_grad = torch.ones_like(extra_out)
    grad_out = torch.cat([grad_out, extra_grad, grad_out.new_zeros(*grad_out.shape[:3], pad - 2)], dim=-1)
    kernel = sequence.padded_kernel(opts.kernel, D + pad)
    lse = sequence.lse_layout(kernel, lse)  # the forward's kernel may have been another, with another layout
    dq, dk, dv = sequence.backward(kernel, grad_out, q, k, v, out, lse, opts.causal, opts.scale)
    return dq[..., :D], dk[..., :D], dv[..., :D]


def _backward(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, opts: Options,
              wrap=by_triton):  # fmt: skip
    """dq (B, Hq, Tq, D) as :class:`DqParts`, dk, dv (B, Hk, Tk, D), and the depth gradients, two
    (B, Hk, Tq, L, D) tensors.

    ``grad_out`` or ``grad_lse`` may be None (no gradient reached that output). dq's parts, dk, dv are in
    the vendor's layouts (the op makes them contiguous, as its fake says).

    The depth kernel's dq cannot be added into the vendor's, which comes later and fresh, so the two parts
    are returned apart: a compiled graph adds them where it reads dq anyway.
    """
    from . import kernels

    q, k, v = (unit_last(t) for t in (q, k, v))
    B, Hq, Tq, D = q.shape
    Hk, L = k.shape[1], slot_count(depth_k)
    grad_out = torch.zeros_like(out) if grad_out is None else _like_out(grad_out, out)
    ddk, ddv = empty_grads(q, k, depth_k)
    if q.numel() == 0:
        ddk.zero_()
        ddv.zero_()
        return DqParts(q.new_zeros(q.shape), None), k.new_zeros(k.shape), v.new_zeros(v.shape), ddk, ddv
    has_sequence = _has_sequence(k, opts)
    lv, sl = sequence.lse_argument(lse)
    glse, sgl = (lv, sl) if grad_lse is None else sequence.lse_argument(grad_lse.float())
    dq_depth = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    kernel, layout = _depth_kernel(kernels.BACKWARD, _layout(q, Hk, L, True))
    grid = (cdiv(Tq, layout["BLOCK_T"]), B * Hk)
    depth = pointer_depth(depth_k, depth_v, L, q.device)
    launch_flat(kernel, grid, wrap,
        Q=q, O=out, DO=grad_out, LSE=lv, GLSE=glse, DQ=dq_depth, DDK=ddk, DDV=ddv, **depth,
        sq=q.stride(), so=out.stride(), sdo=grad_out.stride(),
        sl=sl, sgl=sgl, sdq=dq_depth.stride(), sgk=ddk.stride(), sgv=ddv.stride(),
        Hk=Hk, Tq=Tq, L=L, depth_first=opts.depth_first, scale=opts.scale, qk_scale=opts.scale * _LOG2E,
        **layout, HAS_GLSE=grad_lse is not None,
    )  # fmt: skip
    if not has_sequence:
        return DqParts(dq_depth, None), k.new_zeros(k.shape), v.new_zeros(v.shape), ddk, ddv
    if grad_lse is None:
        dq, dk, dv = sequence.backward(opts.kernel, grad_out, q, k, v, out, lse, opts.causal, opts.scale)
    else:
        dq, dk, dv = _sequence_backward_with_lse(q, k, v, out, grad_out, lse, grad_lse, opts)
    return DqParts(dq, dq_depth), dk, dv, ddk, ddv


# ---- torch.library ops -------------------------------------------------------------------------
# The arguments are the records above, field by field. The ops run on CUDA, and on CPU under
# Triton's interpreter (the tests), with SDPA's CPU flash op as the vendor.

def _backward_without_dispatch(grads: Grads, inputs: Inputs, opts: Options, wrap=by_triton):
    """:func:`_backward` of the records the backward ops take: what the ops and the eager path run."""
    return _backward(grads.grad_out, grads.grad_lse, *inputs, grads.out, grads.lse, opts, wrap=wrap)


def _dq_returned(dq: DqParts, apart: bool) -> tuple[Tensor, ...]:
    """dq as an op returns it: whole and contiguous, or with ``apart`` its two parts (:meth:`DqParts.apart`),
    which a compiled caller adds where it reads dq anyway."""
    # the fake's layouts, which inductor checks: a copy only where the vendor's op chose another (the CPU op's
    # gradients are (B, T, H, D) in memory; the lse's gradient slices padded head dims)
    return dq.apart() if apart else (dq.summed().contiguous(),)


def backward_in_op_layouts(grads: Grads, inputs: Inputs, opts: Options, wrap=by_triton,
                           dq_apart: bool = False):  # fmt: skip
    """What the backward op returns: dq (two tensors with ``dq_apart``), dk, dv, contiguous, and the depth
    gradients as two (B, Hk, Tq, L, D) tensors."""
    dq, dk, dv, ddk, ddv = _backward_without_dispatch(grads, inputs, opts, wrap=wrap)
    return *_dq_returned(dq, dq_apart), dk.contiguous(), dv.contiguous(), ddk, ddv


def gradients_unwritten(grads: Grads, inputs: Inputs, opts: Options, dq_apart: bool = False):
    """The backward op's results, unwritten (its fake): :func:`backward_in_op_layouts`'s shapes and layouts."""
    q, k, v, depth_k, _ = inputs
    dq = [q.new_empty(q.shape) for _ in range(2 if dq_apart else 1)]  # no two outputs alias
    return (*dq, k.new_empty(k.shape), v.new_empty(v.shape), *empty_grads(q, k, depth_k))


# out (B, Hq, Tq, D) in the layout of :func:`..layouts.new_out` and the lse in the vendor's shape (:func:`_forward`)
define("split_forward", Inputs, Options, returns=2, run=lambda inputs, opts: _forward(*inputs, opts),
       fake=lambda inputs, opts: _outputs(inputs.q, inputs.k, opts))  # fmt: skip
define("split_backward", Grads, Inputs, Options, returns=5, run=backward_in_op_layouts, fake=gradients_unwritten)


def _save(ctx, inputs: Inputs, opts: Options, output: tuple) -> None:
    """Keep what the backward reads: the forward's ``output`` (out, lse), the inputs and the options."""
    ctx.options = opts
    flat, ctx.depth_lengths = saved(inputs)
    ctx.save_for_backward(*output, *flat)
    # An output no loss reached gets None, not zeros: the lse's gradient costs an extra pass only when it exists.
    ctx.set_materialize_grads(False)


def _gradients(ctx, grad_out, grad_lse, run_backward, backend: str = "split") -> Optional[tuple]:
    """dq, dk, dv and the depth gradients in the inputs' form, by ``run_backward(grads, inputs, opts)``; None
    when no gradient reached either output. ``backend``: the name a refused second derivative gives."""
    # The kernels' gradients have no graph: refuse a backward that would differentiate them again.
    refuse_create_graph(backend)
    out, lse, *flat = ctx.saved_tensors
    inputs = restored(Inputs, flat, ctx.depth_lengths)
    if grad_out is None and grad_lse is None:
        return None
    dq, dk, dv, ddk, ddv = run_backward(Grads(grad_out, grad_lse, out, lse), inputs, ctx.options)
    return dq, dk, dv, grads_like(ddk, inputs.depth_k), grads_like(ddv, inputs.depth_v)


def _setup_context(ctx, inputs, output):
    _save(ctx, *unpack(inputs, Inputs, Options), output)


def _backward_by_op(grads: Grads, inputs: Inputs, opts: Options):
    return torch.ops.moda_flex.split_backward(*grads, *inputs, *opts)


def _autograd_backward(ctx, grad_out, grad_lse, run_backward=_backward_by_op):
    grads = _gradients(ctx, grad_out, grad_lse, run_backward)
    return (*(grads or (None,) * len(Inputs._fields)), *(None,) * len(ctx.options))


torch.library.register_autograd("moda_flex::split_forward", _autograd_backward, setup_context=_setup_context)


# ---- traced ops (moda_flex.backends.launch) ------------------------------------------------------
# What a compiled call on CUDA takes: the same work, every kernel launched by the compiled graph.



def _traced_forward_body(inputs: Inputs, opts: Options):
    return _forward(*inputs, opts, wrap=wrap_triton)


def _traced_backward_body(grads: Grads, inputs: Inputs, opts: Options):
    return backward_in_op_layouts(grads, inputs, opts, wrap=wrap_triton)


# The traced op's autograd is the eager op's, its backward the traced backward.
traced_forward, traced_backward = define_traced_pair(
    "split_traced", Inputs, Grads, Options, forward=_traced_forward_body, backward=_traced_backward_body,
    returns=5, autograd_backward=_autograd_backward, setup_context=_setup_context,
)


def _eager_backward(grads: Grads, inputs: Inputs, opts: Options):
    dq, *rest = _backward_without_dispatch(grads, inputs, opts)
    return dq.summed(), *rest


class _EagerSplit(torch.autograd.Function):
    """The eager path: the ops' work and autograd's bookkeeping, without the dispatcher's round trips and the
    registered autograd's flattening of 2L depth entries (the call is host-bound at short lengths).

    ``depth`` is the key entries then the value entries, ``n_depth`` of each.
    """

    @staticmethod
    def forward(ctx, q, k, v, opts, n_depth, *depth):
        inputs = Inputs(q, k, v, list(depth[:n_depth]), list(depth[n_depth:]))
        out, lse = _forward(*inputs, opts)
        _save(ctx, inputs, opts, (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        grads = _gradients(ctx, grad_out, grad_lse, _eager_backward)
        if grads is None:
            return (None,) * (5 + sum(ctx.depth_lengths))
        dq, dk, dv, ddk, ddv = grads
        return dq, dk, dv, None, None, *ddk, *ddv


def call_options(q: Tensor, k: Tensor, slots: int, variant, scale: float) -> Options:
    """A supported call's :class:`Options`; ``slots``: L. The vendor's op is chosen here, once a call."""
    s = variant.structure
    kernel = sequence.kernel_for(q.device, q.shape[-1], q.shape[2] == k.shape[2])
    return Options(scale=float(scale), causal=bool(s.causal), sequence=bool(s.sequence),
                   depth_first=s.first_slot(slots), kernel=kernel)


def split_attention(q: Tensor, k: Tensor, v: Tensor, depth_k: Tensor, depth_v: Tensor, variant, scale: float):
    """MoDA with the sequence part on the vendor's kernel and the depth part on ours, for a supported call.

    Args:
        q: (B, Hq, Tq, D), float16 or bfloat16 (float32 on CPU, under the interpreter).
        k, v: (B, Hk, Tk, D); ``Tq == Tk`` for a causal mask.
        depth_k, depth_v: (B, Hk, Tq, L, D), any strides (read in place), or a
            sequence of L (B, Hk, Tq, D) entries; either read in place through
            a table of slot addresses (each entry gets its own gradient).
        variant: causal or full, with the default depth mask, a depth window
            or depth-only (:func:`moda_flex.backends.split.unsupported_reason`).
        scale: logit scale.

    Returns:
        out (B, Hq, Tq, D) and lse (B, Hq, Tq) float32, natural log; both
        differentiable.
        Under ``torch.compile`` on CUDA (static shapes) the compiled graph
        launches the kernels itself, each entry one of the depth kernels'
        own pointer arguments (:mod:`moda_flex.backends.launch`).
    """
    depth_k, depth_v = as_list(depth_k), as_list(depth_v)
    opts = call_options(q, k, slot_count(depth_k), variant, scale)
    if torch.compiler.is_compiling() and traceable(q, k, v, *depth_k, *depth_v):  # launched by the graph itself
        out, lse = traced_forward(q, k, v, depth_k, depth_v, *opts)
    elif torch.compiler.is_compiling():
        out, lse = torch.ops.moda_flex.split_forward(*Inputs(q, k, v, depth_k, depth_v), *opts)
    else:
        out, lse = _EagerSplit.apply(q, k, v, opts, len(depth_k), *depth_k, *depth_v)
    return out, sequence.lse_view(lse)


def split_backward(grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, depth_k: Tensor,
                   depth_v: Tensor, out: Tensor, lse: Tensor, variant, scale: float) -> tuple[Tensor, ...]:  # fmt: skip
    """The split path's gradients of a call from a given ``out`` and ``lse``, as the backward of a call whose
    softmax had that lse: a block of a longer row whose (out, lse) merges several calls (context parallelism).

    Args:
        grad_out, out: (B, Hq, Tq, D); grad_lse, lse: (B, Hq, Tq) float32.
        q, k, v, depth_k, depth_v, variant, scale: as :func:`split_attention`, depth as (B, Hk, Tq, L, D).

    Returns:
        dq, dk, dv and the depth gradients, (B, Hk, Tq, L, D) each.
    """
    opts = call_options(q, k, depth_k.shape[3], variant, scale)
    lse = sequence.lse_layout(opts.kernel, lse.contiguous())
    grads, inputs = Grads(grad_out, grad_lse, out, lse), Inputs(q, k, v, [depth_k], [depth_v])
    return torch.ops.moda_flex.split_backward(*grads, *inputs, *opts)
