"""MoDA on FlexAttention: one call over ``[sequence | chunk-packed depth]``.

Layout (per batch and KV head)::

    rows     r = t * G + g          query token t, query head kv_head * G + g
    columns  [ k_0 ... k_{Tk-1} pad | depth(t=0, l=0..L-1) depth(t=1, ...) ... ]
              \\___ Tk_pad = Tk rounded up to KV blocks __/ \\____ Tq * L ____/

The G query heads of a group are folded into rows, so a block of rows covers
a few consecutive tokens and reads one contiguous span of depth columns (the
chunk-packed layout). The sequence part is padded to whole KV blocks so that
no block mixes sequence keys and depth entries.

The BlockMask is built from the variant's :class:`~moda_flex.variants.Structure`:
every token's visible keys form an interval ``[lo(p), hi(p)]`` whose ends never
decrease with ``p``, and so does its depth span. For a block of rows the union
and the intersection of those intervals are read off its first and last
token, which gives the partial and the full KV blocks directly; the
transposed (KV-block to query-block) lists follow from ``searchsorted`` on the
same monotone ends. Nothing is evaluated per element: the cost is that of
the block grid, ``(Q_LEN / 128) x (KV_LEN / 128)`` index entries (FlexAttention
reads a list's width as the block count), never ``Q_LEN x KV_LEN``.

A variant without a structure (a user's own predicates), or with documents
split into several runs, falls back to ``create_block_mask``, which evaluates
the mask densely: O(Tq*G*(Tk + Tq*L)) work, fine for prototyping at modest
lengths.

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
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from . import nonfinite
from .reference import visible_entries
from .variants import Structure, Variant

BLOCK = 128  # rows and columns per BlockMask block


def flex_attention_backend(
    q: Tensor, k: Tensor, v: Tensor, depth_k: Tensor, depth_v: Tensor, variant: Variant, scale: float
) -> tuple[Tensor, Tensor]:
    """MoDA through one ``flex_attention`` call; compiled on CUDA, eager elsewhere.

    Args and returns as :func:`moda_flex.reference.reference_attention`.
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
):
    """Like :func:`flex_attention_backend`, choosing eager or compiled FlexAttention.

    Compiled FlexAttention on CPU runs inference only, without the lse: call it
    with ``return_lse=False`` there.

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
        # Check the params against this call, and the function on one scalar entry,
        # here: inside FlexAttention's tracing an error would lose its message.
        index = q.new_zeros((), dtype=torch.long)
        variant.score.bind(Hq, L)(q.new_zeros((), dtype=torch.float32), index, index, index, index, index, index == 0)
        score_mod = _score_mod(variant, q_heads=Hq, q_len=Tq, kv_len=Tk, groups=G, slots=L, device=q.device)
        params = variant.score.params
    rows, keys, values, *params = _FirstOrderOnly.apply(rows, keys, values, *params)
    # An empty tensor (a depth bias when L = 0) has no gradient to compute, and
    # the eager op fails on a buffer that requires grad yet is never read.
    params = [p.detach() if p.numel() == 0 else p for p in params]
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
    def forward(*tensors: Tensor) -> tuple:
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

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


def _run_flex(rows, keys, values, block_mask, scale, compiled, return_lse, score_mod=None, params=()):
    """flex_attention over folded rows; returns out and the natural-log lse (None unless asked).

    ``score_mod(score, b, h, row, col, *params)`` or None; the public
    function reads ``params`` from a closure, the eager op as buffers.
    """
    closed = None if score_mod is None else (lambda score, b, h, row, col: score_mod(score, b, h, row, col, *params))
    if compiled:
        flex = functools.partial(_compiled_flex(), rows, keys, values, score_mod=closed, block_mask=block_mask, scale=scale)
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


def moda_block_mask(
    variant: Variant,
    *,
    batch: int,
    kv_heads: int,
    q_len: int,
    kv_len: int,
    groups: int,
    slots: int,
    device,
) -> BlockMask:
    """The BlockMask of ``variant`` over folded rows and ``[sequence | depth]`` columns.

    Rows: ``q_len * groups``; columns: ``kv_len`` rounded up to ``BLOCK``, then
    ``q_len * slots`` depth entries. Built structurally (and cached per
    structure and shape) when every query's keys form one interval, densely
    otherwise.
    """
    device = torch.device(device)
    structure = variant.structure
    if structure is None or not structure.keys_contiguous:
        lengths = (q_len * groups, _round_up(kv_len, BLOCK) + q_len * slots)
        mask_mod = _mask_mod(variant, q_len, kv_len, groups, slots, device)
        return create_block_mask(mask_mod, batch, kv_heads, *lengths, device=device, BLOCK_SIZE=BLOCK)
    key = (structure, q_len, kv_len, groups, slots, str(device))
    block_mask = _BLOCK_MASK_CACHE.pop(key, None)
    if block_mask is None:
        mask_mod = _mask_mod(variant, q_len, kv_len, groups, slots, device)
        block_mask = _structural_block_mask(structure, q_len, kv_len, groups, slots, device, mask_mod)
    _BLOCK_MASK_CACHE[key] = block_mask  # most recently used last
    while len(_BLOCK_MASK_CACHE) > _BLOCK_MASK_CACHE_SIZE:
        _BLOCK_MASK_CACHE.pop(next(iter(_BLOCK_MASK_CACHE)))
    return block_mask


# A structure states its masks exactly (documents compare by identity), so
# the structure and the shape determine the block mask, whatever the
# variant's name; the entry keeps its documents alive, so no other ids can
# take their identity.
_BLOCK_MASK_CACHE: dict = {}
_BLOCK_MASK_CACHE_SIZE = 16


def _mask_mod(variant: Variant, q_len: int, kv_len: int, groups: int, slots: int, device="cpu"):
    """The element mask over folded rows and ``[sequence | pad | depth]`` columns."""
    has_depth = slots > 0
    own_depth = variant.own_depth_only
    sequence = variant.sequence
    depth = variant.depth_predicate(slots)
    # Lengths live in tensors, not Python ints, so that a compiled
    # flex_attention reads them as inputs instead of recompiling for every
    # length (and every layer's L). G stays an int: it is fixed per model, and
    # dividing by a constant is cheap.
    dims = torch.tensor(
        [kv_len - q_len, kv_len, max(kv_len - 1, 0), _round_up(kv_len, BLOCK), max(slots, 1)], device=device
    )

    def moda_mask(b, h, row, col):
        offset, kv_len, last_key, kv_padded, slots = dims.unbind()
        token = row // groups
        q_pos = token + offset  # offset: absolute position of query token 0
        q_head = h * groups + row % groups
        key_ok = (col < kv_len) & sequence(b, q_head, q_pos, torch.minimum(col, last_key))
        if not has_depth:
            return key_ok
        depth_col = col - kv_padded
        if own_depth:
            # The row's own depth span, found without dividing by L.
            slot = depth_col - token * slots
            depth_ok = (slot >= 0) & (slot < slots) & depth(b, q_head, q_pos, q_pos, slot)
        else:
            depth_col = depth_col.clamp(min=0)
            d_pos = depth_col // slots + offset
            depth_ok = (col >= kv_padded) & depth(b, q_head, q_pos, d_pos, depth_col % slots)
        return torch.where(col < kv_padded, key_ok, depth_ok)

    moda_mask.__name__ = f"moda_{variant.name}"
    return moda_mask


def _score_mod(variant: Variant, *, q_heads: int, q_len: int, kv_len: int, groups: int, slots: int, device):
    """The variant's score over folded rows and ``[sequence | pad | depth]`` columns, as FlexAttention's score_mod.

    Returns ``moda_score(score, b, h, row, col, *params)``, ``h`` the KV
    head; ``params`` are the score's tensors (or a backend's copies of them).
    """
    score = variant.score
    # Lengths in a tensor, as for the mask: a compiled kernel reads them as inputs.
    dims = torch.tensor([kv_len - q_len, max(kv_len - 1, 0), _round_up(kv_len, BLOCK), max(slots, 1)], device=device)

    def moda_score(s, b, h, row, col, *params):
        offset, last_key, kv_padded, slots_t = dims.unbind()
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


def _structural_block_mask(
    structure: Structure, q_len: int, kv_len: int, groups: int, slots: int, device, mask_mod
) -> BlockMask:
    rows = q_len * groups
    q_blocks = _ceil_div(rows, BLOCK)
    kv_padded = _round_up(kv_len, BLOCK)
    seq_blocks = kv_padded // BLOCK
    depth_blocks = _ceil_div(q_len * slots, BLOCK)
    # FlexAttention's kernels take the width of an index list for the number
    # of blocks on the other side, so the lists span the whole block grid.
    kv_width, q_width = seq_blocks + depth_blocks, q_blocks

    # First and last query token of every block of folded rows.
    block_idx = torch.arange(q_blocks, device=device)
    first = (block_idx * BLOCK) // groups
    last = torch.clamp((block_idx + 1) * BLOCK - 1, max=rows - 1) // groups

    lo, hi = structure.key_spans(q_len, kv_len, device)  # (Bm, Tq) each
    bm = lo.shape[0]
    first_b, last_b = first.expand(bm, -1), last.expand(bm, -1)
    union_lo, union_hi = lo.gather(1, first_b), hi.gather(1, last_b)  # (Bm, NQ)
    inter_lo, inter_hi = lo.gather(1, last_b), hi.gather(1, first_b)

    # KV blocks a row block touches, and those wholly visible to all its rows.
    has_keys = union_lo <= union_hi
    touch_lo = torch.where(has_keys, union_lo // BLOCK, 0)
    touch_hi = torch.where(has_keys, union_hi // BLOCK, -1)
    full_lo = _ceil_div(inter_lo, BLOCK)
    full_hi = (inter_hi + 1) // BLOCK - 1
    full_count = (full_hi - full_lo + 1).clamp(min=0)
    # A ragged last row block is never called full (as create_block_mask does).
    ragged = rows % BLOCK != 0
    if ragged:
        full_count[:, -1] = 0
    # With no full block, let the left piece be the whole touched range.
    full_lo_kv = torch.where(full_count > 0, full_lo, touch_hi + 1)
    full_hi_kv = torch.where(full_count > 0, full_hi, touch_hi)
    left = (full_lo_kv - touch_lo).clamp(min=0)
    right = (touch_hi - full_hi_kv).clamp(min=0)

    # Depth columns of a row block: the chunk-packed span of its tokens.
    if slots > 0:
        d_lo, d_hi, slot_lo = structure.depth_spans(q_len, kv_len, slots, device)  # (Tq,), (Tq,), int
        col_lo = d_lo[first] * slots + slot_lo
        col_hi = d_hi[last] * slots + slots - 1
        depth_lo = (seq_blocks + col_lo // BLOCK).expand(bm, -1)
        depth_hi = (seq_blocks + col_hi // BLOCK).expand(bm, -1)
    else:
        depth_lo = torch.zeros_like(touch_lo)
        depth_hi = depth_lo - 1
    depth_count = depth_hi - depth_lo + 1

    kv_num, kv_idx = _concat_ranges([(touch_lo, left), (full_hi_kv + 1, right), (depth_lo, depth_count)], kv_width)
    full_kv_num, full_kv_idx = _concat_ranges([(full_lo, full_count)], kv_width)

    # Transposed lists: for each KV block, the row blocks that touch it. The
    # interval ends are non-decreasing in the row block, so each set is a
    # contiguous range found by binary search.
    j = torch.arange(seq_blocks, device=device).expand(bm, -1).contiguous()
    touch_start = _first_at_least(touch_hi, j)
    touch_end = _count_at_most(torch.where(has_keys, touch_lo, seq_blocks), j)
    full_start = _first_at_least(full_hi, j)
    full_end = _count_at_most(full_lo, j)
    if ragged:
        full_end = full_end.clamp(max=q_blocks - 1)
    full_q = (full_end - full_start).clamp(min=0)
    full_start_q = torch.where(full_q > 0, full_start, touch_end)
    full_end_q = torch.where(full_q > 0, full_end, touch_end)
    seq_left = (full_start_q - touch_start).clamp(min=0)
    seq_right = (touch_end - full_end_q).clamp(min=0)
    # Depth blocks (none when L = 0) are visited by a contiguous range of row blocks, always as partial.
    jd = torch.arange(seq_blocks, seq_blocks + depth_blocks, device=device).expand(bm, -1).contiguous()
    depth_start = _first_at_least(depth_hi.contiguous(), jd)
    depth_rows = (_count_at_most(depth_lo.contiguous(), jd) - depth_start).clamp(min=0)
    no_rows = torch.zeros_like(depth_rows)
    q_num, q_idx = _concat_ranges(
        [
            (torch.cat([touch_start, depth_start], 1), torch.cat([seq_left, depth_rows], 1)),
            (torch.cat([full_end_q, depth_start], 1), torch.cat([seq_right, no_rows], 1)),
        ],
        q_width,
    )
    full_q_num, full_q_idx = _concat_ranges(
        [(torch.cat([full_start, depth_start], 1), torch.cat([full_q, no_rows], 1))], q_width
    )

    def heads(t):  # (Bm, N, ...) -> (Bm, 1, N, ...): the same blocks for every head
        return t.unsqueeze(1).to(torch.int32).contiguous()

    return BlockMask(
        seq_lengths=(rows, kv_padded + q_len * slots),
        kv_num_blocks=heads(kv_num),
        kv_indices=heads(kv_idx),
        full_kv_num_blocks=heads(full_kv_num),
        full_kv_indices=heads(full_kv_idx),
        q_num_blocks=heads(q_num),
        q_indices=heads(q_idx),
        full_q_num_blocks=heads(full_q_num),
        full_q_indices=heads(full_q_idx),
        BLOCK_SIZE=(BLOCK, BLOCK),
        mask_mod=mask_mod,
    )


def _concat_ranges(ranges, min_width: int):
    """Rows of consecutive integers: for each row, ``start_1 .. start_1+n_1-1, start_2 ..``.

    Args:
        ranges: list of (start, count) pairs of (Bm, N) tensors.
        min_width: the least width of the index lists.

    Returns:
        counts (Bm, N) and indices (Bm, N, W), W the largest total (at least
        ``min_width``), unused entries 0.
    """
    counts = [n.clamp(min=0) for _, n in ranges]
    total = sum(counts)
    width = max(int(total.max()) if total.numel() else 0, min_width)
    k = torch.arange(width, device=total.device)
    indices = torch.zeros(*total.shape, width, dtype=torch.long, device=total.device)
    before = torch.zeros_like(total)
    for (start, _), n in zip(ranges, counts):
        inside = (k >= before.unsqueeze(-1)) & (k < (before + n).unsqueeze(-1))
        indices = torch.where(inside, start.unsqueeze(-1) + k - before.unsqueeze(-1), indices)
        before = before + n
    return total, indices


def _first_at_least(sorted_values: Tensor, targets: Tensor) -> Tensor:
    """Index of the first entry >= target in each row of non-decreasing values."""
    return torch.searchsorted(sorted_values.contiguous(), targets, right=False)


def _count_at_most(sorted_values: Tensor, targets: Tensor) -> Tensor:
    """Number of entries <= target in each row of non-decreasing values."""
    return torch.searchsorted(sorted_values.contiguous(), targets, right=True)


def _ceil_div(a, b):
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b
