"""The flex backend's BlockMask: built from the structure, it equals FlexAttention's dense build; its cache."""

import warnings

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import moda_flex
from moda_flex.backends.flex.block_mask import BLOCK, PARTS, Layout, mask_mod, moda_block_mask
from moda_flex.testing import MoDAShape, assert_matches_reference, make_inputs, variants

from budget import examples


def _dense_blocks(num_blocks, indices, width):
    """(Bm, N) counts and (Bm, 1, N, W) lists -> (Bm, N, width) bool grid; no block listed twice."""
    grid = torch.zeros(num_blocks.shape[0], num_blocks.shape[-1], width, dtype=torch.int64)
    for b in range(num_blocks.shape[0]):
        for row in range(num_blocks.shape[-1]):
            listed = indices[b, 0, row, : num_blocks[b, 0, row]].long()
            grid[b, row].index_add_(0, listed, torch.ones_like(listed))
    assert grid.numel() == 0 or int(grid.max()) <= 1, "a block is listed twice"
    return grid.bool()


def _block_grids(block_mask, q_blocks, kv_blocks):
    partial = _dense_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, kv_blocks)
    full = _dense_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, kv_blocks)
    return partial, full


@settings(max_examples=examples(60))
@given(
    kv_len=st.integers(1, 700),
    data=st.data(),
    groups=st.integers(1, 8),
    slots=st.integers(0, 9),
    part=st.sampled_from(PARTS),
)
def test_structural_block_mask_equals_dense_evaluation(kv_len, data, groups, slots, part):
    """Same partial and full blocks as create_block_mask, and a consistent transpose, for every part of a call."""
    assume(part != "depth" or slots > 0)  # without depth there is no depth part
    q_len = data.draw(st.integers(1, kv_len))
    shape = MoDAShape(batch=1, q_heads=groups, kv_heads=1, q_len=q_len, kv_len=kv_len, slots=slots, head_dim=8)
    variant = data.draw(variants(shape, structured=True))
    mine = moda_block_mask(
        variant, batch=1, kv_heads=1, q_len=q_len, kv_len=kv_len, groups=groups, slots=slots, device="cpu", part=part
    )
    layout = Layout.of(part, q_len, kv_len, groups, slots)
    assert mine.seq_lengths == (layout.rows, layout.columns)
    dense = create_block_mask(
        mask_mod(variant, layout), 1, 1, layout.rows, layout.columns, device="cpu", BLOCK_SIZE=BLOCK
    )
    q_blocks, kv_blocks = dense.kv_num_blocks.shape[-1], dense.q_num_blocks.shape[-1]
    partial, full = _block_grids(mine, q_blocks, kv_blocks)
    dense_partial, dense_full = _block_grids(dense, q_blocks, kv_blocks)
    # The same blocks are visited; sequence blocks are full exactly when they
    # are, depth blocks are always treated as partial (a chunk_depth block can
    # be wholly visible; the mask is then merely evaluated there).
    assert (partial | full).equal(dense_partial | dense_full)
    seq_blocks = -(-layout.seq_cols // BLOCK)
    assert not full[..., seq_blocks:].any()
    assert full[..., :seq_blocks].equal(dense_full[..., :seq_blocks])
    # The KV-block -> row-block lists are the transpose of the row-block lists.
    q_partial = _dense_blocks(mine.q_num_blocks, mine.q_indices, q_blocks).transpose(1, 2)
    q_full = _dense_blocks(mine.full_q_num_blocks, mine.full_q_indices, q_blocks).transpose(1, 2)
    assert q_partial.equal(partial) and q_full.equal(full)


def test_block_masks_are_cached_per_shape():
    args = dict(batch=1, kv_heads=2, q_len=300, kv_len=300, groups=4, slots=3, device="cpu")
    assert moda_block_mask(moda_flex.causal(), **args) is moda_block_mask(moda_flex.causal(), **args)
    assert moda_block_mask(moda_flex.causal(), **args) is not moda_block_mask(moda_flex.sliding_window(8), **args)


def _windowed(window: int) -> moda_flex.Variant:
    """A user's own sliding window: the name stays "mine", the structure says the window."""

    def sequence(b, h, q_pos, k_pos):
        return (k_pos <= q_pos) & (k_pos > q_pos - window)

    return moda_flex.Variant("mine", sequence, structure=moda_flex.Structure(causal=True, window=window))


def test_block_masks_are_cached_by_structure_not_by_name():
    inputs = make_inputs(MoDAShape(1, 2, 1, 200, 200, 1, 8), requires_grad=False)
    for window in (150, 3):
        assert_matches_reference(inputs, backend="flex", variant=_windowed(window), check_grads=False)
    args = dict(batch=1, kv_heads=1, q_len=200, kv_len=200, groups=2, slots=1, device="cpu")
    assert moda_block_mask(_windowed(3), **args) is moda_block_mask(moda_flex.sliding_window(3), **args)


def test_document_masks_are_cached_by_their_ids():
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 60, 40]))
    inputs = make_inputs(MoDAShape(1, 2, 1, 200, 200, 1, 8), requires_grad=False)
    first, second = moda_flex.document(ids), moda_flex.document(ids.flip(0))
    for documents in (first, second, first):
        assert_matches_reference(inputs, backend="flex", variant=moda_flex.causal() & documents, check_grads=False)
    args = dict(batch=1, kv_heads=1, q_len=200, kv_len=200, groups=2, slots=1, device="cpu")
    assert moda_block_mask(first, **args) is moda_block_mask(first, **args)
    assert moda_block_mask(first, **args) is not moda_block_mask(moda_flex.document(ids), **args)


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize(
    "variant, q_len, kv_len, groups, slots",
    [
        (moda_flex.sliding_window(37) & moda_flex.depth_window(2), 200, 261, 8, 4),
        (moda_flex.chunk_depth(50), 180, 190, 2, 3),
    ],
    ids=["window", "chunk"],
)
def test_compiled_flex_attention_skips_only_masked_blocks(variant, q_len, kv_len, groups, slots, part):
    """Compiled FlexAttention honours the block lists of every part, as the eager one that evaluates every element."""
    layout = Layout.of(part, q_len, kv_len, groups, slots)
    heads = 2 * groups if part == "sequence" else 2  # the sequence part's rows are the query heads
    block_mask = moda_block_mask(
        variant, batch=1, kv_heads=heads, q_len=q_len, kv_len=kv_len, groups=groups, slots=slots, device="cpu",
        part=part,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(1, heads, layout.rows, 16, generator=generator)
    keys, values = (torch.randn(1, 2, layout.columns, 16, generator=generator) for _ in range(2))
    compiled = torch.compile(flex_attention)(rows, keys, values, block_mask=block_mask, enable_gqa=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager FlexAttention materializes the scores
        eager = flex_attention(rows, keys, values, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
