"""Which entries a row sees: the element mask and the BlockMask built from the variant's structure.

One :class:`Layout` describes the rows and columns of a FlexAttention call:
the concatenated ``[sequence | chunk-packed depth]`` call over folded rows,
the sequence part alone (one row per query, the call's heads the query
heads) or the depth part alone (folded rows, depth columns only).

The BlockMask comes from the variant's :class:`~moda_flex.variants.Structure`:
every token's visible keys form an interval ``[lo(p), hi(p)]`` whose ends
never decrease with ``p``, and so does its depth span. For a block of rows
the union and the intersection of those intervals are read off its first and
last token, which gives the partial and the full KV blocks directly; the
transposed (KV-block to row-block) lists follow from ``searchsorted`` on the
same monotone ends. Nothing is evaluated per element: the cost is that of
the block grid, ``(Q_LEN / 128) x (KV_LEN / 128)`` index entries
(FlexAttention reads a list's width as the block count), never
``Q_LEN x KV_LEN``.

A variant without a structure (a user's own predicates), or with documents
split into several runs, falls back to ``create_block_mask``, which evaluates
the mask densely: O(Tq*G*(Tk + Tq*L)) work, fine for prototyping at modest
lengths.

Shapes below: ``NQ`` row blocks, ``NS`` sequence column blocks, ``ND`` depth
column blocks, ``Bm`` the batch rows of the block lists (the rows of the
document ids, else 1).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from ...variants import Structure, Variant
from ..blocks import cdiv

BLOCK = 128  # rows and columns per BlockMask block


def padded_kv_len(kv_len: int) -> int:
    """The sequence columns: ``kv_len`` rounded up to whole blocks, so that no block mixes keys and depth."""
    return cdiv(kv_len, BLOCK) * BLOCK


PARTS = ("concat", "sequence", "depth")


class Layout(NamedTuple):
    """The rows and columns of one FlexAttention call.

    Rows: ``q_len * groups``; row ``r`` is query token ``r // groups`` and, of
    the call's head ``h``, query head ``h * groups + r % groups`` (``groups``
    1: the call's heads are the query heads). Columns: ``seq_cols`` sequence
    columns (keys ``0 .. kv_len - 1``, then padding), then ``q_len * slots``
    depth columns, token after token.
    """

    q_len: int
    kv_len: int
    groups: int
    slots: int
    seq_cols: int

    @classmethod
    def of(cls, part: str, q_len: int, kv_len: int, groups: int, slots: int) -> "Layout":
        """The layout of ``part``, one of :data:`PARTS`, for a call with Tq, Tk, G and L."""
        if part == "concat":
            # Padding keeps keys and depth out of one block; without depth none is needed.
            return cls(q_len, kv_len, groups, slots, padded_kv_len(kv_len) if slots else kv_len)
        if part == "sequence":
            return cls(q_len, kv_len, 1, 0, kv_len)
        if part == "depth":
            return cls(q_len, kv_len, groups, slots, 0)
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")

    @property
    def rows(self) -> int:
        return self.q_len * self.groups

    @property
    def columns(self) -> int:
        return self.seq_cols + self.q_len * self.slots


def folded_query(h: Tensor, row: Tensor, groups: int, offset: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Row ``row`` of the call's head ``h`` (:class:`Layout`): its query token, that token's absolute position
    (``offset``: query token 0's) and its query head.

    ``groups`` stays an int: it is fixed per model, and dividing by a constant is cheap.
    """
    if groups == 1:
        return row, row + offset, h
    token = row // groups
    return token, token + offset, h * groups + row % groups


def depth_entry(col: Tensor, seq_cols: Tensor, slots: Tensor, offset: Tensor) -> tuple[Tensor, Tensor]:
    """Depth column ``col`` (:class:`Layout`): the absolute position of the token its entry was written for, and
    the entry's slot; a sequence column reads as the first entry."""
    depth_col = (col - seq_cols).clamp(min=0)
    return depth_col // slots + offset, depth_col % slots


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
    part: str = "concat",
) -> BlockMask:
    """The BlockMask of ``variant`` for one part of a call (:meth:`Layout.of`), by default ``[sequence | depth]``.

    Built structurally (and cached per structure and layout) when every
    query's keys form one interval, densely otherwise, for ``batch`` rows and
    ``kv_heads`` heads: the call's heads, the query heads for the
    ``"sequence"`` part.
    """
    device = torch.device(device)
    layout = Layout.of(part, q_len, kv_len, groups, slots)
    structure = variant.structure
    if structure is None or not structure.keys_contiguous:
        mask = mask_mod(variant, layout, device)
        return create_block_mask(mask, batch, kv_heads, layout.rows, layout.columns, device=device, BLOCK_SIZE=BLOCK)
    key = (structure, layout, str(device))
    block_mask = _BLOCK_MASK_CACHE.pop(key, None)
    if block_mask is None:
        # Cached tensors made under inference_mode would be inference tensors,
        # which a later training call cannot save for backward.
        with torch.inference_mode(False):
            block_mask = structural_block_mask(structure, layout, device, mask_mod(variant, layout, device))
    _BLOCK_MASK_CACHE[key] = block_mask  # most recently used last
    while len(_BLOCK_MASK_CACHE) > _BLOCK_MASK_CACHE_SIZE:
        _BLOCK_MASK_CACHE.pop(next(iter(_BLOCK_MASK_CACHE)))
    return block_mask


# A structure states its masks exactly (documents compare by identity), so
# the structure and the layout determine the block mask, whatever the
# variant's name; the entry keeps its documents alive, so no other ids can
# take their identity.
_BLOCK_MASK_CACHE: dict = {}
_BLOCK_MASK_CACHE_SIZE = 32


def layout_lengths(layout: Layout, device) -> Tensor:
    """The lengths the element mask and the score read, ``[Tk - Tq, Tk, Tk - 1, seq_cols, max(L, 1)]`` int64.

    In a tensor, not Python ints, so that a compiled FlexAttention reads them
    as inputs instead of recompiling for every length (and every layer's L).
    Cached per layout outside a compiled region (one host-to-device copy per
    new layout); inside one, the graph makes it.
    """
    values = [layout.kv_len - layout.q_len, layout.kv_len, max(layout.kv_len - 1, 0), layout.seq_cols,
              max(layout.slots, 1)]  # fmt: skip
    if torch.compiler.is_compiling():
        return torch.tensor(values, device=device)
    key = (layout, str(device))
    lengths = _LENGTHS_CACHE.pop(key, None)
    if lengths is None:
        with torch.inference_mode(False):  # see moda_block_mask
            lengths = torch.tensor(values, device=device)
    _LENGTHS_CACHE[key] = lengths
    while len(_LENGTHS_CACHE) > _BLOCK_MASK_CACHE_SIZE:
        _LENGTHS_CACHE.pop(next(iter(_LENGTHS_CACHE)))
    return lengths


_LENGTHS_CACHE: dict = {}


def mask_mod(variant: Variant, layout: Layout, device="cpu"):
    """The element mask of ``layout``'s rows and columns, as FlexAttention's mask_mod."""
    groups, has_keys, has_depth = layout.groups, layout.seq_cols > 0, layout.slots > 0
    own_depth = variant.own_depth_only
    sequence = variant.sequence
    depth = variant.depth_predicate(layout.slots)
    dims = layout_lengths(layout, device)

    def moda_mask(b, h, row, col):
        offset, kv_len, last_key, seq_cols, slots = dims.unbind()
        token, q_pos, q_head = folded_query(h, row, groups, offset)
        if has_keys:
            key_ok = (col < kv_len) & sequence(b, q_head, q_pos, torch.minimum(col, last_key))
            if not has_depth:
                return key_ok
        if own_depth:
            # The row's own depth span, found without dividing by L.
            slot = col - seq_cols - token * slots
            depth_ok = (slot >= 0) & (slot < slots) & depth(b, q_head, q_pos, q_pos, slot)
        else:
            d_pos, slot = depth_entry(col, seq_cols, slots, offset)
            depth_ok = (col >= seq_cols) & depth(b, q_head, q_pos, d_pos, slot)
        return torch.where(col < seq_cols, key_ok, depth_ok) if has_keys else depth_ok

    moda_mask.__name__ = f"moda_{variant.name}"
    return moda_mask


def structural_block_mask(structure: Structure, layout: Layout, device, element_mask) -> BlockMask:
    """The BlockMask of ``structure`` over ``layout``, from its key and depth spans, in time proportional to the block grid.

    Args:
        structure: exact spans (``structure.keys_contiguous``).
        layout: the call's rows and columns.
        device: where the block lists live.
        element_mask: the :func:`mask_mod` of the call, applied inside partial blocks.

    Returns:
        a BlockMask of ``layout.rows`` rows and ``layout.columns`` columns
        whose lists are (Bm, 1, ...): the same blocks for every head.
        Sequence blocks are full or partial as the mask is; depth blocks are
        always partial.
    """
    q_len, kv_len, groups, slots = layout.q_len, layout.kv_len, layout.groups, layout.slots
    if layout.seq_cols == 0:  # the depth part alone: no key is a column
        structure = dataclasses.replace(structure, sequence=False)
    rows = layout.rows
    q_blocks = cdiv(rows, BLOCK)
    seq_blocks = cdiv(layout.seq_cols, BLOCK)
    depth_blocks = cdiv(q_len * slots, BLOCK)
    # A ragged last row block is never called full (as create_block_mask does).
    ragged = rows % BLOCK != 0
    first, last = _row_block_tokens(q_blocks, rows, groups, device)
    keys = _key_blocks(structure, first, last, q_len, kv_len, ragged)
    depth_lo, depth_hi = _depth_blocks(structure, first, last, q_len, kv_len, slots, seq_blocks)
    depth_lo, depth_hi = depth_lo.expand_as(keys.touch_lo), depth_hi.expand_as(keys.touch_lo)

    # FlexAttention's kernels take the width of an index list for the number
    # of blocks on the other side, so the lists span the whole block grid.
    kv_width = seq_blocks + depth_blocks
    kv_num, kv_idx = _concat_ranges(
        _partial_pieces(keys.touch_lo, keys.touch_hi + 1, keys.full_lo, keys.full_count)
        + [(depth_lo, depth_hi - depth_lo + 1)],
        kv_width,
    )
    full_kv_num, full_kv_idx = _concat_ranges([(keys.full_lo, keys.full_count)], kv_width)
    (q_num, q_idx), (full_q_num, full_q_idx) = _row_blocks_of_columns(
        keys, depth_lo, depth_hi, seq_blocks, depth_blocks, q_blocks, ragged
    )

    def heads(t):  # (Bm, N, ...) -> (Bm, 1, N, ...): the same blocks for every head
        return t.unsqueeze(1).to(torch.int32).contiguous()

    return BlockMask(
        seq_lengths=(rows, layout.columns),
        kv_num_blocks=heads(kv_num),
        kv_indices=heads(kv_idx),
        full_kv_num_blocks=heads(full_kv_num),
        full_kv_indices=heads(full_kv_idx),
        q_num_blocks=heads(q_num),
        q_indices=heads(q_idx),
        full_q_num_blocks=heads(full_q_num),
        full_q_indices=heads(full_q_idx),
        BLOCK_SIZE=(BLOCK, BLOCK),
        mask_mod=element_mask,
    )


def _row_block_tokens(q_blocks: int, rows: int, groups: int, device) -> tuple[Tensor, Tensor]:
    """The first and the last query token of every block of folded rows: (NQ,) each, int64."""
    block = torch.arange(q_blocks, device=device)
    first = (block * BLOCK) // groups
    last = torch.clamp((block + 1) * BLOCK - 1, max=rows - 1) // groups
    return first, last


class _KeyBlocks(NamedTuple):
    """Per row block, (Bm, NQ) int64 each: the sequence blocks it touches and those every one of its rows sees whole.

    Touched: ``touch_lo .. touch_hi`` (none when ``has_keys`` is False: then
    0 and -1). Full: ``full_count`` blocks from ``full_lo`` (0 for a ragged
    last row block); ``full_hi`` is the last whole block before that rule, as
    the transposed lists need it.
    """

    touch_lo: Tensor
    touch_hi: Tensor
    has_keys: Tensor
    full_lo: Tensor
    full_hi: Tensor
    full_count: Tensor


def _key_blocks(structure: Structure, first: Tensor, last: Tensor, q_len: int, kv_len: int, ragged: bool) -> _KeyBlocks:
    """The sequence blocks of every row block, from the spans of its ``first`` and ``last`` token, (NQ,) each."""
    lo, hi = structure.key_spans(q_len, kv_len, first.device)  # (Bm, Tq) each
    first, last = first.expand(lo.shape[0], -1), last.expand(lo.shape[0], -1)
    # The ends never decrease: the union of the rows' spans runs from the first
    # token's lo to the last token's hi, the intersection from the last's lo to the first's hi.
    union_lo, union_hi = lo.gather(1, first), hi.gather(1, last)  # (Bm, NQ)
    inter_lo, inter_hi = lo.gather(1, last), hi.gather(1, first)
    has_keys = union_lo <= union_hi
    full_lo = cdiv(inter_lo, BLOCK)
    full_hi = (inter_hi + 1) // BLOCK - 1
    full_count = (full_hi - full_lo + 1).clamp(min=0)
    if ragged:
        full_count[:, -1] = 0
    return _KeyBlocks(
        touch_lo=torch.where(has_keys, union_lo // BLOCK, 0),
        touch_hi=torch.where(has_keys, union_hi // BLOCK, -1),
        has_keys=has_keys,
        full_lo=full_lo,
        full_hi=full_hi,
        full_count=full_count,
    )


def _depth_blocks(
    structure: Structure, first: Tensor, last: Tensor, q_len: int, kv_len: int, slots: int, seq_blocks: int
) -> tuple[Tensor, Tensor]:
    """The depth column blocks ``lo .. hi`` of every row block: (1, NQ) each, none (``hi < lo``) when L = 0.

    A row block's depth is the chunk-packed span of its tokens' slots, after
    the ``seq_blocks`` sequence blocks.
    """
    if slots == 0:
        none = torch.zeros_like(first).unsqueeze(0)
        return none, none - 1
    d_lo, d_hi, slot_lo = structure.depth_spans(q_len, kv_len, slots, first.device)  # (Tq,), (Tq,), int
    col_lo = d_lo[first] * slots + slot_lo
    col_hi = d_hi[last] * slots + slots - 1
    return (seq_blocks + col_lo // BLOCK).unsqueeze(0), (seq_blocks + col_hi // BLOCK).unsqueeze(0)


def _row_blocks_of_columns(
    keys: _KeyBlocks, depth_lo: Tensor, depth_hi: Tensor, seq_blocks: int, depth_blocks: int, q_blocks: int,
    ragged: bool,
):  # fmt: skip
    """The transposed lists: for every column block, the row blocks that visit it, partially and in full.

    The ends of the row blocks' ranges never decrease, so the row blocks of
    one column block form a contiguous range, found by binary search.

    Returns:
        (counts (Bm, NS + ND), indices (Bm, NS + ND, W)) for the partial
        visits, then the same for the full ones.
    """
    bm = keys.touch_lo.shape[0]
    j = torch.arange(seq_blocks, device=depth_lo.device).expand(bm, -1).contiguous()
    touch_start = _first_at_least(keys.touch_hi, j)
    touch_end = _count_at_most(torch.where(keys.has_keys, keys.touch_lo, seq_blocks), j)
    full_start = _first_at_least(keys.full_hi, j)
    full_end = _count_at_most(keys.full_lo, j)
    if ragged:
        full_end = full_end.clamp(max=q_blocks - 1)
    full_rows = (full_end - full_start).clamp(min=0)
    seq_pieces = _partial_pieces(touch_start, touch_end, full_start, full_rows)
    # Depth blocks (none when L = 0) are visited by a contiguous range of row blocks, always as partial.
    jd = torch.arange(seq_blocks, seq_blocks + depth_blocks, device=depth_lo.device).expand(bm, -1).contiguous()
    depth_start = _first_at_least(depth_hi.contiguous(), jd)
    depth_rows = (_count_at_most(depth_lo.contiguous(), jd) - depth_start).clamp(min=0)
    no_rows = torch.zeros_like(depth_rows)
    partial = _concat_ranges(
        [
            (torch.cat([seq_pieces[0][0], depth_start], 1), torch.cat([seq_pieces[0][1], depth_rows], 1)),
            (torch.cat([seq_pieces[1][0], depth_start], 1), torch.cat([seq_pieces[1][1], no_rows], 1)),
        ],
        q_blocks,
    )
    full = _concat_ranges([(torch.cat([full_start, depth_start], 1), torch.cat([full_rows, no_rows], 1))], q_blocks)
    return partial, full


def _partial_pieces(touch_start: Tensor, touch_end: Tensor, full_start: Tensor, full_count: Tensor) -> list:
    """The touched blocks that are not full: the piece before the full ones and the piece after, as (start, count).

    All (Bm, N): touched ``touch_start .. touch_end - 1``, full ``full_count``
    blocks from ``full_start``, inside the touched ones.
    """
    has_full = full_count > 0
    full_end = torch.where(has_full, full_start + full_count, touch_end)
    full_start = torch.where(has_full, full_start, touch_end)
    return [(touch_start, (full_start - touch_start).clamp(min=0)), (full_end, (touch_end - full_end).clamp(min=0))]


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

