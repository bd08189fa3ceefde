"""NaN and Inf reach exactly the rows that may see them, on every backend.

The rule (moda_flex.nonfinite): a row whose query, or one of whose visible
keys, values or depth slots, holds a NaN or Inf returns NaN (output and lse)
and sends no gradient; every other row is computed exactly as if that entry
were zero, bit for bit, in its output, its lse and the gradients it sends.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moda_flex import depth_bias, moda_attention, softcap
from moda_flex import variants as v
from moda_flex.nonfinite import rows_seeing, rows_seeing_dense, zero_nonfinite
from moda_flex.backends.reference import visible_entries
from moda_flex.testing import MoDAShape, make_inputs, moda_shapes, score_functions, variants

from budget import examples
from fused import FUSED_KINDS, TRITON_DEVICE

NAMES = ("q", "k", "v", "depth_k", "depth_v")


def _rows_that_see(name, index, shape, variant):
    """(B, Hq, Tq) bool: the rows that may see entry ``index`` (without D) of input ``name``."""
    B, Hq, Tq, G = shape.batch, shape.q_heads, shape.q_len, shape.groups
    seen = torch.zeros(B, Hq, Tq, dtype=torch.bool)
    if name == "q":
        seen[index] = True
        return seen
    seq_visible, depth_visible = visible_entries(variant, B, Hq, Tq, shape.kv_len, shape.slots, "cpu")
    b, kv_head = index[0], index[1]
    heads = slice(kv_head * G, (kv_head + 1) * G)
    if name in ("k", "v"):
        seen[b, heads] = seq_visible[b, heads, :, index[2]]
    else:
        t, slot = index[2], index[3]
        if variant.own_depth_only:
            seen[b, heads, t] = depth_visible[b, heads, t, slot]
        else:
            seen[b, heads] = depth_visible[b, heads, :, t * shape.slots + slot]
    return seen


def _run(inputs, backend, variant, grad_out):
    """out, lse and the gradients of ``sum(out * grad_out)``: the five inputs' and the score's tensors'."""
    leaves = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}
    params = [] if variant.score is None else [p.detach().clone().requires_grad_() for p in variant.score.params]
    if params:
        variant = variant.with_score(variant.score.with_params(params))
    out, lse = moda_attention(**leaves, variant=variant, backend=backend, return_lse=True)
    out.backward(grad_out)
    grads = {name: leaves[name].grad for name in NAMES}
    grads.update({f"score.params[{i}]": p.grad for i, p in enumerate(params)})
    return out.detach(), lse.detach(), grads


def _assert_reaches_only_its_rows(backend, shape, variant, name, index, value, device="cpu", dtype=torch.float32,
                                  dead_gradient=0.0):  # fmt: skip
    """``dead_gradient``: the gradient the rows that see the entry are given (compared with zero's)."""
    inputs = make_inputs(shape, requires_grad=False, seed=1, device=device, dtype=dtype)
    clean = {n: t.clone() for n, t in inputs.items()}
    clean[name][index + (0,)] = 0.0
    poisoned = {n: t.clone() for n, t in inputs.items()}
    poisoned[name][index + (0,)] = value  # one component of one vector

    seen = _rows_that_see(name, index, shape, variant).to(device)  # (B, Hq, Tq)
    grad_out = torch.randn(shape.batch, shape.q_heads, shape.q_len, shape.head_dim, device=device, dtype=dtype)
    grad_out[seen] = 0.0  # a NaN row sends no gradient: compare what the others send
    out, lse, grads = _run(poisoned, backend, variant, grad_out.masked_fill(seen[..., None], dead_gradient))
    ref_out, ref_lse, ref_grads = _run(clean, backend, variant, grad_out)

    where = f"{backend}, {variant.name}, {value} at {name}{list(index)}, {shape}"
    assert torch.isnan(out[seen]).all() and torch.isnan(lse[seen]).all(), f"a row that sees it is not NaN ({where})"
    assert torch.equal(out[~seen], ref_out[~seen]), f"out of a row that cannot see it changed ({where})"
    assert torch.equal(lse[~seen], ref_lse[~seen]), f"lse of a row that cannot see it changed ({where})"
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), f"grad of {n} changed ({where})"


def _entries(shape: MoDAShape):
    """A strategy of (input name, index without D) over the inputs that have entries."""
    sizes = {
        "q": (shape.batch, shape.q_heads, shape.q_len),
        "k": (shape.batch, shape.kv_heads, shape.kv_len),
        "v": (shape.batch, shape.kv_heads, shape.kv_len),
        "depth_k": (shape.batch, shape.kv_heads, shape.q_len, shape.slots),
        "depth_v": (shape.batch, shape.kv_heads, shape.q_len, shape.slots),
    }
    names = [name for name, size in sizes.items() if all(size)]
    return st.sampled_from(names).flatmap(
        lambda name: st.tuples(st.just(name), st.tuples(*(st.integers(0, n - 1) for n in sizes[name])))
    )


SHAPES = moda_shapes(max_batch=2, max_groups=3, max_kv_heads=2, max_kv_len=24, max_slots=4, head_dims=(8,))
VALUES = st.sampled_from([float("nan"), float("inf"), float("-inf")])
# The variant families the Triton kernels fuse.
# The Triton interpreter computes through numpy, which warns on every NaN the kernels mean to make.
NUMPY_NAN_WARNINGS = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.mark.parametrize("backend", ["reference", "flex"])
@settings(max_examples=examples(25))
@given(shape=SHAPES, data=st.data(), value=VALUES)
def test_a_non_finite_entry_reaches_only_the_rows_that_see_it(backend, shape, data, value):
    variant = data.draw(variants(shape, max_terms=2))
    name, index = data.draw(_entries(shape))
    _assert_reaches_only_its_rows(backend, shape, variant, name, index, value)


@NUMPY_NAN_WARNINGS
@settings(max_examples=examples(10))
@given(shape=SHAPES, data=st.data(), value=VALUES)
def test_a_non_finite_entry_reaches_only_the_rows_that_see_it_on_triton(shape, data, value):
    """The rule inside the kernels, over the variants and scores they fuse (few examples: the interpreter is slow)."""
    pytest.importorskip("triton")
    variant = data.draw(variants(shape, kinds=FUSED_KINDS, max_terms=2, structured=True))
    scores = score_functions(shape, kinds=("softcap", "depth_bias"), max_terms=1, device=TRITON_DEVICE)
    score = data.draw(st.none() | scores)
    variant = variant if score is None else variant & score
    name, index = data.draw(_entries(shape))
    _assert_reaches_only_its_rows("triton", shape, variant, name, index, value, device=TRITON_DEVICE)


SHAPE = MoDAShape(batch=1, q_heads=4, kv_heads=2, q_len=7, kv_len=9, slots=3, head_dim=16)
# Entries most rows may not see: the cases of the issue that reported the leak.
MASKED = {
    "future v under causal": (v.causal(), "v", (0, 1, 8)),
    "v outside a sliding window": (v.sliding_window(2), "v", (0, 0, 3)),
    "k in another document": (v.causal() & v.document(torch.tensor([0] * 5 + [1] * 4)), "k", (0, 1, 2)),
    "another token's depth_v": (v.causal(), "depth_v", (0, 0, 2, 1)),
    "a slot outside the depth window": (v.depth_window(1), "depth_k", (0, 1, 4, 0)),
}


@pytest.mark.parametrize("backend", ["reference", "flex"])
@pytest.mark.parametrize("case", sorted(MASKED))
def test_named_masked_entries(backend, case):
    variant, name, index = MASKED[case]
    _assert_reaches_only_its_rows(backend, SHAPE, variant, name, index, float("nan"))


def test_a_visible_nan_is_not_hidden():
    """NaN in token 0's value under full(): every row of that KV head sees it and says so."""
    inputs = make_inputs(SHAPE, requires_grad=False)
    inputs["v"][0, 0, 0, 3] = float("nan")
    for backend in ("reference", "flex"):
        out = moda_attention(**inputs, variant="full", backend=backend)
        assert torch.isnan(out[:, :2]).all(-1).all() and not torch.isnan(out[:, 2:]).any(), backend


@NUMPY_NAN_WARNINGS
@pytest.mark.parametrize("case", sorted(MASKED) + ["visible"])
def test_triton_named_entries(case):
    pytest.importorskip("triton")
    variant, name, index = MASKED[case] if case in MASKED else (v.full(), "v", (0, 0, 3))
    _assert_reaches_only_its_rows("triton", SHAPE, variant, name, index, float("nan"), device=TRITON_DEVICE)


# Entries that kill some rows, at a square shape (the split path's causal mask needs Tq == Tk).
SQUARE = MoDAShape(batch=1, q_heads=4, kv_heads=2, q_len=7, kv_len=7, slots=3, head_dim=16)
KILLING = {
    "k under causal": (v.causal(), "k", (0, 1, 5)),
    "a token's depth_v": (v.causal(), "depth_v", (0, 0, 2, 1)),
    "v under full": (v.full(), "v", (0, 0, 3)),
}


@NUMPY_NAN_WARNINGS
@pytest.mark.parametrize("backend", ["reference", "flex", "triton", "split"])
@pytest.mark.parametrize("case", sorted(KILLING))
def test_a_dead_row_given_a_nan_gradient_sends_none(backend, case):
    """Downstream of a NaN output its gradient is NaN too: the row still sends nothing (the kernels silence it
    before any product that would spread it)."""
    variant, name, index = KILLING[case]
    kernel = backend in ("triton", "split")
    if kernel:
        pytest.importorskip("triton")
    device = TRITON_DEVICE if kernel else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    _assert_reaches_only_its_rows(backend, SQUARE, variant, name, index, float("nan"), device=device, dtype=dtype,
                                  dead_gradient=float("nan"))  # fmt: skip


# Visible entries: in a block the kernels mask (Tk < BLOCK_N), and in one they read unmasked (Tk > BLOCK_N = 16 on CPU).
VISIBLE = {"visible": SHAPE, "visible in an unmasked block": MoDAShape(1, 4, 2, 7, 20, 3, 16)}


@NUMPY_NAN_WARNINGS
@pytest.mark.parametrize("backend", ["reference", "flex", "triton"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("case", sorted(MASKED) + sorted(VISIBLE))
def test_the_rule_holds_with_a_score(backend, value, case):
    """Soft-capping maps an Inf logit to a finite one, and a learned bias gets gradients: neither may hide the rule."""
    if backend == "triton":
        pytest.importorskip("triton")
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    shape = VISIBLE.get(case, SHAPE)
    variant, name, index = MASKED[case] if case in MASKED else (v.full(), "k", (0, 0, 3))
    bias = torch.linspace(-1.0, 1.0, shape.q_heads * shape.slots, device=device).view(shape.q_heads, shape.slots)
    variant = variant & depth_bias(bias.requires_grad_()) & softcap(2.0)
    _assert_reaches_only_its_rows(backend, shape, variant, name, index, value, device=device)


@settings(max_examples=examples(30))
@given(
    shape=moda_shapes(max_batch=2, max_groups=3, max_kv_heads=2, max_kv_len=30, max_slots=4),
    density=st.sampled_from([0.05, 0.2]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_rows_seeing_from_spans_equals_dense(shape, density, seed, data):
    """The span count (flex, triton) marks the rows that the predicates say see a non-finite entry."""
    variant = data.draw(variants(shape, max_terms=2, structured=True))
    B, Hq, Hk, Tq, Tk, L = shape.batch, shape.q_heads, shape.kv_heads, shape.q_len, shape.kv_len, shape.slots
    generator = torch.Generator().manual_seed(seed)
    q_bad = torch.rand(B, Hq, Tq, generator=generator) < density / 4
    key_bad = torch.rand(B, Hk, Tk, generator=generator) < density
    slot_bad = torch.rand(B, Hk, Tq, L, generator=generator) < density
    seq_visible, depth_visible = visible_entries(variant, B, Hq, Tq, Tk, L, "cpu")
    expected = rows_seeing_dense(seq_visible, depth_visible, q_bad, key_bad, slot_bad, variant.own_depth_only)
    assert torch.equal(rows_seeing(variant.structure, q_bad, key_bad, slot_bad), expected)


def test_zero_nonfinite_is_exact_and_passes_the_gradient():
    x = torch.tensor([[1.5, float("nan")], [float("inf"), -2.0], [0.25, 3.0]], requires_grad=True)
    clean, bad = zero_nonfinite(x)
    assert clean.tolist() == [[1.5, 0.0], [0.0, -2.0], [0.25, 3.0]]
    assert bad.tolist() == [True, True, False] and not bad.requires_grad
    clean.backward(torch.full_like(clean, 2.0))
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
