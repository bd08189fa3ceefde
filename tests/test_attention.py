"""The contract of moda_attention: properties that need no second implementation, and input checks."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import moda_flex
from moda_flex import moda_attention
from moda_flex.testing import MoDAShape, make_inputs, moda_shapes

from budget import examples

BACKENDS = ["reference", "flex"]


def _bottom_right_causal(q_len, kv_len):
    """(Tq, Tk) bool: query i sees keys j <= Tk - Tq + i."""
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(15))
@given(shape=moda_shapes(max_slots=0), causal=st.booleans())
def test_no_depth_equals_sdpa(backend, shape, causal):
    inputs = make_inputs(shape, dtype=torch.float64, requires_grad=False)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    mask = _bottom_right_causal(shape.q_len, shape.kv_len) if causal else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = moda_attention(q, k, v, variant="causal" if causal else "full", backend=backend)
    torch.testing.assert_close(out, expected)
    # depth=None and an empty depth axis are the same call
    torch.testing.assert_close(moda_attention(q, k, v, inputs["depth_k"], inputs["depth_v"], backend=backend), 
                               moda_attention(q, k, v, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(10))
@given(shape=moda_shapes(max_kv_len=30), data=st.data())
def test_permuting_depth_slots_permutes_only_depth_gradients(backend, shape, data):
    inputs = make_inputs(shape, dtype=torch.float64)
    perm = torch.tensor(data.draw(st.permutations(range(shape.slots))), dtype=torch.long)
    permuted = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}
    permuted["depth_k"] = inputs["depth_k"].detach()[:, :, :, perm].clone().requires_grad_()
    permuted["depth_v"] = inputs["depth_v"].detach()[:, :, :, perm].clone().requires_grad_()

    grad_out = torch.randn(inputs["q"].shape, dtype=torch.float64)
    out = moda_attention(**inputs, backend=backend)
    out_p = moda_attention(**permuted, backend=backend)
    torch.testing.assert_close(out_p, out)
    out.backward(grad_out)
    out_p.backward(grad_out)
    for name in ("q", "k", "v"):
        torch.testing.assert_close(permuted[name].grad, inputs[name].grad)
    for name in ("depth_k", "depth_v"):
        torch.testing.assert_close(permuted[name].grad, inputs[name].grad[:, :, :, perm])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(10))
@given(shape=moda_shapes(max_kv_len=40), data=st.data())
def test_prefill_then_decode_equals_full_call(backend, shape, data):
    """Chunked prefill and one-token decode are the same call, bottom-right aligned."""
    shape = MoDAShape(shape.batch, shape.q_heads, shape.kv_heads, shape.kv_len, shape.kv_len, shape.slots, shape.head_dim)
    inputs = make_inputs(shape, dtype=torch.float64, requires_grad=False)
    q, k, v, dk, dv = (inputs[n] for n in ("q", "k", "v", "depth_k", "depth_v"))
    full = moda_attention(q, k, v, dk, dv, backend=backend)
    T = shape.kv_len
    split = data.draw(st.integers(0, T - 1))
    prefix = moda_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], dk[:, :, :split], dv[:, :, :split], backend=backend)
    rest = moda_attention(q[:, :, split:], k, v, dk[:, :, split:], dv[:, :, split:], backend=backend)
    torch.testing.assert_close(torch.cat([prefix, rest], dim=2), full)
    last = moda_attention(q[:, :, -1:], k, v, dk[:, :, -1:], dv[:, :, -1:], backend=backend)
    torch.testing.assert_close(last, full[:, :, -1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_nothing_are_zero_without_nan(backend):
    """Depth-only attention with no depth slots: every row sees nothing."""
    inputs = make_inputs(MoDAShape(2, 4, 2, 5, 9, 0, 8), dtype=torch.float32)
    out, lse = moda_attention(**inputs, variant=moda_flex.depth_only(), backend=backend, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    out.sum().backward()
    for name in ("q", "k", "v"):
        assert torch.equal(inputs[name].grad, torch.zeros_like(inputs[name].grad)), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_some_rows_empty_others_not(backend):
    """Sequence keys hidden from even tokens: with L=0 those rows are zero, the others are attention."""
    def sequence(b, h, q_pos, k_pos):
        return (k_pos <= q_pos) & (q_pos % 2 == 1)

    variant = moda_flex.Variant("odd_rows_only", sequence)
    inputs = make_inputs(MoDAShape(1, 2, 1, 6, 6, 0, 8), requires_grad=False)
    out, lse = moda_attention(**inputs, variant=variant, backend=backend, return_lse=True)
    assert torch.equal(out[:, :, 0::2], torch.zeros_like(out[:, :, 0::2]))
    assert torch.isneginf(lse[:, :, 0::2]).all() and torch.isfinite(lse[:, :, 1::2]).all()
    expected = moda_attention(**inputs, backend="reference")
    torch.testing.assert_close(out[:, :, 1::2], expected[:, :, 1::2])


def test_default_scale_and_lse():
    inputs = make_inputs(MoDAShape(1, 2, 1, 3, 4, 2, 16), dtype=torch.float64, requires_grad=False)
    out, lse = moda_attention(**inputs, return_lse=True)
    explicit = moda_attention(**inputs, scale=1 / math.sqrt(16))
    torch.testing.assert_close(out, explicit)
    assert lse.shape == (1, 2, 3) and lse.dtype == torch.float32
    # lse by hand for query 0 of head 0 (position 1: keys 0, 1 and its 2 depth slots)
    q, k, dk = inputs["q"][0, 0, 0], inputs["k"][0, 0, :2], inputs["depth_k"][0, 0, 0]
    logits = torch.cat([k @ q, dk @ q]) / 4
    torch.testing.assert_close(lse[0, 0, 0].double(), torch.logsumexp(logits, 0), rtol=1e-6, atol=1e-6)


def _good():
    return make_inputs(MoDAShape(2, 4, 2, 3, 5, 2, 8), requires_grad=False)


def _with(**changes):
    inputs = _good()
    inputs.update(changes)
    return inputs


BAD_INPUTS = {
    "q rank": (_with(q=torch.randn(4, 3, 8)), r"q must have shape \(B, H, T, D\), got \(4, 3, 8\)"),
    "heads": (_with(q=torch.randn(2, 3, 3, 8)), r"q heads \(3\) must be a multiple of k heads \(2\)"),
    "Tq > Tk": (
        _with(q=torch.randn(2, 4, 6, 8), depth_k=torch.randn(2, 2, 6, 2, 8), depth_v=torch.randn(2, 2, 6, 2, 8)),
        r"Tq=6 > Tk=5",
    ),
    "k vs v": (_with(v=torch.randn(2, 2, 4, 8)), r"k and v must have the same shape"),
    "head dim": (_with(k=torch.randn(2, 2, 5, 4), v=torch.randn(2, 2, 5, 4)), r"k must have shape \(B=2, Hk, Tk, D=8\)"),
    "depth tokens": (
        _with(depth_k=torch.randn(2, 2, 5, 2, 8), depth_v=torch.randn(2, 2, 5, 2, 8)),
        r"depth_k must have shape \(B=2, Hk=2, Tq=3, L, D=8\).*got \(2, 2, 5, 2, 8\)",
    ),
    "depth rank": (_with(depth_k=torch.randn(2, 2, 3, 8)), r"depth_k must have shape \(B=2, Hk=2, Tq=3, L, D=8\)"),
    "entry shape": (
        _with(depth_k=[torch.randn(2, 2, 3, 8), torch.randn(2, 2, 4, 8)], depth_v=[torch.randn(2, 2, 3, 8)] * 2),
        r"depth_k\[1\] must have shape \(B=2, Hk=2, Tq=3, D=8\)",
    ),
    "entry count": (
        _with(depth_k=[torch.randn(2, 2, 3, 8)], depth_v=[torch.randn(2, 2, 3, 8)] * 2),
        r"depth_k and depth_v must hold as many entries, got 1 and 2",
    ),
    "mixed forms": (
        _with(depth_k=[torch.randn(2, 2, 3, 8)], depth_v=torch.randn(2, 2, 3, 1, 8)),
        r"depth_k and depth_v must take the same form",
    ),
    "entry dtype": (
        _with(depth_k=[torch.randn(2, 2, 3, 8, dtype=torch.float64)], depth_v=[torch.randn(2, 2, 3, 8)]),
        r"depth_k\[0\] has dtype torch.float64 but q has torch.float32",
    ),
    "depth L": (_with(depth_v=torch.randn(2, 2, 3, 1, 8)), r"depth_k and depth_v must have the same shape"),
    "one depth": (_with(depth_v=None), r"depth_k and depth_v must both be given"),
    "dtype": (_with(k=torch.randn(2, 2, 5, 8, dtype=torch.float64)), r"k has dtype torch.float64 but q has torch.float32"),
    "integer q": (_with(q=torch.zeros(2, 4, 3, 8, dtype=torch.long)), r"q must be floating point"),
}

# A value of the wrong type: TypeError, as SDPA raises for one.
WRONG_TYPES = {
    "not a tensor": (_with(v=[[1.0]]), r"v must be a torch.Tensor, got list"),
    "an entry not a tensor": (_with(depth_k=[3.0], depth_v=[torch.randn(2, 2, 3, 8)]), r"depth_k\[0\] must be a torch.Tensor"),
    "depth a number": (
        _with(depth_k=3, depth_v=3),
        r"depth_k must be a \(B, Hk, Tq, L, D\) tensor, a sequence of L \(B, Hk, Tq, D\) tensors or None, got int",
    ),
    "depth_v a number": (_with(depth_v=3.0), r"depth_v must be a \(B, Hk, Tq, L, D\) tensor.*got float"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_the_problem(case):
    inputs, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        moda_attention(**inputs)


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_a_wrong_type_raises_type_error_naming_it(case):
    inputs, message = WRONG_TYPES[case]
    with pytest.raises(TypeError, match=message):
        moda_attention(**inputs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(backend="cuda"), r"backend must be one of"),
        (dict(variant="sliding"), r"variant must be one of 'causal', 'full', 'depth_only' or a moda_flex Variant"),
    ],
)
def test_bad_options_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        moda_attention(**_good(), **kwargs)


def _available_backends():
    """The backends that run here: triton only with its package and a device (or the interpreter)."""
    names = ["auto", "reference", "flex"]
    try:
        from moda_flex.backends.triton import unsupported_reason
    except ImportError:
        return names
    if unsupported_reason(torch.zeros(1, 1, 1, 16), moda_flex.causal()) is None:
        names.append("triton")
    return names


@pytest.mark.parametrize("backend", _available_backends())
@pytest.mark.parametrize(
    "shape",
    [(0, 2, 1, 3, 5, 2), (1, 0, 1, 3, 5, 2), (2, 4, 2, 0, 5, 2), (1, 2, 1, 0, 0, 0), (1, 2, 1, 0, 0, 3)],
    ids=["B0", "Hq0", "Tq0", "Tk0", "Tk0-L3"],
)
def test_empty_inputs_give_empty_results_with_a_backward(backend, shape):
    B, Hq, Hk, Tq, Tk, L = shape
    inputs = {
        "q": torch.randn(B, Hq, Tq, 16),
        "k": torch.randn(B, Hk, Tk, 16),
        "v": torch.randn(B, Hk, Tk, 16),
        "depth_k": torch.randn(B, Hk, Tq, L, 16),
        "depth_v": torch.randn(B, Hk, Tq, L, 16),
    }
    for t in inputs.values():
        t.requires_grad_()
    out, lse = moda_attention(**inputs, backend=backend, return_lse=True)
    assert out.shape == (B, Hq, Tq, 16) and lse.shape == (B, Hq, Tq) and lse.dtype == torch.float32
    out.sum().backward()
    for name, t in inputs.items():
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any(), name


@pytest.mark.parametrize("backend", _available_backends())
def test_zero_head_dim_is_refused(backend):
    inputs = make_inputs(MoDAShape(1, 2, 1, 3, 5, 2, 1), requires_grad=False)
    inputs = {name: t[..., :0] for name, t in inputs.items()}
    with pytest.raises(ValueError, match=r"head dim D >= 1, got q \(1, 2, 3, 0\)"):
        moda_attention(**inputs, backend=backend)


@pytest.mark.parametrize(
    "scale, error, message",
    [
        ([0.5], TypeError, r"scale must be a real number \(float or int\), got list \[0.5\]"),
        ("0.5", TypeError, r"scale must be a real number \(float or int\), got str '0.5'"),
        (True, TypeError, r"got bool True"),
        (torch.tensor(0.5), TypeError, r"scale must be a real number, got a tensor \(\) of torch.float32"),
        (torch.tensor(0.5, requires_grad=True), TypeError, r"multiply q by it"),
        (0.0, ValueError, r"scale must be a finite nonzero real number, got 0.0"),
        (float("nan"), ValueError, r"got nan"),
        (float("inf"), ValueError, r"got inf"),
    ],
)
def test_bad_scale_is_named(scale, error, message):
    with pytest.raises(error, match=message):
        moda_attention(**_good(), scale=scale)


def test_scale_accepts_real_numbers():
    import numpy as np

    inputs = _good()
    expected = moda_attention(**inputs, scale=0.5)
    for scale in (np.float32(0.5), np.float64(0.5), 0.5):
        torch.testing.assert_close(moda_attention(**inputs, scale=scale), expected)
    torch.testing.assert_close(moda_attention(**inputs, scale=2), moda_attention(**inputs, scale=2.0))


@pytest.mark.parametrize("backend", _available_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_returns_what_sdpa_returns(backend, dtype, autocast_dtype):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the triton kernel has no float64")
    inputs = make_inputs(MoDAShape(1, 2, 1, 3, 5, 2, 16), dtype=dtype, requires_grad=False)
    with torch.autocast("cpu", dtype=autocast_dtype):
        expected = F.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"], enable_gqa=True)
        out, lse = moda_attention(**inputs, backend=backend, return_lse=True)
    assert out.dtype == expected.dtype and lse.dtype == torch.float32
    exact = moda_attention(**{name: t.to(expected.dtype) for name, t in inputs.items()}, backend=backend)
    torch.testing.assert_close(out, exact)


@pytest.mark.parametrize(
    "q_shape, k_shape",
    [((1, 5, 8, 16), (1, 5, 2, 16)), ((1, 1, 8, 16), (1, 9, 2, 16)), ((2, 1, 4, 8), (2, 7, 4, 8))],
    ids=["prefill", "decode", "mha-decode"],
)
def test_transposed_layout_is_pointed_out(q_shape, k_shape):
    q, k = torch.randn(q_shape), torch.randn(k_shape)
    with pytest.raises(ValueError, match=r"look like \(B, T, H, D\).*transpose\(1, 2\)"):
        moda_attention(q, k, k)


def test_no_layout_hint_for_a_plain_length_mistake():
    q, k = torch.randn(1, 8, 5, 16), torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match=r"Tq=5 > Tk=3") as error:
        moda_attention(q, k, k)
    assert "look like" not in str(error.value)


@pytest.mark.parametrize("backend", _available_backends())
@pytest.mark.parametrize(
    "doc_ids, combine",
    [
        (torch.zeros(5, dtype=torch.long), lambda d: moda_flex.causal() & d),  # Tk = 7
        (torch.zeros(1, 9, dtype=torch.long), lambda d: d),
        (torch.zeros(3, 7, dtype=torch.long), lambda d: moda_flex.causal() & d),  # B = 2
        (torch.zeros(5, dtype=torch.long), lambda d: d | moda_flex.causal()),  # a union keeps no structure
    ],
    ids=["short", "long", "batch", "union"],
)
def test_doc_ids_must_fit_the_call_on_every_backend(backend, doc_ids, combine):
    inputs = make_inputs(MoDAShape(batch=2, q_heads=2, kv_heads=1, q_len=4, kv_len=7, slots=2, head_dim=16))
    with pytest.raises(ValueError, match=r"doc_ids must have shape \(B, Tk\) or \(1, Tk\) for inputs with B=2, Tk=7"):
        moda_attention(**inputs, variant=combine(moda_flex.document(doc_ids)), backend=backend)
