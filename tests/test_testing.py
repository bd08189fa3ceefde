"""The testing helpers: shapes, inputs, variant strategy and the reference assertion."""

import math
import re

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis.errors import NoSuchExample
from hypothesis import strategies as st

from moda_flex import variants as v
from moda_flex.backends.reference import reference_attention
from moda_flex.testing import (
    BUILTIN_KINDS,
    MoDAShape,
    assert_matches_reference,
    document_ids,
    make_inputs,
    moda_shapes,
    relative_error,
    tolerance,
    variants,
)

from budget import examples

SMALL = MoDAShape(batch=2, q_heads=4, kv_heads=2, q_len=5, kv_len=9, slots=3, head_dim=8)


# --- MoDAShape and moda_shapes -------------------------------------------------


def test_shape_id_and_groups():
    shape = MoDAShape(batch=1, q_heads=8, kv_heads=2, q_len=5, kv_len=63, slots=4, head_dim=16)
    assert str(shape) == "B1-Hq8-Hk2-Tq5-Tk63-L4-D16"
    assert shape.groups == 4


@pytest.mark.parametrize(
    "fields, argument",
    [
        (dict(q_heads=6, kv_heads=4), "q_heads"),
        (dict(q_len=10, kv_len=9), "q_len"),
        (dict(slots=-1), "slots"),
        (dict(batch=0), "batch"),
        (dict(head_dim=8.0), "head_dim"),
    ],
)
def test_shape_rejects_bad_fields(fields, argument):
    base = dict(batch=1, q_heads=4, kv_heads=2, q_len=3, kv_len=9, slots=2, head_dim=8)
    with pytest.raises(ValueError, match=argument):
        MoDAShape(**{**base, **fields})


@settings(max_examples=examples(100))
@given(shape=moda_shapes())
def test_drawn_shapes_are_valid(shape):
    assert 1 <= shape.batch <= 2
    assert 1 <= shape.kv_heads <= 3 and 1 <= shape.groups <= 8
    assert shape.q_heads == shape.kv_heads * shape.groups
    assert 1 <= shape.q_len <= shape.kv_len <= 70
    assert 0 <= shape.slots <= 9
    assert shape.head_dim in (8, 16, 24, 32, 64)


REGIMES = {
    "decode": lambda s: s.q_len == 1 and s.kv_len > 1,
    "prefill": lambda s: s.q_len == s.kv_len > 1,
    "chunked prefill": lambda s: 1 < s.q_len < s.kv_len,
    "odd lengths": lambda s: s.q_len % 2 == 1 and s.kv_len % 2 == 1 and s.q_len > 1,
    "no depth": lambda s: s.slots == 0,
    "most slots": lambda s: s.slots == 9,
    "grouped heads": lambda s: s.groups > 1 and s.kv_heads > 1,
    "longest": lambda s: s.kv_len == 70,
}


@pytest.mark.parametrize("description", REGIMES)
def test_shapes_reach_every_regime(description):
    condition = REGIMES[description]
    assert condition(find(moda_shapes(), condition, settings=settings(database=None, max_examples=2000)))


@pytest.mark.parametrize(
    "argument, value",
    [("max_batch", 0), ("max_groups", -1), ("max_kv_len", 0), ("max_slots", -1), ("head_dims", ())],
)
def test_shapes_reject_bad_bounds(argument, value):
    with pytest.raises(ValueError, match=argument):
        moda_shapes(**{argument: value})


# --- make_inputs ----------------------------------------------------------------


@pytest.mark.parametrize("strided_depth", [False, True])
def test_inputs_have_contract_shapes_and_are_leaves(strided_depth):
    inputs = make_inputs(SMALL, strided_depth=strided_depth)
    B, Hq, Hk, Tq, Tk, L, D = 2, 4, 2, 5, 9, 3, 8
    assert inputs["q"].shape == (B, Hq, Tq, D)
    assert inputs["k"].shape == inputs["v"].shape == (B, Hk, Tk, D)
    assert inputs["depth_k"].shape == inputs["depth_v"].shape == (B, Hk, Tq, L, D)
    for name, t in inputs.items():
        assert t.is_leaf and t.requires_grad, name
        assert t.dtype == torch.float32
        assert bool((t != 0).all()), name


def test_strided_depth_is_a_view_with_buffer_strides():
    inputs = make_inputs(SMALL, strided_depth=True)
    L, D = SMALL.slots, SMALL.head_dim
    for name in ("depth_k", "depth_v"):
        t = inputs[name]
        assert not t.is_contiguous(), name
        assert t.stride()[2:] == ((L + 2) * D, D, 1), name
        # The view starts one slot into its buffer.
        assert t.storage_offset() == D, name
    contiguous = make_inputs(SMALL)
    assert contiguous["depth_k"].is_contiguous()


def test_inputs_are_seeded():
    a, b, c = make_inputs(SMALL, seed=3), make_inputs(SMALL, seed=3), make_inputs(SMALL, seed=4)
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert not torch.equal(a[name], c[name]), name


def test_inputs_follow_dtype_and_grad_flag():
    inputs = make_inputs(SMALL, dtype=torch.bfloat16, requires_grad=False, strided_depth=True)
    reference = make_inputs(SMALL, strided_depth=True)
    for name, t in inputs.items():
        assert t.dtype == torch.bfloat16 and not t.requires_grad, name
        assert torch.equal(t, reference[name].detach().to(torch.bfloat16)), name


def test_inputs_reject_bad_arguments():
    with pytest.raises(ValueError, match="shape"):
        make_inputs((1, 2, 3))
    with pytest.raises(ValueError, match="dtype"):
        make_inputs(SMALL, dtype=torch.int32)


# --- tolerance and relative_error -----------------------------------------------


def test_tolerances_grow_as_precision_drops():
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    values = [tolerance(dtype) for dtype in order]
    assert values == sorted(values)
    assert values[0] <= 1e-6 and values[-1] <= 5e-2
    with pytest.raises(ValueError, match="dtype"):
        tolerance(torch.int64)


def test_float32_on_a_gpu_gets_the_tf32_tolerance():
    assert tolerance(torch.float32, "cuda") == tolerance(torch.float16) > tolerance(torch.float32, "cpu")
    assert tolerance(torch.float32) == tolerance(torch.float32, torch.device("cpu"))
    assert tolerance(torch.bfloat16, "cuda") == tolerance(torch.bfloat16)


def test_relative_error_is_rms_ratio():
    expected = torch.tensor([3.0, 4.0])
    assert relative_error(expected + torch.tensor([0.3, 0.4]), expected) == pytest.approx(0.1)
    assert relative_error(torch.tensor([0.5]), torch.tensor([0.0])) == pytest.approx(0.5)
    assert relative_error(torch.empty(0), torch.empty(0)) == 0.0
    assert math.isnan(relative_error(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0])))


# --- assert_matches_reference ---------------------------------------------------


@pytest.mark.parametrize("strided_depth", [False, True])
def test_reference_matches_itself(strided_depth):
    inputs = make_inputs(SMALL, strided_depth=strided_depth)
    assert_matches_reference(inputs, backend="reference")
    assert_matches_reference(inputs, backend=reference_attention, variant=v.chunk_depth(2))
    # The caller's tensors are left as they were.
    assert all(t.grad is None for t in inputs.values())


def test_missing_depth_means_no_slots():
    inputs = make_inputs(SMALL)
    inputs["depth_k"] = inputs["depth_v"] = None
    assert_matches_reference(inputs, backend="reference")


def _drops_depth(q, k, v, depth_k, depth_v, variant, scale):
    return reference_attention(q, k, v, depth_k[:, :, :, :0], depth_v[:, :, :, :0], variant, scale)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times ``factor`` backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _perturbs_depth_v_grad(q, k, v, depth_k, depth_v, variant, scale):
    return reference_attention(q, k, v, depth_k, _ScaleGrad.apply(depth_v, 1.01), variant, scale)


def _shifts_lse(q, k, v, depth_k, depth_v, variant, scale):
    out, lse = reference_attention(q, k, v, depth_k, depth_v, variant, scale)
    return out, lse + 1e-2


def _wrong_head_mapping(q, k, v, depth_k, depth_v, variant, scale):
    # Query head h reading KV head h % Hk instead of h // G.
    Hk = k.shape[1]
    G = q.shape[1] // Hk
    order = torch.arange(q.shape[1]).view(Hk, G).t().reshape(-1)
    out, lse = reference_attention(q[:, order], k, v, depth_k, depth_v, variant, scale)
    inverse = torch.argsort(order)
    return out[:, inverse], lse[:, inverse]


def _nan_for_empty_rows(q, k, v, depth_k, depth_v, variant, scale):
    out, lse = reference_attention(q, k, v, depth_k, depth_v, variant, scale)
    empty = torch.isinf(lse).unsqueeze(-1)
    return torch.where(empty, torch.full_like(out, float("nan")), out), lse


def _no_lse(q, k, v, depth_k, depth_v, variant, scale):
    return reference_attention(q, k, v, depth_k, depth_v, variant, scale)[0]


@pytest.mark.parametrize(
    "backend, variant, message",
    [
        (_drops_depth, "causal", r"^out: relative RMS error"),
        (_perturbs_depth_v_grad, "causal", r"^grad of depth_v: relative RMS error"),
        (_shifts_lse, "causal", r"^lse: relative RMS error"),
        (_wrong_head_mapping, "causal", r"^out: relative RMS error"),
        (_no_lse, "causal", r"must return \(out, lse\)"),
    ],
)
def test_wrong_backends_fail_naming_the_tensor(backend, variant, message):
    inputs = make_inputs(SMALL)
    with pytest.raises(AssertionError, match=message) as failure:
        assert_matches_reference(inputs, backend=backend, variant=variant)
    if "relative RMS" in message:
        assert str(SMALL) in str(failure.value)
        assert "tolerance 1.0e-04" in str(failure.value)


def test_perturbed_gradient_passes_without_grad_check():
    assert_matches_reference(make_inputs(SMALL), backend=_perturbs_depth_v_grad, check_grads=False)


def test_loose_rtol_accepts_small_errors():
    assert_matches_reference(make_inputs(SMALL), backend=_perturbs_depth_v_grad, rtol=0.05)


def test_empty_rows_must_be_zero_and_minus_inf():
    # depth_only with L = 0: every row sees nothing.
    shape = MoDAShape(batch=1, q_heads=2, kv_heads=1, q_len=3, kv_len=4, slots=0, head_dim=8)
    inputs = make_inputs(shape)
    assert_matches_reference(inputs, backend="reference", variant=v.depth_only())

    with pytest.raises(AssertionError, match=r"^out: 48 NaN values of 48"):
        assert_matches_reference(inputs, backend=_nan_for_empty_rows, variant=v.depth_only())

    def nonzero_rows(q, k, v_, depth_k, depth_v, variant, scale):
        out, lse = reference_attention(q, k, v_, depth_k, depth_v, variant, scale)
        return out + 1e-3, lse

    with pytest.raises(AssertionError, match="rows that see no key must be exactly zero"):
        assert_matches_reference(inputs, backend=nonzero_rows, variant=v.depth_only())

    def finite_lse(q, k, v_, depth_k, depth_v, variant, scale):
        out, lse = reference_attention(q, k, v_, depth_k, depth_v, variant, scale)
        return out, torch.zeros_like(lse)

    with pytest.raises(AssertionError, match=r"lse: -inf .* first disagreement at \(b, h, t\) = \(0, 0, 0\)"):
        assert_matches_reference(inputs, backend=finite_lse, variant=v.depth_only())


def test_wrong_output_dtype_fails():
    def float64_out(q, k, v_, depth_k, depth_v, variant, scale):
        out, lse = reference_attention(q, k, v_, depth_k, depth_v, variant, scale)
        return out.double(), lse

    with pytest.raises(AssertionError, match="out: dtype torch.float64, expected torch.float32"):
        assert_matches_reference(make_inputs(SMALL), backend=float64_out)


def test_assertion_rejects_bad_arguments():
    inputs = make_inputs(SMALL)
    with pytest.raises(ValueError, match="missing"):
        assert_matches_reference({"q": inputs["q"]}, backend="reference")
    with pytest.raises(ValueError, match="backend"):
        assert_matches_reference(inputs, backend="fastest")
    with pytest.raises(ValueError, match="variant"):
        assert_matches_reference(inputs, backend="reference", variant="diagonal")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_reference_matches_itself_in_other_dtypes(dtype):
    assert_matches_reference(make_inputs(SMALL, dtype=dtype, strided_depth=True), backend="reference")


# --- variants strategy ------------------------------------------------------------


def _is_contiguous_runs(ids: torch.Tensor) -> bool:
    changes = (ids[:, 1:] != ids[:, :-1]).sum(dim=1) + 1
    distinct = torch.tensor([row.unique().numel() for row in ids])
    return bool((changes == distinct).all())


@settings(max_examples=examples(50))
@given(shape=moda_shapes(max_kv_len=30, max_slots=5), data=st.data())
def test_drawn_variants_fit_the_shape(shape, data):
    variant = data.draw(variants(shape))
    Tq, Tk, L, B = shape.q_len, shape.kv_len, shape.slots, shape.batch
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q_pos = (Tk - Tq + torch.arange(Tq)).view(1, 1, Tq, 1)
    seq = variant.sequence(b, h, q_pos, torch.arange(Tk).view(1, 1, 1, Tk))
    assert seq.dtype == torch.bool and seq.expand(B, 1, Tq, Tk).shape == (B, 1, Tq, Tk)
    depth = variant.depth_predicate(L)(b.unsqueeze(-1), h.unsqueeze(-1), q_pos.unsqueeze(-1),
                                       q_pos.unsqueeze(-1), torch.arange(L).view(1, 1, 1, 1, L))
    assert depth.dtype == torch.bool
    for term in variant.name.replace("(", " ").replace(")", " ").split():
        assert term in BUILTIN_KINDS or term == "&" or term.isdigit(), variant.name
    for family, low, high in (("sliding_window", 1, Tk), ("depth_window", 1, max(L, 1)), ("chunk_depth", 1, Tk)):
        for size in re.findall(family + r"\((\d+)\)", variant.name):
            assert low <= int(size) <= high, variant.name


@settings(max_examples=examples(50))
@given(batch=st.integers(1, 3), kv_len=st.integers(1, 40), data=st.data())
def test_document_ids_are_contiguous_runs(batch, kv_len, data):
    ids = data.draw(document_ids(batch, kv_len))
    assert ids.shape == (batch, kv_len) and ids.dtype == torch.long
    assert _is_contiguous_runs(ids)
    assert int(ids[:, 0].max()) == 0


FAMILIES_AND_EDGES = {
    "whole window": lambda s, var: var.name == f"sliding_window({s.kv_len})",
    "one-token window": lambda s, var: var.name == "sliding_window(1)",
    "whole depth window": lambda s, var: var.name == f"depth_window({s.slots})" and s.slots > 1,
    "composition": lambda s, var: "&" in var.name and "document" not in var.name,
    "causal documents": lambda s, var: var.name == "(causal & document)",
    "several documents": lambda s, var: var.name == "document" and int(var.structure.doc_ids.max()) >= 2,
    "chunk of one": lambda s, var: var.name == "chunk_depth(1)",
}


@pytest.mark.parametrize("description", FAMILIES_AND_EDGES)
def test_variants_reach_every_family_and_edge(description):
    condition = FAMILIES_AND_EDGES[description]
    pairs = moda_shapes(max_kv_len=12, max_slots=4).flatmap(lambda s: st.tuples(st.just(s), variants(s)))
    shape, variant = find(pairs, lambda pair: condition(*pair), settings=settings(database=None, max_examples=5000))
    assert condition(shape, variant)


def test_variants_respect_kinds():
    shape = MoDAShape(batch=1, q_heads=1, kv_heads=1, q_len=4, kv_len=6, slots=2, head_dim=8)
    strategy = variants(shape, kinds=("sliding_window", "depth_only"), max_terms=1)
    with pytest.raises(NoSuchExample):
        find(strategy, lambda var: var.name.split("(")[0] not in ("sliding_window", "depth_only"),
             settings=settings(database=None, max_examples=200))
    with pytest.raises(ValueError, match="kinds"):
        variants(shape, kinds=("causal", "diagonal"))
    with pytest.raises(ValueError, match="max_terms"):
        variants(shape, max_terms=0)
    with pytest.raises(ValueError, match="shape"):
        variants((1, 2))
