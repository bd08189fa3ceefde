"""The reference backend: second derivatives, and the attention weights it gives for pictures."""

import math

import torch

from moda_flex import moda_attention
from moda_flex.backends.reference import attention_probabilities
from moda_flex.testing import MoDAShape, make_inputs


def test_reference_has_second_derivatives():
    """What backend 'flex' refers a create_graph=True backward to."""
    inputs = make_inputs(MoDAShape(1, 2, 1, 2, 3, 2, 4), dtype=torch.float64)

    def attention(*tensors):
        return moda_attention(*tensors, backend="reference")

    assert torch.autograd.gradgradcheck(attention, tuple(inputs.values()))


def test_attention_probabilities_defaults_are_moda_attentions():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, 7, 8, dtype=torch.float64)
    depth_k, depth_v = torch.randn(2, 1, 2, 5, 3, 8, dtype=torch.float64)

    probs = attention_probabilities(q, k, v, depth_k, depth_v)  # causal, 1 / sqrt(D)
    explicit = attention_probabilities(q, k, v, depth_k, depth_v, "causal", 1 / math.sqrt(8))
    torch.testing.assert_close(probs, explicit)
    seq_probs, depth_probs = probs.split([7, 3], dim=-1)  # (B, Hq, Tq, Tk), (B, Hq, Tq, L)
    out = seq_probs @ v.repeat_interleave(2, dim=1)
    out = out + torch.einsum("bhtl,bhtld->bhtd", depth_probs, depth_v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(out, moda_attention(q, k, v, depth_k, depth_v))

    no_depth = attention_probabilities(q, k, v)
    assert no_depth.shape == (1, 4, 5, 7)
    torch.testing.assert_close(no_depth.sum(-1), torch.ones(1, 4, 5, dtype=torch.float64))
