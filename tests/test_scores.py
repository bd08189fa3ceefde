"""Score functions: the built-ins by their definition, on reference, flex and triton, and bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import moda_flex
from moda_flex import Score, alibi, causal, depth_alibi, depth_bias, depth_window, full, moda_attention, softcap
from moda_flex.testing import (
    SCORE_KINDS,
    MoDAShape,
    assert_matches_reference,
    make_inputs,
    moda_shapes,
    score_functions,
    variants,
)

from budget import examples
from fused import FUSED_KINDS, TRITON_DEVICE


@settings(max_examples=examples(20))
@given(shape=moda_shapes(max_kv_len=24, max_groups=4, max_slots=5, head_dims=(8, 16)), data=st.data())
def test_flex_matches_reference_with_scores(shape, data):
    variant = data.draw(variants(shape)) & data.draw(score_functions(shape))
    assert_matches_reference(make_inputs(shape, strided_depth=data.draw(st.booleans())), backend="flex", variant=variant)


@settings(max_examples=examples(10))
@given(shape=moda_shapes(max_kv_len=24, max_groups=4, max_slots=5, head_dims=(8, 16)), data=st.data())
def test_reference_float32_matches_float64_with_scores(shape, data):
    variant = data.draw(variants(shape)) & data.draw(score_functions(shape))
    assert_matches_reference(make_inputs(shape), backend="reference", variant=variant)


def _learned(*size):
    return torch.rand(*size).requires_grad_()


EXAMPLES = {
    "softcap": lambda: softcap(1.5),
    "alibi": lambda: alibi(_learned(4)),
    "depth_bias": lambda: depth_bias(_learned(4, 3)),
    "depth_alibi": lambda: depth_alibi(_learned(4)),
}


@pytest.mark.parametrize("kind", SCORE_KINDS)
@pytest.mark.parametrize("backend", ["reference", "flex"])
@pytest.mark.parametrize("variant", [causal(), moda_flex.chunk_depth(3), full()], ids=str)
def test_every_builtin_matches_with_learned_grads(kind, backend, variant):
    shape = MoDAShape(2, 4, 2, 5, 9, 3, 8)
    assert_matches_reference(make_inputs(shape), backend=backend, variant=variant & EXAMPLES[kind]())


@pytest.mark.parametrize("backend", ["reference", "flex"])
def test_learned_bias_without_depth_slots(backend):
    assert_matches_reference(
        make_inputs(MoDAShape(1, 2, 1, 3, 5, 0, 8)), backend=backend, variant=causal() & depth_bias(_learned(0))
    )


@pytest.mark.parametrize("kind", ["alibi", "depth_bias"])
def test_flex_spreads_learned_tensors_over_copies(kind):
    # The compiled path (CUDA) reads a learning tensor through stacked copies so
    # that FlexAttention's atomic adds do not collide; run that path eagerly.
    from moda_flex.backends.flex.function import flex_moda
    from moda_flex.backends.flex.scoring import copies_of

    inputs = make_inputs(MoDAShape(1, 4, 2, 6, 9, 3, 8))
    score = EXAMPLES[kind]()
    (param,) = score.params
    assert copies_of(param) > 1 and copies_of(param.detach()) == 1
    variant = causal() & score
    leaves = [*inputs.values(), param]
    out, lse = flex_moda(*inputs.values(), variant, 8**-0.5, compiled=False, spread_grads=True)
    want_out, want_lse = moda_flex.backends.reference.reference_attention(*inputs.values(), variant, 8**-0.5)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    want = torch.autograd.grad(want_out, leaves, grad_out)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected)


def test_flex_reads_a_tensor_used_whole_without_copies():
    # A score that computes with its tensor (not only indexes it) cannot read
    # it through a copy: it keeps the one tensor, and stays right.
    from moda_flex.backends.flex.function import flex_moda
    from moda_flex.backends.flex.scoring import reads_by_index

    temperature = _learned(1)
    score = Score("depth_temperature", build=lambda q_heads, slots, t: (
        lambda s, b, h, q_pos, pos, slot, is_depth: torch.where(is_depth, s * (2 * t)[0], s)), params=(temperature,))
    variant = causal() & score
    assert not reads_by_index(variant, 4, 3)
    assert reads_by_index(causal() & depth_bias(_learned(4, 3)), 4, 3)
    inputs = make_inputs(MoDAShape(1, 4, 2, 6, 9, 3, 8))
    out, _ = flex_moda(*inputs.values(), variant, 8**-0.5, compiled=False, spread_grads=True)
    want, _ = moda_flex.backends.reference.reference_attention(*inputs.values(), variant, 8**-0.5)
    got_grad, = torch.autograd.grad(out.sum(), temperature)
    want_grad, = torch.autograd.grad(want.sum(), temperature)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(got_grad, want_grad)


def _dense(q, k, v, depth_k, depth_v, seq_bias, depth_bias_, cap=None):
    """MoDA for G = 1, full variant, by hand: (Tq, Tk) and (Tq, L) additive biases, then an optional cap."""
    scale = 1 / math.sqrt(q.shape[-1])
    seq = scale * q @ k.transpose(-1, -2) + seq_bias  # (B, H, Tq, Tk)
    dep = scale * torch.einsum("bhtd,bhtld->bhtl", q, depth_k) + depth_bias_  # (B, H, Tq, L)
    logits = torch.cat([seq, dep], dim=-1)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    p = logits.softmax(-1)
    Tk = k.shape[2]
    return p[..., :Tk] @ v + torch.einsum("bhtl,bhtld->bhtd", p[..., Tk:], depth_v)


def test_builtins_by_their_definition():
    inputs = make_inputs(MoDAShape(1, 2, 2, 4, 6, 3, 8), dtype=torch.float64, requires_grad=False)
    Tq, Tk, L = 4, 6, 3
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    bias = torch.tensor([[1.0, -1.0, 0.5], [0.0, 2.0, -2.0]], dtype=torch.float64)
    q_pos = torch.arange(Tk - Tq, Tk).view(Tq, 1)
    distance = (q_pos - torch.arange(Tk)).abs()  # (Tq, Tk)
    zero_seq, zero_depth = torch.zeros(Tq, Tk), torch.zeros(Tq, L)
    cases = [
        (softcap(2.0), zero_seq, zero_depth, 2.0),
        (alibi(slopes), -slopes.view(2, 1, 1) * distance, zero_depth, None),
        (depth_bias(bias), zero_seq, bias.view(2, 1, L), None),
        (depth_bias(bias[0]), zero_seq, bias[0], None),
        (depth_alibi(slopes), zero_seq, -slopes.view(2, 1, 1) * (L - 1 - torch.arange(L)), None),
        (depth_bias(bias) & softcap(1.5), zero_seq, bias.view(2, 1, L), 1.5),
    ]
    for score, seq_bias, depth_bias_, cap in cases:
        got = moda_attention(**inputs, variant=full() & score, backend="reference")
        torch.testing.assert_close(got, _dense(**inputs, seq_bias=seq_bias, depth_bias_=depth_bias_, cap=cap))


def test_scores_apply_in_order_and_name_the_variant():
    slopes = torch.rand(2)
    inputs = make_inputs(MoDAShape(1, 2, 1, 5, 5, 2, 8), requires_grad=False)
    a = moda_attention(**inputs, variant=causal() & alibi(slopes) & softcap(0.5), backend="reference")
    b = moda_attention(**inputs, variant=causal() & softcap(0.5) & alibi(slopes), backend="reference")
    assert not torch.allclose(a, b)
    variant = softcap(30.0) & causal()
    assert variant.name == "(causal & softcap(30))" and variant.score.name == "softcap(30)"
    same = moda_attention(**inputs, score=alibi(slopes) & softcap(0.5), backend="reference")
    torch.testing.assert_close(same, a)


def test_custom_score_runs_on_flex():
    def halve_depth(s, b, h, q_pos, pos, slot, is_depth):
        return torch.where(is_depth & (slot == 0), s / 2, s)

    shape = MoDAShape(1, 4, 2, 6, 9, 3, 16)
    assert_matches_reference(make_inputs(shape), backend="flex", variant=causal() & Score("halve_depth", halve_depth))


@pytest.mark.parametrize("backend", ["reference", "flex", "triton"])
def test_learned_depth_bias_gets_gradient_on_every_backend(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    bias = torch.zeros(3, device=device, requires_grad=True)
    out = moda_attention(**make_inputs(MoDAShape(1, 2, 1, 4, 7, 3, 8), device=device), score=depth_bias(bias),
                         backend=backend)  # fmt: skip
    out.square().sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0


# ---- triton: the scores of support.FUSED_SCORES fused into the kernels, the other scores refused ---


def _fused(score: Score) -> bool:
    """At most one softcap and one depth_bias: what the kernels run."""
    from moda_flex.backends.triton import unsupported_reason

    return unsupported_reason(torch.zeros(1, 1, 1, 8, device=TRITON_DEVICE), full() & score) is None


@settings(max_examples=examples(15))
@given(shape=moda_shapes(max_kv_len=40, max_groups=4, max_kv_heads=2, max_slots=9, head_dims=(8, 16)), data=st.data())
def test_triton_matches_reference_with_scores(shape, data):
    """Output, lse and every gradient, the learned bias's included, for every fused score in either order."""
    pytest.importorskip("triton")
    from moda_flex.backends.triton.support import FUSED_SCORES

    variant = data.draw(variants(shape, kinds=FUSED_KINDS, structured=True))
    score = data.draw(score_functions(shape, kinds=FUSED_SCORES, device=TRITON_DEVICE).filter(_fused))
    strided, entries = data.draw(st.booleans()), data.draw(st.booleans())
    inputs = make_inputs(shape, device=TRITON_DEVICE, strided_depth=strided, depth_entries=entries)
    assert_matches_reference(inputs, backend="triton", variant=variant & score)


@pytest.mark.parametrize(
    "make_score",
    [
        lambda: softcap(0.75),
        lambda: depth_bias(_learned(3).to(TRITON_DEVICE)),
        lambda: softcap(0.75) & depth_bias(_learned(4, 3).to(TRITON_DEVICE)),
        lambda: depth_bias(_learned(4, 3).to(TRITON_DEVICE)) & softcap(0.75),
    ],
    ids=["softcap", "depth_bias", "softcap&depth_bias", "depth_bias&softcap"],
)
@pytest.mark.parametrize("variant", [causal(), full(), depth_window(2)], ids=str)
def test_triton_fuses_softcap_and_depth_bias(make_score, variant):
    pytest.importorskip("triton")
    inputs = make_inputs(MoDAShape(2, 4, 2, 5, 19, 3, 8), device=TRITON_DEVICE)
    assert_matches_reference(inputs, backend="triton", variant=variant & make_score())


def test_triton_learns_the_bias_through_the_compiled_op():
    """torch.compile (fullgraph) reaches the kernels through the torch.library op; the bias's gradient with it."""
    pytest.importorskip("triton")
    inputs = make_inputs(MoDAShape(1, 4, 2, 7, 9, 3, 16), device=TRITON_DEVICE, requires_grad=False)
    grads = []
    for compiled in (True, False):
        leaves = [t.clone().requires_grad_() for t in inputs.values()]
        bias = torch.linspace(-1.0, 1.0, 12, device=TRITON_DEVICE).view(4, 3).requires_grad_()  # a layer's parameter
        variant = causal() & softcap(2.0) & depth_bias(bias)  # made once, outside the compiled step, as a layer does

        def step(q, k, v, depth_k, depth_v):
            return moda_attention(q, k, v, depth_k, depth_v, variant=variant, backend="triton").square().sum()

        (torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step)(*leaves).backward()
        grads.append([t.grad for t in leaves] + [bias.grad])
    for name, ours, eager in zip(["q", "k", "v", "depth_k", "depth_v", "bias"], *grads):
        torch.testing.assert_close(ours, eager, msg=lambda m: f"grad of {name}: {m}")
    assert grads[0][-1].abs().sum() > 0


@pytest.mark.parametrize(
    "make_score, needle",
    [
        (lambda: alibi(torch.rand(2)), "'alibi'"),
        (lambda: depth_alibi(torch.rand(2)), "'depth_alibi'"),
        (lambda: softcap(5.0) & alibi(torch.rand(2)), "'softcap\\(5\\) & alibi'"),
        (lambda: softcap(5.0) & softcap(2.0), "'softcap\\(5\\) & softcap\\(2\\)'"),
        (lambda: Score("mine", lambda s, *_: s), "'mine'"),
    ],
    ids=["alibi", "depth_alibi", "softcap&alibi", "softcap&softcap", "custom"],
)
def test_triton_refuses_other_scores_and_auto_falls_back(make_score, needle):
    pytest.importorskip("triton")
    from moda_flex.backends.triton import unsupported_reason

    inputs = make_inputs(MoDAShape(1, 2, 1, 3, 5, 2, 8), requires_grad=False)
    score = make_score()
    with pytest.raises(NotImplementedError, match=f"score {needle} is not fused"):
        moda_attention(**inputs, score=score, backend="triton")
    # auto asks the same question, and takes flex on CUDA (reference on CPU) when the answer is a reason
    assert unsupported_reason(inputs["q"], causal() & score) is not None
    expected = moda_attention(**inputs, score=score, backend="reference")
    torch.testing.assert_close(moda_attention(**inputs, score=score), expected)


@pytest.mark.parametrize("cap", [0, -1.0, float("inf"), float("nan"), True, "3"])
def test_softcap_needs_a_positive_cap(cap):
    with pytest.raises(ValueError, match="softcap: cap"):
        softcap(cap)


@pytest.mark.parametrize("backend", ["reference", "flex"])
def test_wrong_sizes_are_named(backend):
    inputs = make_inputs(MoDAShape(1, 4, 2, 3, 5, 2, 8), requires_grad=False)
    with pytest.raises(ValueError, match=r"depth_bias: bias must have shape \(L,\) = \(2,\).*got \(3,\)"):
        moda_attention(**inputs, score=depth_bias(torch.zeros(3)), backend=backend)
    with pytest.raises(ValueError, match=r"depth_bias: bias must have shape \(Hq, L\) = \(4, 2\)"):
        moda_attention(**inputs, score=depth_bias(torch.zeros(2, 2)), backend=backend)
    with pytest.raises(ValueError, match=r"alibi: slopes must have shape \(Hq=4,\)"):
        moda_attention(**inputs, score=alibi(torch.ones(2)), backend=backend)
    with pytest.raises(ValueError, match=r"depth_alibi: slopes must have shape \(Hq=4,\)"):
        moda_attention(**inputs, score=depth_alibi(torch.ones(3)), backend=backend)


def test_bad_tensors_and_results_are_named():
    with pytest.raises(TypeError, match="depth_bias: bias must be a float tensor"):
        depth_bias(torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="alibi: slopes must be a float tensor"):
        alibi(torch.zeros(2, 2))
    inputs = make_inputs(MoDAShape(1, 2, 1, 3, 5, 2, 8), requires_grad=False)
    as_int = Score("as_int", lambda s, b, h, q_pos, pos, slot, is_depth: q_pos - pos)
    with pytest.raises(TypeError, match="score 'as_int' must return a float tensor.*int64"):
        moda_attention(**inputs, score=as_int, backend="reference")
    per_slot = torch.zeros(4)
    wrong_shape = Score("wrong_shape", lambda s, b, h, q_pos, pos, slot, is_depth: s.sum() + per_slot)
    for backend in ("reference", "flex"):
        with pytest.raises(ValueError, match="score 'wrong_shape' must return a tensor of the logit's shape"):
            moda_attention(**inputs, score=wrong_shape, backend=backend)
    learned = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="captures a tensor of shape \\(2,\\) that requires grad; list it in params="):
        Score("captured", lambda s, b, h, q_pos, pos, slot, is_depth: s + learned[slot])
    with pytest.raises(ValueError, match="join the score after the union"):
        (causal() & softcap(2.0)) | full()
    with pytest.raises(TypeError, match="score must be a moda_flex Score"):
        moda_attention(**inputs, score=lambda s, *_: s)


def test_assert_matches_reference_checks_the_learned_bias():
    shape = MoDAShape(1, 2, 1, 4, 6, 3, 8)

    def detached_bias(q, k, v, depth_k, depth_v, variant, scale):
        score = variant.score.with_params([p.detach() for p in variant.score.params])
        return moda_attention(q, k, v, depth_k, depth_v, variant=variant.with_score(score), scale=scale,
                              backend="reference", return_lse=True)

    variant = causal() & depth_bias(torch.randn(3, requires_grad=True))
    with pytest.raises(AssertionError, match=r"grad of depth_bias.params\[0\]"):
        assert_matches_reference(make_inputs(shape), backend=detached_bias, variant=variant)


def test_layer_learns_a_depth_bias():
    torch.manual_seed(0)
    bias = nn.Parameter(torch.zeros(2))
    layer = moda_flex.nn.MoDAAttention(32, 4, 2, score=depth_bias(bias))
    assert any(p is bias for p in layer.parameters())
    stream = moda_flex.DepthStream().append(torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8))
    stream = stream.append(torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8))
    y, _ = layer(torch.randn(2, 7, 32), stream)
    y.square().mean().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
