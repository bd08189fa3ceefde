"""Launchers of the Triton kernels: the call's records, grids, descriptors and every kernel argument by name.

Depth K/V, a slab or a model's entries, are read in place through a table of
slot addresses (:mod:`moda_flex.backends.slots`). A fused score reaches the
kernels as the depth bias tensor and the cap (:func:`.support.score_args`).

Block sizes come from :func:`.configs.launch_config`, which a ``config=``
hook of :func:`moda_flex.backends.triton.triton_attention` may change for
one eager call (benchmarks/bench_hopper.py).

Each launch's grid and the arguments its layout fixes (sizes, flags, block
sizes) are made once a layout (``_forward_fixed``, ``_dq_fixed``,
``_dkdv_fixed``, a :class:`Fixed` each); a call adds its tensors and strides.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from ...depth import empty_grads, slot_count
from ..blocks import cdiv
from ..launch import by_triton, launch_flat, pointer_depth
from ..layouts import new_out
from ..records import ATTENTION
from .configs import MIN_DOT_ROWS, ConfigHook, hopper_path, launch_config, next_pow2, padded_head_dim

_LOG2E = math.log2(math.e)  # the kernels keep logits in base 2
_KEPT_LAYOUTS = 256  # each launch's fixed arguments (Fixed) kept for this many layouts, the latest


# A call's tensors, in the order the ops take them: those of every kernel call (records.ATTENTION), the
# (3, Bd, Tk) int32 packed documents and the (L,) or (Hq, L) depth bias, each or None.
Inputs = NamedTuple("Inputs", [*ATTENTION, ("documents", Optional[Tensor]), ("bias", Optional[Tensor])])


class Grads(NamedTuple):
    """What the backward takes beyond the forward's :class:`Inputs` and :class:`Options`."""

    grad_out: Tensor  # (B, Hq, Tq, D), unit stride on D
    grad_lse: Optional[Tensor]  # (B, Hq, Tq)
    out: Tensor  # the forward's results
    lse: Tensor
    bias_grad: bool  # also compute the depth bias's gradient


class Options(NamedTuple):
    """A call's non-tensor arguments, in the order the ops take them."""

    scale: float
    causal: bool
    window: int  # 0: unbounded
    depth_first: int  # the first visible depth slot
    sequence: bool  # False: no sequence keys (depth-only)
    softcap: float  # 0.0: no cap
    bias_first: bool  # the depth bias is added before the cap


def _row_descriptor(t: Tensor, G: int, GP: int, block_t: int):
    """A descriptor over (B, Hq, T, D) queries (or dO) seen as (B, Hk, T, G, D), boxes (1, 1, block_t, GP, D).

    A box holds a block's rows in the kernels' order (token-major, the G heads
    of a token together); heads past G and tokens past T are out of bounds and
    read as zeros.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, Hq, T, D = t.shape
    sb, sh, st, sd = t.stride()
    return TensorDescriptor(t, [B, Hq // G, T, G, D], [sb, G * sh, st, sh, sd], [1, 1, block_t, GP, D])


def _tile_descriptor(t: Tensor, block_n: int):
    """A descriptor over (B, Hk, Tk, D) keys or values, boxes (1, 1, block_n, D)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_n, t.shape[-1]])



def _placeholder(device: torch.device) -> Tensor:
    """A never-read int32 pointer argument for a launch without documents or bias.

    Made per launch, not cached: a tensor first made while a CUDA graph is
    recorded lives in the graph's memory pool, and one kept beyond the graph
    fails ``torch.compile(mode="reduce-overhead")``.
    """
    return torch.empty(1, dtype=torch.int32, device=device)


def _layout(G: int, D: int) -> dict:
    """The row layout's constants: G query heads per KV head, G rounded up to GP, the padded and real head dim."""
    return dict(G=G, GP=next_pow2(G), HEAD_DIM=padded_head_dim(D), D_REAL=D)


def _mask_flags(opts: Options, documents: bool) -> dict:
    """The sequence mask's fixed arguments: the window and the flags (``documents``: the call has them)."""
    return dict(window=opts.window, CAUSAL=opts.causal, WINDOW=opts.window > 0, DOC=documents)


def _mask_tensors(documents: Optional[Tensor], like: Tensor) -> dict:
    """The (3, Bd, Tk) packed documents' rows and their batch stride (placeholders without documents)."""
    if documents is None:
        ids = _placeholder(like.device)
        return dict(DOC_IDS=ids, DOC_LO=ids, DOC_HI=ids, sdoc=0)
    sdoc = documents.stride(1) if documents.shape[1] > 1 else 0
    return dict(DOC_IDS=documents[0], DOC_LO=documents[1], DOC_HI=documents[2], sdoc=sdoc)


def _bias_args(bias: Optional[Tensor], like: Tensor) -> dict:
    """The depth bias's arguments: a float32 copy on the device and its (head, slot) strides.

    A (L,) bias gets head stride 0: every head reads it. The copy is in the
    returned dict, which the caller holds until the kernel is launched.
    """
    if bias is None:
        return dict(BIAS=_placeholder(like.device), sbias=(0, 0), HAS_BIAS=False)
    f32 = bias.detach().to(device=like.device, dtype=torch.float32)
    return dict(BIAS=f32, sbias=(0, f32.stride(0)) if f32.dim() == 1 else f32.stride(), HAS_BIAS=True)


class Fixed(NamedTuple):
    """A launch's grid and the arguments a call's layout fixes (sizes, flags, block sizes, constexprs)."""

    grid: tuple
    arguments: dict


def _launch(kernel, fixed: Fixed, route: "Route", **arguments) -> None:
    """``kernel`` launched on ``fixed.grid`` with ``fixed``'s arguments and ``arguments``, through its flat
    wrapper and the route's ``wrap`` (:func:`..launch.launch_flat`)."""
    launch_flat(kernel, fixed.grid, route.wrap, **fixed.arguments, **arguments)


class Route(NamedTuple):
    """How a call reaches its kernels: launched by Triton (:data:`EAGER`: an eager call, or one a CUDA graph
    captures) or by inductor's generated code (``wrap_triton``: :mod:`.traced`)."""

    wrap: Callable  # by_triton or wrap_triton (:func:`..launch.launch_flat`)
    hopper: Callable  # (*tensors) -> whether the call takes the Hopper path (configs.hopper_path)


EAGER = Route(by_triton, hopper_path)


def outputs(inputs: Inputs) -> tuple[Tensor, Tensor]:
    """The forward's results, unwritten (the launch's and the op's fake): out (B, Hq, Tq, D) in the layout of
    :func:`..layouts.new_out`, lse (B, Hq, Tq) float32."""
    q = inputs.q
    return new_out(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def gradients(inputs: Inputs, bias_grad: bool) -> tuple:
    """The backward's results, unwritten (the launch's and the op's fake): dq (B, Hq, Tq, D), dk, dv
    (B, Hk, Tk, D), contiguous, the depth gradients as two (B, Hk, Tq, L, D) tensors whatever the depth form,
    and the bias's gradient in its shape and dtype with ``bias_grad``, else an
    empty tensor."""
    q, k, v, depth_k, _, _, bias = inputs
    fmt = torch.contiguous_format
    return (torch.empty_like(q, memory_format=fmt), torch.empty_like(k, memory_format=fmt),
            torch.empty_like(v, memory_format=fmt), *empty_grads(q, k, depth_k),
            torch.empty_like(bias) if bias_grad else q.new_empty(0))  # fmt: skip


def _fixed(build, config: Optional[ConfigHook], *layout) -> Fixed:
    """``build(*layout, config)``: kept by layout without a hook; made afresh with one (a hook may record)."""
    return build(*layout, None) if config is None else build.__wrapped__(*layout, config)


@functools.lru_cache(maxsize=_KEPT_LAYOUTS)
def _forward_fixed(device, D, G, B, Hk, Tq, Tk, L, opts: Options, documents: bool, hopper: bool, config) -> Fixed:
    """The forward launch's grid and fixed arguments for a call of this layout."""
    layout = _layout(G, D)
    has_depth = L > opts.depth_first
    cfg = launch_config(device, D, G, "fwd", config, has_depth=has_depth, hopper=hopper, keys=Tk)
    block_t = cfg["BLOCK_M"] // layout["GP"]
    arguments = dict(
        Hk=Hk, Tq=Tq, Tk=Tk, L=L, depth_first=opts.depth_first, qk_scale=opts.scale * _LOG2E, softcap=opts.softcap,
        **layout, DEPTH_ROWS=max(layout["GP"], MIN_DOT_ROWS), **_mask_flags(opts, documents),
        HAS_SEQ=opts.sequence and Tk > 0, HAS_DEPTH=has_depth,
        HAS_SOFTCAP=opts.softcap > 0, BIAS_FIRST=opts.bias_first,
        **cfg,
    )  # fmt: skip
    if not cfg["TMA"]:
        arguments.update(QD=None, KD=None, VD=None)
    return Fixed((cdiv(Tq, block_t), B * Hk), arguments)


def forward(inputs: Inputs, opts: Options, config: Optional[ConfigHook] = None,
            route: Route = EAGER) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Launch the forward kernel: out (B, Hq, Tq, D) and lse (B, Hq, Tq) float32, as :func:`outputs` gives them.

    ``config``: the launch hook, or None. ``route``: how the kernel is reached.
    """
    from . import kernels

    q, k, v, depth_k, depth_v, documents, bias = inputs
    B, Hq, Tq, D = q.shape
    Hk, Tk, L = k.shape[1], k.shape[2], slot_count(depth_k)
    out, lse = outputs(inputs)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    fixed = _fixed(_forward_fixed, config, q.device, D, Hq // Hk, B, Hk, Tq, Tk, L, opts, documents is not None,
                   route.hopper(q, k, v))  # fmt: skip
    depth = pointer_depth(depth_k, depth_v, L, q.device)
    tiles = {}
    if fixed.arguments["TMA"]:
        G, GP, block_n = fixed.arguments["G"], fixed.arguments["GP"], fixed.arguments["BLOCK_N"]
        tiles = dict(QD=_row_descriptor(q, G, GP, fixed.arguments["BLOCK_M"] // GP),
                     KD=_tile_descriptor(k, block_n), VD=_tile_descriptor(v, block_n))  # fmt: skip
    _launch(kernels.forward_kernel, fixed, route,
        Q=q, K=k, V=v, O=out, LSE=lse, **tiles, **depth, **_mask_tensors(documents, q), **_bias_args(bias, q),
        sq=q.stride(), sk=k.stride(), sv=v.stride(), so=out.stride(), sl=lse.stride(),
    )  # fmt: skip
    return out, lse


def backward(grads: Grads, inputs: Inputs, opts: Options, config: Optional[ConfigHook] = None,
             route: Route = EAGER) -> tuple[Tensor, ...]:  # fmt: skip
    """Launch the backward, the dQ kernel then the dK/dV kernel: the results of :func:`gradients`, written.

    ``route``: how the kernels are reached.
    """
    q, k, v, depth_k, _, documents, bias = inputs
    B, Hq, Tq, D = q.shape
    Hk, Tk, L = k.shape[1], k.shape[2], slot_count(depth_k)
    dq, dk, dv, ddk, ddv, dbias = results = gradients(inputs, grads.bias_grad)
    if q.numel() == 0 or k.numel() == 0:
        for g in results:
            g.zero_()
        return results
    if opts.depth_first > 0:  # masked slots get a zero gradient
        ddk[..., : opts.depth_first, :].zero_()
        ddv[..., : opts.depth_first, :].zero_()
    hopper, G = route.hopper(q, k, v, grads.grad_out), Hq // Hk
    layout = (q.device, D, G, B, Hk, Tq, Tk, opts, documents is not None, hopper)
    dkdv_fixed = _fixed(_dkdv_fixed, config, *layout)
    sequence = opts.sequence and Tk > 0
    atomic = sequence and dkdv_fixed.arguments["DQ_ATOMIC"]
    # The dQ kernel runs first: it also writes delta = rowsum(dO * O) - dLSE, which the dK/dV kernel reads.
    # With DQ_ATOMIC it writes only the depth part of dQ, as float32 sums to which the dK/dV kernel adds the
    # sequence part.
    dq_out = torch.empty_like(dq, dtype=torch.float32) if atomic and dq.dtype != torch.float32 else dq
    dq_fixed = _fixed(_dq_fixed, config, *layout, L, bool(atomic), grads.grad_lse is not None, grads.bias_grad)
    delta, gbias = _launch_dq(grads, inputs, dq_fixed, dq_out, ddk, ddv, route)
    if sequence:
        _launch_dkdv(grads.grad_out, q, k, v, grads.lse, delta, documents, dk, dv,
                     dq_out if atomic else None, dkdv_fixed, route)  # fmt: skip
    else:
        dk.zero_()
        dv.zero_()
    if dq_out is not dq:
        dq.copy_(dq_out)
    if grads.bias_grad:
        dbias = dbias.zero_() if gbias is None else _reduce_bias_grad(gbias, bias, B, Hk, G)
    return dq, dk, dv, ddk, ddv, dbias


@functools.lru_cache(maxsize=_KEPT_LAYOUTS)
def _dq_fixed(device, D, G, B, Hk, Tq, Tk, opts: Options, documents: bool, hopper: bool, L: int, sums: bool,
              glse: bool, bias_grad: bool, config) -> Fixed:  # fmt: skip
    """The dQ launch's grid and fixed arguments for a call of this layout: with ``sums`` it writes only dQ's
    depth part (as float32 sums)."""
    layout = _layout(G, D)
    has_depth = L > opts.depth_first
    cfg = launch_config(device, D, G, "dq", config, has_depth=has_depth, hopper=hopper)
    arguments = dict(
        Hk=Hk, Tq=Tq, Tk=Tk, L=L, depth_first=opts.depth_first, scale=opts.scale,
        qk_scale=opts.scale * _LOG2E, softcap=opts.softcap,
        **layout, DEPTH_ROWS=max(layout["GP"], MIN_DOT_ROWS), **_mask_flags(opts, documents),
        HAS_SEQ=opts.sequence and Tk > 0 and not sums, HAS_DEPTH=has_depth, HAS_GLSE=glse,
        HAS_SOFTCAP=opts.softcap > 0, BIAS_FIRST=opts.bias_first, BIAS_GRAD=bias_grad and has_depth,
        **cfg,
    )  # fmt: skip
    if not cfg["TMA"]:
        arguments.update(KD=None, VD=None)
    return Fixed((cdiv(Tq, cfg["BLOCK_M"] // layout["GP"]), B * Hk), arguments)


def _launch_dq(grads: Grads, inputs: Inputs, fixed: Fixed, dq: Tensor, ddk: Tensor, ddv: Tensor, route: Route):
    """The dQ kernel as ``fixed`` says, writing ``dq`` and the depth gradients ``ddk``, ``ddv`` (which share
    their strides): returns delta for the dK/dV kernel, and the bias's gradient in parts or None."""
    from . import kernels

    grad_out, grad_lse, out, lse, _ = grads
    q, k, v, depth_k, depth_v, documents, bias = inputs
    B, Hk, L = q.shape[0], k.shape[1], slot_count(depth_k)
    arguments = fixed.arguments
    delta = torch.empty_like(lse)
    glse = delta if grad_lse is None else grad_lse.float().contiguous()
    depth = pointer_depth(depth_k, depth_v, L, q.device)
    blocks = fixed.grid[0]
    tiles = {}
    if arguments["TMA"]:
        tiles = dict(KD=_tile_descriptor(k, arguments["BLOCK_N"]), VD=_tile_descriptor(v, arguments["BLOCK_N"]))
    # Each program's part of the bias gradient, summed over its tokens, (B * Hk, blocks, GP, L).
    with_bias_grad = arguments["BIAS_GRAD"]
    gbias = q.new_zeros((B * Hk, blocks, arguments["GP"], L) if with_bias_grad else (0,), dtype=torch.float32)
    _launch(kernels.dq_kernel, fixed, route,
        Q=q, K=k, V=v, O=out, DO=grad_out, LSE=lse, GLSE=glse, DELTA=delta,
        DQO=dq, DDKO=ddk, DDVO=ddv, GBIAS=gbias,
        **tiles, **depth, **_mask_tensors(documents, q), **_bias_args(bias, q),
        sq=q.stride(), so=out.stride(), sk=k.stride(), sv=v.stride(), sdo=grad_out.stride(), sl=lse.stride(),
        sgq=dq.stride(), sgd=ddk.stride(),
    )  # fmt: skip
    return delta, gbias if with_bias_grad else None


@functools.lru_cache(maxsize=_KEPT_LAYOUTS)
def _dkdv_fixed(device, D, G, B, Hk, Tq, Tk, opts: Options, documents: bool, hopper: bool, config) -> Fixed:
    """The dK/dV launch's grid and fixed arguments for a call of this layout."""
    layout = _layout(G, D)
    cfg = launch_config(device, D, G, "dkdv", config, programs=cdiv(Tk, 128) * B * Hk, hopper=hopper)
    arguments = dict(
        Hk=Hk, Tq=Tq, Tk=Tk, scale=opts.scale, qk_scale=opts.scale * _LOG2E, softcap=opts.softcap,
        **layout, **_mask_flags(opts, documents), HAS_SOFTCAP=opts.softcap > 0,
        **cfg,
    )  # fmt: skip
    if not cfg["TMA"]:
        arguments.update(QD=None, DOD=None)
    return Fixed((cdiv(Tk, cfg["BLOCK_N"]), B * Hk), arguments)


def _launch_dkdv(grad_out, q, k, v, lse, delta, documents, dk, dv, dq_sums, fixed: Fixed, route: Route):
    """The dK/dV kernel as ``fixed`` says: writes dk, dv (B, Hk, Tk, D), contiguous, from the dQ kernel's delta;
    with ``DQ_ATOMIC`` also adds the sequence part of dQ to ``dq_sums`` (B, Hq, Tq, D) float32."""
    from . import kernels

    arguments = fixed.arguments
    G, GP, block_t = arguments["G"], arguments["GP"], arguments["BLOCK_M"] // arguments["GP"]
    tiles = {}
    if arguments["TMA"]:
        tiles = dict(QD=_row_descriptor(q, G, GP, block_t), DOD=_row_descriptor(grad_out, G, GP, block_t))
    sums = dict(DQA=_placeholder(q.device), DQD=None, sa=(0, 0, 0))
    if dq_sums is not None:
        sums = dict(DQA=dq_sums, DQD=None, sa=dq_sums.stride()[:3])
        if arguments["DQ_ATOMIC"] == 2:
            sums["DQD"] = _row_descriptor(dq_sums, G, GP, block_t)
    _launch(kernels.dkdv_kernel, fixed, route,
        Q=q, K=k, V=v, DO=grad_out, LSE=lse, DELTA=delta, DKO=dk, DVO=dv, **tiles, **sums,
        **_mask_tensors(documents, q),
        sq=q.stride(), sk=k.stride(), sv=v.stride(), sdo=grad_out.stride(), sl=lse.stride(), sg=dk.stride(),
    )  # fmt: skip


def _reduce_bias_grad(parts: Tensor, bias: Tensor, B: int, Hk: int, G: int) -> Tensor:
    """The depth bias's gradient in its shape and dtype from the dQ kernel's (B * Hk, blocks, GP, L) parts."""
    grad = parts.view(B, Hk, -1, *parts.shape[2:]).sum(dim=(0, 2))[:, :G]  # (Hk, G, L)
    grad = grad.reshape(Hk * G, -1)  # (Hq, L): query head h = hk * G + g
    return (grad.sum(0) if bias.dim() == 1 else grad).to(device=bias.device, dtype=bias.dtype)

