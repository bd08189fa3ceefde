"""The Triton backend on a GPU at the paper's sizes, bf16 against a float32 reference.

Skipped without CUDA. Run: ``pytest tests/test_triton_gpu.py``.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from moda_flex import variants as v  # noqa: E402
from moda_flex.backends.reference import reference_attention  # noqa: E402
from moda_flex.testing import relative_error, tolerance  # noqa: E402

BF16_TOL = tolerance(torch.bfloat16)


def _inputs(B, Hq, Hk, T, L, D, lmax=None, seed=0):
    """bf16 leaves; depth is the view ``buf[:, :, :, :L]`` of a (B, Hk, T, lmax, D) slot buffer."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*size):
        return torch.randn(*size, device="cuda", generator=gen, dtype=torch.bfloat16)

    lmax = L if lmax is None else lmax
    q, k, vv = normal(B, Hq, T, D), normal(B, Hk, T, D), normal(B, Hk, T, D)
    dk, dv = normal(B, Hk, T, lmax, D)[:, :, :, :L], normal(B, Hk, T, lmax, D)[:, :, :, :L]
    return [t.requires_grad_() for t in (q, k, vv)] + [dk.requires_grad_(), dv.requires_grad_()]


def _triton(inputs, variant, grad_out):
    from moda_flex.backends.triton import triton_attention

    leaves = [t.detach().requires_grad_() for t in inputs]
    out, lse = triton_attention(*leaves, variant, inputs[0].shape[-1] ** -0.5)
    out.backward(grad_out)
    return out, lse, [t.grad for t in leaves]


def _reference(inputs, variant, grad_out):
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    out, lse = reference_attention(*leaves, variant, inputs[0].shape[-1] ** -0.5)
    out.backward(grad_out.float())
    return out, lse, [t.grad for t in leaves]


def _assert_close(name, actual, expected, tol=BF16_TOL):
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    error = relative_error(actual, expected)
    assert error <= tol, f"{name}: relative RMS error {error:.3e} > {tol:.1e}"


def _assert_matches_reference(inputs, variant):
    """Output, lse and the five gradients of the triton backend against the float32 reference."""
    grad_out = torch.randn_like(inputs[0])
    out, lse, grads = _triton(inputs, variant, grad_out)
    ref_out, ref_lse, ref_grads = _reference(inputs, variant, grad_out)
    _assert_close("out", out, ref_out)
    _assert_close("lse", lse, ref_lse, 1e-3)
    for name, g, r in zip(("q", "k", "v", "depth_k", "depth_v"), grads, ref_grads):
        _assert_close(f"grad of {name}", g, r)


@pytest.mark.parametrize("variant", [v.causal(), v.full()], ids=lambda x: x.name)
def test_paper_shape(variant):
    """T=4096, G=8, Hq=64, Hk=8, L=64, D=64: output, lse and all five gradients."""
    inputs = _inputs(1, 64, 8, 4096, 64, 64, lmax=80)
    _assert_matches_reference(inputs, variant)


@pytest.mark.parametrize(
    "make_variant",
    [
        lambda: v.sliding_window(700),
        lambda: v.depth_window(20),
        lambda: v.causal() & v.document(torch.arange(2048, device="cuda") // 300),
    ],
    ids=["sliding_window", "depth_window", "causal_document"],
)
def test_variants_at_size(make_variant):
    variant = make_variant()
    inputs = _inputs(2, 16, 2, 2048, 33, 64)
    _assert_matches_reference(inputs, variant)


@pytest.mark.parametrize("bias_first", [False, True], ids=["softcap&depth_bias", "depth_bias&softcap"])
def test_fused_scores_at_size(bias_first):
    """softcap and a learned (Hq, L) depth bias at a training size: output, lse, the five gradients and the bias's."""
    from moda_flex import depth_bias, softcap

    inputs = _inputs(2, 12, 4, 2048, 24, 64)
    grad_out = torch.randn_like(inputs[0])
    bias = torch.randn(12, 24, device="cuda")
    results = []
    for run in (_triton, _reference):
        leaf = bias.clone().requires_grad_()
        cap, learned = softcap(20.0), depth_bias(leaf)
        variant = v.causal() & ((learned & cap) if bias_first else (cap & learned))
        results.append((*run(inputs, variant, grad_out), leaf.grad))
    (out, lse, grads, bias_grad), (ref_out, ref_lse, ref_grads, ref_bias_grad) = results
    _assert_close("out", out, ref_out)
    _assert_close("lse", lse, ref_lse, 1e-3)
    for name, g, r in zip(("q", "k", "v", "depth_k", "depth_v"), grads, ref_grads):
        _assert_close(f"grad of {name}", g, r)
    _assert_close("grad of the bias", bias_grad, ref_bias_grad)


@pytest.mark.parametrize("variant", [v.causal(), v.sliding_window(300)], ids=lambda x: x.name)
@pytest.mark.parametrize("G", [3, 8])
def test_model_layer_length(variant, G):
    """Tk at most configs.SHORT_KEYS (the forward's key blocks of 64), Tq < Tk: every output and gradient."""
    q, k, vv, dk, dv = _inputs(2, 2 * G, 2, 1000, 23, 64)
    last = [t[:, :, -777:].detach().requires_grad_() for t in (q, dk, dv)]  # the queries of the last 777 tokens
    inputs = [last[0], k, vv, last[1], last[2]]
    _assert_matches_reference(inputs, variant)


@pytest.mark.parametrize("D", [80, 96, 128, 256])
@pytest.mark.parametrize("G", [3, 8])
def test_other_head_dims(D, G):
    """Head dims padded inside the kernels (80, 96, 256) and 128 (its own forward tiles on sm_90): every output and gradient."""
    inputs = _inputs(2, 2 * G, 2, 1000, 23, D)
    _assert_matches_reference(inputs, v.causal())


def test_offsets_past_int32():
    """T * L * Hk * D > 2**31 elements per depth tensor: sampled token chunks match the reference.

    Rows are independent in the output, lse, dq and the depth gradients, so a
    chunk of query tokens [a, a + n) is checked against the reference on the
    keys [0, a + n) (bottom-right aligned, so the chunk keeps its positions).
    """
    B, Hq, Hk, T, L, D = 1, 64, 8, 16384 + 64, 256, 64
    assert T * L * Hk * D > 2**31
    inputs = _inputs(B, Hq, Hk, T, L, D)
    grad_out = torch.randn_like(inputs[0])
    out, lse, grads = _triton(inputs, v.causal(), grad_out)
    n = 48
    for a in (0, 9001, T - n):
        rows = slice(a, a + n)
        q, k, vv, dk, dv = inputs
        chunk = [q[:, :, rows], k[:, :, : a + n], vv[:, :, : a + n], dk[:, :, rows], dv[:, :, rows]]
        ref_out, ref_lse, ref_grads = _reference(chunk, v.causal(), grad_out[:, :, rows])
        _assert_close(f"out rows {a}+", out[:, :, rows], ref_out)
        _assert_close(f"lse rows {a}+", lse[:, :, rows], ref_lse, 1e-3)
        _assert_close(f"grad of q rows {a}+", grads[0][:, :, rows], ref_grads[0])
        _assert_close(f"grad of depth_k rows {a}+", grads[3][:, :, rows], ref_grads[3])
        _assert_close(f"grad of depth_v rows {a}+", grads[4][:, :, rows], ref_grads[4])
