"""The flex backend against the reference, and its BlockMask against FlexAttention's own."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

import moda_flex
from moda_flex.backends.flex import BLOCK, flex_moda, moda_block_mask
from moda_flex.backends.flex.block_mask import mask_mod, padded_kv_len
from moda_flex.backends.reference import reference_attention
from moda_flex.testing import MoDAShape, assert_matches_reference, make_inputs, moda_shapes

from budget import examples


@settings(max_examples=examples(40))
@given(
    shape=moda_shapes(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    variant=st.sampled_from(["causal", "full"]),
    strided=st.booleans(),
)
def test_flex_matches_reference(shape, dtype, variant, strided):
    inputs = make_inputs(shape, dtype=dtype, strided_depth=strided)
    assert_matches_reference(inputs, backend="flex", variant=variant)


@settings(max_examples=examples(8))
@given(shape=moda_shapes(max_kv_len=40, head_dims=(16, 32)))
def test_flex_bfloat16_matches_reference(shape):
    assert_matches_reference(make_inputs(shape, dtype=torch.bfloat16, strided_depth=True), backend="flex")


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


structured_variants = st.one_of(
    st.just(moda_flex.causal()),
    st.just(moda_flex.full()),
    st.just(moda_flex.depth_only()),
    st.integers(1, 300).map(moda_flex.sliding_window),
    st.integers(1, 9).map(moda_flex.depth_window),
    st.integers(1, 200).map(moda_flex.chunk_depth),
    st.integers(1, 200).map(lambda w: moda_flex.sliding_window(w) & moda_flex.depth_window(2)),
)


@settings(max_examples=examples(60))
@given(
    kv_len=st.integers(1, 700),
    data=st.data(),
    groups=st.integers(1, 8),
    slots=st.integers(0, 9),
    variant=structured_variants,
    with_documents=st.booleans(),
)
def test_structural_block_mask_equals_dense_evaluation(kv_len, data, groups, slots, variant, with_documents):
    """Same partial and full blocks as create_block_mask, and a consistent transpose."""
    q_len = data.draw(st.integers(1, kv_len))
    if with_documents:
        lengths = data.draw(st.lists(st.integers(1, 150), min_size=1, max_size=8))
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        ids = torch.cat([ids, ids.new_full((max(kv_len - len(ids), 0),), len(lengths))])[:kv_len]
        variant = variant & moda_flex.document(ids)
    mine = moda_block_mask(
        variant, batch=1, kv_heads=1, q_len=q_len, kv_len=kv_len, groups=groups, slots=slots, device="cpu"
    )
    dense = create_block_mask(
        mask_mod(variant, q_len, kv_len, groups, slots),
        1,
        1,
        mine.seq_lengths[0],
        mine.seq_lengths[1],
        device="cpu",
        BLOCK_SIZE=BLOCK,
    )
    q_blocks, kv_blocks = dense.kv_num_blocks.shape[-1], dense.q_num_blocks.shape[-1]
    partial, full = _block_grids(mine, q_blocks, kv_blocks)
    dense_partial, dense_full = _block_grids(dense, q_blocks, kv_blocks)
    # The same blocks are visited; sequence blocks are full exactly when they
    # are, depth blocks are always treated as partial (a chunk_depth block can
    # be wholly visible; the mask is then merely evaluated there).
    assert (partial | full).equal(dense_partial | dense_full)
    depth_cols = slice(padded_kv_len(kv_len) // BLOCK, None)
    assert not full[..., depth_cols].any()
    sequence_cols = slice(0, padded_kv_len(kv_len) // BLOCK)
    assert full[..., sequence_cols].equal(dense_full[..., sequence_cols])
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


@pytest.mark.parametrize("name", ["q", "depth_v"])
def test_a_second_derivative_is_refused(name):
    inputs = make_inputs(MoDAShape(1, 2, 1, 5, 5, 2, 8))
    out = moda_flex.moda_attention(**inputs, backend="flex")
    with pytest.raises(NotImplementedError, match="create_graph=True.*backend='reference'"):
        torch.autograd.grad(out.pow(2).sum(), inputs[name], create_graph=True)
    grads = torch.autograd.grad(out.pow(2).sum(), list(inputs.values()))  # first order still works
    assert all(g is not None for g in grads)


def test_compiled_model_trains_through_the_cpu_flex_backend():
    """Off CUDA the flex call is a graph break: compile works, training included; fullgraph says what to do."""
    inputs = make_inputs(MoDAShape(1, 2, 1, 5, 5, 2, 8))

    def loss(q, k, v, depth_k, depth_v):
        return moda_flex.moda_attention(q, k, v, depth_k, depth_v, backend="flex").pow(2).sum()

    def whole_graph_loss(q, k, v, depth_k, depth_v):  # its own code object: dynamo caches per code
        return moda_flex.moda_attention(q, k, v, depth_k, depth_v, backend="flex").sum()

    leaves = [t.detach().requires_grad_() for t in inputs.values()]
    torch.compile(loss)(*leaves).backward()
    eager = [t.detach().requires_grad_() for t in inputs.values()]
    loss(*eager).backward()
    for mine, expected in zip(leaves, eager):
        torch.testing.assert_close(mine.grad, expected.grad)
    with pytest.raises(Exception, match="backend='auto' or 'reference'"):
        torch.compile(whole_graph_loss, fullgraph=True)(*leaves)


@pytest.mark.parametrize(
    "variant, q_len, kv_len, groups, slots",
    [
        (moda_flex.causal(), 150, 261, 3, 5),
        (moda_flex.sliding_window(37) & moda_flex.depth_window(2), 200, 200, 8, 4),
    ],
)
def test_compiled_flex_skips_only_masked_blocks(variant, q_len, kv_len, groups, slots):
    """Compiled FlexAttention honours the block lists (eager evaluates every element)."""
    shape = MoDAShape(1, 2 * groups, 2, q_len, kv_len, slots, 16)
    inputs = make_inputs(shape, requires_grad=False, strided_depth=True)
    args = list(inputs.values()) + [variant, 0.25]
    out = flex_moda(*args, compiled=True, return_lse=False)
    ref, _ = reference_attention(*args)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4


def test_compiled_flex_serves_many_lengths_without_recompiling_each():
    """Shape numbers reach the mask as tensors, so new lengths do not exhaust dynamo's recompiles."""
    from torch._dynamo.utils import counters  # dynamo's own tally of compiled graphs

    lengths = [(40, 70), (41, 75), (30, 90), (55, 100), (20, 110), (33, 120), (44, 130), (50, 140), (60, 150),
               (61, 160), (62, 170), (63, 180)]
    graphs_before = counters["stats"]["unique_graphs"]
    for step, (q_len, kv_len) in enumerate(lengths):
        inputs = make_inputs(MoDAShape(1, 4, 2, q_len, kv_len, 3, 16), requires_grad=False, seed=step)
        args = list(inputs.values()) + [moda_flex.causal(), 0.25]
        out = flex_moda(*args, compiled=True, return_lse=False)
        ref, _ = reference_attention(*args)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-4, (q_len, kv_len)
    # Each recompile is a new graph; past dynamo's limit of 8 it would run eagerly.
    assert counters["stats"]["unique_graphs"] - graphs_before < 8
