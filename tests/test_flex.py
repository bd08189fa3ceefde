"""The flex backend against the reference: both designs, shapes, dtypes, compositions, documents; first derivatives, compiling."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moda_flex
from moda_flex.backends.flex import DESIGNS
from moda_flex.backends.flex import function
from moda_flex.testing import (
    BUILTIN_KINDS,
    MoDAShape,
    assert_matches_reference,
    make_inputs,
    moda_shapes,
    score_functions,
    variants,
)
from moda_flex.variants import BUILTINS

from budget import examples
from own_variant import user_variant


@contextlib.contextmanager
def design(name: str):
    """backend="flex" runs the design ``name`` inside the block."""
    default = function.DESIGN
    function.DESIGN = name
    try:
        yield
    finally:
        function.DESIGN = default


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


# Smaller shapes for the calls that draw variants: every one runs a dense reference.
FLEX_SHAPES = moda_shapes(max_batch=2, max_groups=3, max_kv_heads=2, max_kv_len=40, max_slots=6, head_dims=(8, 16))


@settings(max_examples=examples(25))
@given(shape=FLEX_SHAPES, strided=st.booleans(), data=st.data())
def test_flex_matches_reference_on_compositions(shape, strided, data):
    with_user = st.builds(lambda builtin: builtin & user_variant(), variants(shape, max_terms=1))
    variant = data.draw(variants(shape, max_terms=3) | with_user)
    assert_matches_reference(make_inputs(shape, strided_depth=strided), backend="flex", variant=variant)


@settings(max_examples=examples(25))
@given(shape=FLEX_SHAPES, strided=st.booleans(), name=st.sampled_from(DESIGNS), data=st.data())
def test_every_design_matches_reference_with_scores(shape, strided, name, data):
    """Both designs, built-in and own variants, with and without a score (its tensors learned)."""
    with_user = st.builds(lambda builtin: builtin & user_variant(), variants(shape, max_terms=1))
    variant = data.draw(variants(shape, max_terms=2) | with_user)
    score = data.draw(st.none() | score_functions(shape))
    variant = variant if score is None else variant & score
    with design(name):
        assert_matches_reference(make_inputs(shape, strided_depth=strided), backend="flex", variant=variant)


def _late_start(start: int) -> moda_flex.Variant:
    """Causal keys, for queries at position ``start`` or later only: the earlier rows see no key."""

    def sequence(b, h, q_pos, k_pos):
        return (k_pos <= q_pos) & (q_pos >= start)

    return moda_flex.Variant("late_start", sequence)


@pytest.mark.parametrize("name", DESIGNS)
@pytest.mark.parametrize("slots", [0, 2])
def test_a_row_that_sees_no_key_gives_zeros_and_minus_inf(name, slots):
    """Without depth the first rows see nothing: zeros, lse = -inf and no NaN in any gradient; with depth they see it."""
    inputs = make_inputs(MoDAShape(1, 4, 2, 6, 6, slots, 8))
    variant = _late_start(3) if slots == 0 else moda_flex.depth_only()
    with design(name):
        out, lse = moda_flex.moda_attention(**inputs, variant=variant, backend="flex", return_lse=True)
        grads = torch.autograd.grad(out.pow(2).sum() + lse[lse.isfinite()].sum(), list(inputs.values()))
    empty = lse == float("-inf")
    assert empty.any() if slots == 0 else not empty.any()
    assert out[empty].eq(0).all() and all(g.isfinite().all() for g in grads)
    assert_matches_reference(inputs, backend="flex", variant=variant)


@pytest.mark.parametrize("name", DESIGNS)
def test_large_finite_logits_stay_finite(name):
    """Logits of order 1e4 (a softmax taken naively would overflow) give finite out, lse and gradients."""
    inputs = make_inputs(MoDAShape(1, 4, 2, 7, 9, 3, 8))
    with torch.no_grad():
        inputs["q"].mul_(100.0)
        inputs["k"].mul_(100.0)
        inputs["depth_k"].mul_(100.0)
    with design(name):
        out, lse = moda_flex.moda_attention(**inputs, backend="flex", return_lse=True)
        grads = torch.autograd.grad(out.sum() + lse.sum(), list(inputs.values()))
    assert lse.abs().max() > 1e3
    assert out.isfinite().all() and lse.isfinite().all() and all(g.isfinite().all() for g in grads)


@settings(max_examples=examples(6))
@given(shape=moda_shapes(max_kv_len=24, max_slots=4, max_groups=2, head_dims=(8,)), data=st.data())
def test_flex_matches_reference_in_float64(shape, data):
    variant = data.draw(variants(shape))
    assert_matches_reference(make_inputs(shape, dtype=torch.float64), backend="flex", variant=variant)


def _split_ids(batch: int, kv_len: int):
    """(batch, kv_len) ids from a few values, so that documents come back after others."""
    return st.lists(
        st.lists(st.integers(0, 2), min_size=kv_len, max_size=kv_len), min_size=batch, max_size=batch
    ).map(torch.tensor)


@settings(max_examples=examples(15))
@given(shape=FLEX_SHAPES, data=st.data())
def test_documents_split_into_runs_are_computed_exactly_by_flex(shape, data):
    documents = moda_flex.document(data.draw(_split_ids(shape.batch, shape.kv_len)))
    variant = data.draw(
        st.sampled_from([documents, moda_flex.causal() & documents, documents & moda_flex.depth_window(1)])
    )
    assert_matches_reference(make_inputs(shape), backend="flex", variant=variant)


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


def test_first_order_guard_keeps_fixed_tensors_fixed():
    """A score tensor that needs no gradient comes out of the guard needing none, beside ones that do."""
    from moda_flex.backends.flex.function import _FirstOrderOnly

    rows, fixed = torch.rand(2, requires_grad=True), torch.rand(3)
    out_rows, out_fixed = _FirstOrderOnly.apply(rows, fixed)
    assert out_rows.requires_grad and not out_fixed.requires_grad
    torch.testing.assert_close(out_fixed, fixed)


@pytest.mark.parametrize("kind", BUILTIN_KINDS)
def test_a_call_under_inference_mode_leaves_training_calls_working(kind):
    """What a call caches under inference_mode (masks, lengths) must not be inference tensors."""
    from moda_flex.backends.flex import block_mask

    shape = MoDAShape(1, 2, 1, 9, 9, 2, 8)
    variant = BUILTINS[kind].example(shape.kv_len, shape.slots)
    inputs = make_inputs(shape)
    block_mask._BLOCK_MASK_CACHE.clear()  # so that the first build happens under inference_mode
    with torch.inference_mode():
        moda_flex.moda_attention(**inputs, variant=variant, backend="flex")
    assert_matches_reference(inputs, backend="flex", variant=variant)


WRONG_SHAPES = {
    "mean over keys": lambda s, b, h, q_pos, pos, slot, is_depth: s.mean(-1, keepdim=True),
    "first column": lambda s, b, h, q_pos, pos, slot, is_depth: s[..., :1],
    "max over the batch": lambda s, b, h, q_pos, pos, slot, is_depth: s.amax(0, keepdim=True),
    "flattened": lambda s, b, h, q_pos, pos, slot, is_depth: s.flatten(),
}


@pytest.mark.parametrize("name", WRONG_SHAPES)
def test_a_score_of_the_wrong_shape_is_refused_as_on_the_reference(name):
    """Inside FlexAttention each logit is a scalar, where these would run; flex refuses them up front."""
    inputs = make_inputs(MoDAShape(2, 2, 1, 5, 5, 2, 8))
    score = moda_flex.Score(name, WRONG_SHAPES[name])
    for backend in ("reference", "flex"):
        with pytest.raises(ValueError, match=rf"score '{name}' must return a tensor of the logit's shape"):
            moda_flex.moda_attention(**inputs, score=score, backend=backend)
