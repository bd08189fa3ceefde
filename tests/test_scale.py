"""``scale`` as SDPA takes it: any finite nonzero real number, negative too, computed alike by every backend.

A negative scale flips the sign of every logit (``scale * q . k``): the
softmax then favours the least similar keys. Nothing in a backend may assume
``scale > 0`` (a log2 conversion, a running max, a softcap): each is checked
here against the float64 reference on the output, the lse and every gradient.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moda_flex import causal, depth_bias, depth_window, moda_attention, softcap
from moda_flex.backends import choose
from moda_flex.testing import MoDAShape, assert_matches_reference, make_inputs

NEGATIVE = (-0.7, -3.0)
# Tq == Tk and D a multiple of 8, so that the split path runs too (under the interpreter on CPU).
SHAPE = MoDAShape(batch=1, q_heads=4, kv_heads=2, q_len=5, kv_len=5, slots=3, head_dim=16)


def _dense_moda(q, k, v, depth_k, depth_v, scale):
    """Causal MoDA written out: one softmax over ``scale * q . [keys | own depth]``; (B, Hq, T, D)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # (B, Hq, T, D)
    depth_k, depth_v = depth_k.repeat_interleave(G, 1), depth_v.repeat_interleave(G, 1)  # (B, Hq, T, L, D)
    T = q.shape[2]
    seq = (scale * q @ k.transpose(-1, -2)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    depth = scale * torch.einsum("bhtd,bhtld->bhtl", q, depth_k)  # (B, Hq, T, L)
    weights = torch.cat([seq, depth], dim=-1).softmax(-1)  # (B, Hq, T, T + L)
    return weights[..., :T] @ v + torch.einsum("bhtl,bhtld->bhtd", weights[..., T:], depth_v)


@pytest.mark.parametrize("scale", NEGATIVE)
def test_reference_computes_a_negative_scale_as_written(scale):
    inputs = make_inputs(SHAPE, dtype=torch.float64, requires_grad=False)
    out = moda_attention(**inputs, scale=scale, backend="reference")
    torch.testing.assert_close(out, _dense_moda(**inputs, scale=scale))


@pytest.mark.parametrize("backend", ["reference", "flex", "auto"])
@pytest.mark.parametrize("scale", NEGATIVE)
def test_without_depth_a_negative_scale_is_sdpa(backend, scale):
    inputs = make_inputs(dataclasses.replace(SHAPE, slots=0), dtype=torch.float64, requires_grad=False)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    # SDPA's math: its fused CPU kernel gives NaN for a causal mask under a negative scale (torch 2.13).
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    torch.testing.assert_close(moda_attention(q, k, v, scale=scale, backend=backend), expected)


def _runs_here(backend: str, variant) -> bool:
    q = torch.empty(SHAPE.batch, SHAPE.q_heads, SHAPE.q_len, SHAPE.head_dim)  # (B, Hq, Tq, D)
    k = torch.empty(SHAPE.batch, SHAPE.kv_heads, SHAPE.kv_len, SHAPE.head_dim)  # (B, Hk, Tk, D)
    try:
        choose(backend, q, k, SHAPE.slots, variant, return_lse=True)
    except NotImplementedError:
        return False
    return True


VARIANTS = {
    "causal": lambda: causal(),
    "depth_window(2)": lambda: depth_window(2),
    "causal&softcap(2)": lambda: causal() & softcap(2.0),  # the cap is odd in the logit: its sign must survive
    "causal&depth_bias": lambda: causal() & depth_bias(torch.linspace(-1.0, 1.0, SHAPE.slots)),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", ["reference", "flex", "triton", "split", "auto"])
@pytest.mark.parametrize("scale", NEGATIVE)
def test_every_backend_computes_a_negative_scale(backend, variant, scale):
    made = VARIANTS[variant]()
    if not _runs_here(backend, made):
        pytest.skip(f"backend {backend!r} does not run {variant} here")
    assert_matches_reference(make_inputs(SHAPE), backend=backend, variant=made, scale=scale)


@pytest.mark.parametrize("backend", ["reference", "flex", "triton"])
def test_a_negative_scale_is_the_positive_one_of_the_negated_query(backend):
    if not _runs_here(backend, causal()):
        pytest.skip(f"backend {backend!r} does not run here")
    inputs = make_inputs(SHAPE, requires_grad=False)
    flipped = dict(inputs, q=-inputs["q"])
    out, lse = moda_attention(**inputs, scale=-0.5, backend=backend, return_lse=True)
    out_flipped, lse_flipped = moda_attention(**flipped, scale=0.5, backend=backend, return_lse=True)
    torch.testing.assert_close(out, out_flipped)
    torch.testing.assert_close(lse, lse_flipped)


@pytest.mark.parametrize("scale", [0, 0.0, -0.0, math.nan, math.inf, -math.inf])
def test_a_zero_or_non_finite_scale_is_refused(scale):
    inputs = make_inputs(SHAPE, requires_grad=False)
    with pytest.raises(ValueError, match=rf"scale must be a finite nonzero real number, got {scale!r}"):
        moda_attention(**inputs, scale=scale)
