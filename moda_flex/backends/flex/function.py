"""The flex backend's call: MoDA through one ``flex_attention`` over folded rows and ``[sequence | depth]`` columns.

The layout is the package's (:mod:`moda_flex.backends.flex`); the masks are
:mod:`.block_mask`'s.

A variant's score function (:mod:`moda_flex.scores`) becomes FlexAttention's
``score_mod`` over the same layout: a row is read back as (query head, token)
and a column as a key position or a (token, slot) depth entry, as the mask
does; the tensors the score reads (learned biases) go in as FlexAttention's
score buffers, so their gradients come back on the eager path too. The
BlockMask is the variant's, unchanged.

FlexAttention multiplies the masked entries of a visited block by a zero
weight, and ``0 * NaN = NaN``; so the inputs go in with their NaN and Inf
zeroed and the rows that see one come out NaN (:mod:`moda_flex.nonfinite`).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from ... import nonfinite
from ...variants import Variant
from ..reference import visible_entries
from .block_mask import moda_block_mask, padded_kv_len


def flex_attention_backend(
    q: Tensor, k: Tensor, v: Tensor, depth_k: Tensor, depth_v: Tensor, variant: Variant, scale: float
) -> tuple[Tensor, Tensor]:
    """MoDA through one ``flex_attention`` call; compiled on CUDA, eager elsewhere.

    Args and returns as :func:`moda_flex.backends.reference.reference_attention`.
    Supports first derivatives only.
    """
    if q.is_cuda:
        return flex_moda(q, k, v, depth_k, depth_v, variant, scale, compiled=True)
    return _eager_flex_moda(q, k, v, depth_k, depth_v, variant, scale)


# Inductor compiles FlexAttention on CPU for inference only and without the
# lse, so a compiled model runs this backend eagerly there, through a graph
# break; fullgraph=True stops here with this reason.
@torch.compiler.disable(
    reason="moda_flex backend 'flex' runs FlexAttention eagerly off CUDA (inductor compiles it on CPU for "
    "inference only, without the lse); under torch.compile(fullgraph=True) on CPU use backend='auto' or "
    "'reference', which compile, training included"
)
def _eager_flex_moda(q, k, v, depth_k, depth_v, variant, scale):
    return flex_moda(q, k, v, depth_k, depth_v, variant, scale, compiled=False)


def flex_moda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Tensor,
    depth_v: Tensor,
    variant: Variant,
    scale: float,
    *,
    compiled: bool,
    return_lse: bool = True,
    spread_grads: Optional[bool] = None,
):
    """Like :func:`flex_attention_backend`, choosing eager or compiled FlexAttention.

    Compiled FlexAttention on CPU runs inference only, without the lse: call it
    with ``return_lse=False`` there. ``spread_grads`` (default: ``compiled``)
    reads a score's learning tensors through stacked copies (see
    :func:`_spread`).

    Args:
        q: (B, Hq, Tq, D); k, v: (B, Hk, Tk, D); depth_k, depth_v: (B, Hk, Tq, L, D).

    Returns:
        out (B, Hq, Tq, D), and lse (B, Hq, Tq) float32 if ``return_lse``.
    """
    B, Hq, Tq, D = q.shape
    Hk, Tk, L = k.shape[1], k.shape[2], depth_k.shape[3]
    G = Hq // Hk
    # A visited block multiplies its masked entries by zero, and 0 * NaN = NaN:
    # run on zeroed copies, then mark NaN the rows that see a non-finite entry.
    q, q_bad = nonfinite.zero_nonfinite(q)  # (B, Hq, Tq, D), (B, Hq, Tq)
    k, k_bad = nonfinite.zero_nonfinite(k)  # (B, Hk, Tk, D), (B, Hk, Tk)
    v, v_bad = nonfinite.zero_nonfinite(v)
    depth_k, depth_k_bad = nonfinite.zero_nonfinite(depth_k)  # (B, Hk, Tq, L, D), (B, Hk, Tq, L)
    depth_v, depth_v_bad = nonfinite.zero_nonfinite(depth_v)
    block_mask = moda_block_mask(variant, batch=B, kv_heads=Hk, q_len=Tq, kv_len=Tk, groups=G, slots=L, device=q.device)
    kv_pad = block_mask.seq_lengths[1] - Tq * L - Tk

    # Fold the G query heads of each group into rows: row r = t * G + g.
    rows = q.view(B, Hk, G, Tq, D).transpose(2, 3).reshape(B, Hk, Tq * G, D)  # (B, Hk, Tq*G, D)
    pad = k.new_zeros(B, Hk, kv_pad, D)
    keys = torch.cat([k, pad, depth_k.reshape(B, Hk, Tq * L, D)], dim=2)  # (B, Hk, Tk_pad + Tq*L, D)
    values = torch.cat([v, pad, depth_v.reshape(B, Hk, Tq * L, D)], dim=2)

    score_mod, params = None, ()
    if variant.score is not None:
        # Check the params against this call, and the function on a grid of logits,
        # here: inside FlexAttention's tracing an error would lose its message.
        _probe_score(variant.score.bind(Hq, L), q.device)
        params = variant.score.params
    rows, keys, values, *params = _FirstOrderOnly.apply(rows, keys, values, *params)
    # An empty tensor (a depth bias when L = 0) has no gradient to compute, and
    # the eager op fails on a buffer that requires grad yet is never read.
    params = [p.detach() if p.numel() == 0 else p for p in params]
    spread = compiled if spread_grads is None else spread_grads
    copies = [_copies(p) if spread else 1 for p in params]
    if max(copies, default=1) > 1 and not _reads_by_index(variant, Hq, L):
        copies = [1] * len(params)
    params = [_spread(p, n) for p, n in zip(params, copies)]
    if variant.score is not None:
        score_mod = _score_mod(
            variant, q_heads=Hq, q_len=Tq, kv_len=Tk, groups=G, slots=L, copies=copies, device=q.device
        )
    out, lse = _run_flex(rows, keys, values, block_mask, scale, compiled, return_lse, score_mod, tuple(params))
    out = out.view(B, Hk, Tq, G, D).transpose(2, 3).reshape(B, Hq, Tq, D)  # (B, Hq, Tq, D)
    if return_lse:
        lse = lse.view(B, Hk, Tq, G).transpose(2, 3).reshape(B, Hq, Tq).float()  # (B, Hq, Tq)
    seen = _rows_seeing_nonfinite(variant, q_bad, k_bad | v_bad, depth_k_bad | depth_v_bad)  # (B, Hq, Tq)
    out, lse = nonfinite.mark_rows(out, lse, seen)
    return (out, lse) if return_lse else out


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on FlexAttention's inputs that refuses a backward pass building a graph.

    FlexAttention's gradients are not differentiable: under ``create_graph=True``
    they would come back without a graph and second derivatives would be
    silently missing.
    """

    @staticmethod
    def forward(ctx, *tensors: Tensor) -> tuple:
        # ctx in forward, not a setup_context: Dynamo mistakes a ctx-less
        # forward(*tensors) for one whose first argument is the context.
        outs = tuple(t.view_as(t) for t in tensors)
        # A Function's outputs all require grad when one input does; a fixed score
        # tensor must not, or FlexAttention computes (and the copies spread) its gradient.
        ctx.mark_non_differentiable(*(o for o, needed in zip(outs, ctx.needs_input_grad) if not needed))
        return outs

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        # Grad mode is on in a backward pass exactly under create_graph=True.
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "backend 'flex' has no second derivative (backward with create_graph=True, e.g. a gradient "
                "penalty): use backend='reference', which has one"
            )
        return grads


def _rows_seeing_nonfinite(variant: Variant, q_bad: Tensor, key_bad: Tensor, slot_bad: Tensor) -> Tensor:
    """Rows (B, Hq, Tq) that see a non-finite entry: from the structure's spans, else densely."""
    structure = variant.structure
    if structure is not None and structure.keys_contiguous:
        return nonfinite.rows_seeing(structure, q_bad, key_bad, slot_bad)
    B, Hq, Tq = q_bad.shape
    Tk, L = key_bad.shape[2], slot_bad.shape[3]
    seq_visible, depth_visible = visible_entries(variant, B, Hq, Tq, Tk, L, q_bad.device)
    return nonfinite.rows_seeing_dense(seq_visible, depth_visible, q_bad, key_bad, slot_bad, variant.own_depth_only)


# Inductor's default FlexAttention tiles for a score whose tensors learn ask
# an H100 for more shared memory than it has ("No valid triton configs" at
# bf16, D=64); these options are the ones that compile there (see
# benchmarks/bench_score.py).
LEARNED_SCORE_KERNEL_OPTIONS = {"num_stages": 2}


# FlexAttention sums a learning tensor's gradient by atomic adds from every
# score entry it visits; into a small bias they collide (with a (6, 24) depth
# bias a call on an H100 took 36x the time of one without; through the copies
# 6x, BENCHMARKS.md). Stacked copies, each entry adding into the one its
# (row, column) hashes to, spread them; their sum is the gradient.
SPREAD_ELEMENTS = 2**20  # at most this many elements of copies per tensor
MAX_COPIES = 1024


def _copies(param: Tensor) -> int:
    """How many stacked copies of ``param`` the score reads: 1 unless its gradient is computed."""
    if not (param.requires_grad and torch.is_grad_enabled()):
        return 1
    return max(1, min(MAX_COPIES, SPREAD_ELEMENTS // max(param.numel(), 1)))


def _spread(param: Tensor, copies: int) -> Tensor:
    """``param`` as (copies, *param.shape), materialized, or ``param`` itself for one copy."""
    if copies == 1:
        return param
    return param.unsqueeze(0).expand(copies, *param.shape).contiguous()


class _Copy:
    """A score's view of one copy of a stacked tensor: ``t[i]`` reads ``stacked[copy, i]``, in one index.

    FlexAttention takes a score's tensor reads one scalar at a time, so the
    copy is chosen inside the same index; the tensor's shape is readable.
    """

    def __init__(self, stacked: Tensor, copy):
        self._stacked, self._copy = stacked, copy
        self.shape, self.dtype, self.device = stacked.shape[1:], stacked.dtype, stacked.device
        self.ndim = len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def __getitem__(self, index):
        return self._stacked[(self._copy, *(index if isinstance(index, tuple) else (index,)))]


def _reads_by_index(variant: Variant, q_heads: int, slots: int) -> bool:
    """Whether the score reads its tensors only by indexing them (so through :class:`_Copy` too)."""
    params = variant.score.params
    copies = [_Copy(p.detach()[None], torch.zeros(1, dtype=torch.long, device=p.device)) for p in params]
    try:
        _probe_score(variant.score.bind(q_heads, slots, copies), params[0].device)
    except (TypeError, AttributeError):  # an operation a _Copy does not offer
        return False
    return True


# A grid of logits laid out like the reference's (B, Hq, Tq, N), every size
# distinct and above 1, sequence and depth columns alternating.
_PROBE_SHAPE = (2, 3, 4, 5)


def _probe_score(fn, device) -> Tensor:
    """The score function on the :data:`_PROBE_SHAPE` grid (logits 0, every index 0), as the reference calls it.

    Inside FlexAttention every logit is a scalar, so a function that does not
    keep the logit's shape (a reduction or a reshape over some axis) would run
    there; on this grid it fails as on the reference, naming the shapes.
    Index tensors have no 0-d one: Dynamo reads a 0-d integer tensor used as
    an index as a Python int, a data-dependent value it cannot trace.
    """
    B, H, T, N = _PROBE_SHAPE

    def zeros(*shape):
        return torch.zeros(shape, dtype=torch.long, device=device)

    is_depth = (torch.arange(N, device=device) % 2 == 1).view(1, 1, 1, N)
    return fn(torch.zeros(_PROBE_SHAPE, device=device), zeros(B, 1, 1, 1), zeros(1, H, 1, 1), zeros(1, 1, T, 1),
              zeros(1, 1, T, N), zeros(1, 1, 1, N), is_depth)  # fmt: skip


def _run_flex(rows, keys, values, block_mask, scale, compiled, return_lse, score_mod=None, params=()):
    """flex_attention over folded rows; returns out and the natural-log lse (None unless asked).

    ``score_mod(score, b, h, row, col, *params)`` or None; the public
    function reads ``params`` from a closure, the eager op as buffers.
    """
    closed = None if score_mod is None else (lambda score, b, h, row, col: score_mod(score, b, h, row, col, *params))
    if compiled:
        learns = any(p.requires_grad for p in params) and torch.is_grad_enabled()
        flex = functools.partial(
            # inside a compiled model the model's graph compiles flex_attention itself
            flex_attention if torch.compiler.is_compiling() else _compiled_flex(),
            rows,
            keys,
            values,
            score_mod=closed,
            block_mask=block_mask,
            scale=scale,
            kernel_options=dict(LEARNED_SCORE_KERNEL_OPTIONS) if learns and rows.is_cuda else None,
        )
        if not return_lse:
            return flex(), None
        out, aux = flex(return_aux=AuxRequest(lse=True))
        return out, aux.lse
    needs_grad = any(t.requires_grad for t in (rows, keys, values, *params)) and torch.is_grad_enabled()
    if rows.device.type == "cpu" and needs_grad:
        return _eager_flex_with_grad(rows, keys, values, block_mask, scale, score_mod, params)
    with warnings.catch_warnings():
        # Eager FlexAttention warns that it materializes scores; at test sizes
        # that is the point.
        warnings.simplefilter("ignore", UserWarning)
        out, aux = flex_attention(
            rows, keys, values, score_mod=closed, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True)
        )
    return out, aux.lse


def _eager_flex_with_grad(rows, keys, values, block_mask, scale, score_mod=None, params=()):
    """FlexAttention's eager operator, differentiable on CPU.

    The public ``flex_attention`` refuses CPU inputs that require grad, yet its
    eager implementation (the higher-order op, plain PyTorch inside) has a
    working backward. Calling the op directly lets the CPU tests check every
    gradient of this backend; CUDA always takes the public function.
    """
    from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_op
    from torch.nn.attention.flex_attention import _apply_kernel_options

    kernel_options = _apply_kernel_options(rows, keys, values, True, None)
    score_mod = _no_score_mod if score_mod is None else score_mod
    out, lse = flex_attention_op(
        rows, keys, values, score_mod, block_mask.as_tuple(), scale, kernel_options, tuple(params)
    )[:2]
    # The op keeps its statistics in base 2.
    return out, lse * math.log(2.0)


def _no_score_mod(score, b, h, q_idx, kv_idx):
    return score


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    # Compiled once, on first use, never at import time. Dynamic shapes (after
    # the first new length) and tensor-held lengths in the mask keep one
    # compiled kernel for many lengths instead of one per length.
    return torch.compile(flex_attention)


def _score_mod(
    variant: Variant, *, q_heads: int, q_len: int, kv_len: int, groups: int, slots: int, copies, device
):
    """The variant's score over folded rows and ``[sequence | pad | depth]`` columns, as FlexAttention's score_mod.

    Returns ``moda_score(score, b, h, row, col, *params)``, ``h`` the KV
    head; ``params`` are the score's tensors (or a backend's copies of them),
    each stacked ``copies[i]`` times by :func:`_spread` where that is above 1.
    """
    score = variant.score
    # Lengths in a tensor, as for the mask: a compiled kernel reads them as inputs.
    dims = torch.tensor([kv_len - q_len, max(kv_len - 1, 0), padded_kv_len(kv_len), max(slots, 1)], device=device)

    def moda_score(s, b, h, row, col, *params):
        offset, last_key, kv_padded, slots_t = dims.unbind()
        # 131 is odd and near a tile's width: a tile's entries hash to many copies.
        params = [p if n == 1 else _Copy(p, (row * 131 + col) % n) for p, n in zip(params, copies)]
        fn = score.bind(q_heads, slots, params)
        token = row // groups
        q_pos = token + offset  # offset: absolute position of query token 0
        q_head = h * groups + row % groups
        is_depth = col >= kv_padded
        depth_col = (col - kv_padded).clamp(min=0)
        # Sequence (and pad) columns: the key's position; depth: the entry's token and slot.
        pos = torch.where(is_depth, depth_col // slots_t + offset, torch.minimum(col, last_key))
        slot = torch.where(is_depth, depth_col % slots_t, torch.zeros_like(depth_col))
        return fn(s, b, q_head, q_pos, pos, slot, is_depth)

    moda_score.__name__ = f"moda_{score.name}"
    return moda_score
