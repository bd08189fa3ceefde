"""moda_flex.depth: the depth forms and the immutable DepthStream."""


import pytest
import torch

from moda_flex import moda_attention
from moda_flex.depth import DepthStream, as_tensor

from fused import needs_interpreter

TRITON = pytest.param("triton", marks=needs_interpreter)


def _entry(B=1, Hk=2, T=3, D=4, dtype=torch.float32, device="cpu", fill=0.0):
    return torch.full((B, Hk, T, D), fill, dtype=dtype, device=device)


def test_append_returns_a_new_stream_and_leaves_the_old_one():
    empty = DepthStream(capacity=2)
    one = empty.append(_entry(fill=1.0), _entry(fill=2.0))
    assert len(empty) == 0 and len(one) == 1
    assert empty.read() == (None, None)
    # Reusing a stream for a second pass sees exactly its own entries.
    again = empty.append(_entry(fill=3.0), _entry(fill=4.0))
    assert one.read()[0][0][0, 0, 0, 0] == 1.0 and again.read()[0][0][0, 0, 0, 0] == 3.0


def test_read_returns_the_entries_themselves():
    k, v = _entry(), _entry()
    depth_k, depth_v = DepthStream().append(k, v).read()
    assert depth_k[0] is k and depth_v[0] is v  # no copy


def test_read_a_prefix_and_past_the_end():
    stream = DepthStream().append(_entry(), _entry()).append(_entry(fill=1.0), _entry())
    assert len(stream.read(1)[0]) == 1
    with pytest.raises(ValueError, match=r"count must be an int in 0\.\.2"):
        stream.read(3)


@pytest.mark.parametrize("capacity", [-1, 2.5, True, "3"])
def test_bad_capacity(capacity):
    with pytest.raises(ValueError, match="capacity"):
        DepthStream(capacity=capacity)


def test_append_errors_name_what_differs():
    stream = DepthStream(capacity=1)
    with pytest.raises(ValueError, match="k and v must match"):
        stream.append(_entry(D=4), _entry(D=5))
    with pytest.raises(ValueError, match=r"k must be a \(B, Hk, T, D\) tensor"):
        stream.append(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))
    full = stream.append(_entry(), _entry())
    with pytest.raises(ValueError, match="full"):
        full.append(_entry(), _entry())
    stream = DepthStream().append(_entry(B=2), _entry(B=2))
    with pytest.raises(ValueError, match=r"shape \(B, Hk, T, D\) \(3, 2, 3, 4\).*\(2, 2, 3, 4\)"):
        stream.append(_entry(B=3), _entry(B=3))
    with pytest.raises(ValueError, match="dtype"):
        stream.append(_entry(B=2, dtype=torch.float64), _entry(B=2, dtype=torch.float64))
    with pytest.raises(ValueError, match="device"):
        stream.append(_entry(B=2, device="meta"), _entry(B=2, device="meta"))


def test_as_tensor_stacks_entries_and_keeps_tensors():
    entries = [_entry(fill=float(i)) for i in range(3)]
    stacked = as_tensor(entries, entries[0])
    assert stacked.shape == (1, 2, 3, 3, 4) and stacked[0, 0, 0, 2, 0] == 2.0
    assert as_tensor(stacked, entries[0]) is stacked
    assert as_tensor([], entries[0]).shape == (1, 2, 3, 0, 4)


def _toy_model(qs, ks, vs, backend, as_entries):
    """Each layer reads every entry so far, attends, then appends its own (non-leaf) k, v."""
    stream, total = DepthStream(), 0.0
    for layer, (q, k, v) in enumerate(zip(qs, ks, vs)):
        depth_k, depth_v = stream.read()
        if depth_k is not None and not as_entries:
            depth_k, depth_v = torch.stack(depth_k, dim=3), torch.stack(depth_v, dim=3)  # (B, Hk, T, L, D)
        total = total + (moda_attention(q, k, v, depth_k, depth_v, backend=backend) * (layer + 1)).sin().sum()
        stream = stream.append(k.tanh(), v * 2.0)
    return total


@pytest.mark.parametrize("backend", ["reference", "flex", TRITON])
def test_entry_gradients_equal_restacking(backend):
    """Depth read as entries in place gives every entry the gradients a re-stacked tensor gives it."""
    B, Hk, G, T, D, layers = 2, 2, 2, 5, 16, 4
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, requires_grad=True)

    qs = [rand(B, Hk * G, T, D) for _ in range(layers)]
    ks = [rand(B, T, Hk, D).transpose(1, 2) for _ in range(layers)]  # strided, as a projection yields
    vs = [rand(B, Hk, T, D) for _ in range(layers)]
    leaves = qs + ks + vs
    out = _toy_model(qs, ks, vs, backend, as_entries=True)
    expected = _toy_model(qs, ks, vs, "reference", as_entries=False)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    for got, want in zip(torch.autograd.grad(out, leaves), torch.autograd.grad(expected, leaves)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", [TRITON])
def test_entries_of_mixed_strides(backend):
    """Entries of one side with different layouts are read correctly (the kernel copies them to one layout)."""
    B, Hk, G, T, D, L = 1, 2, 2, 7, 16, 4
    generator = torch.Generator().manual_seed(3)

    def entry(i):
        if i % 2:  # (B, T, Hk, D) memory seen as (B, Hk, T, D)
            return torch.randn(B, T, Hk, D, generator=generator).transpose(1, 2).requires_grad_()
        return torch.randn(B, Hk, T, D, generator=generator, requires_grad=True)

    q = torch.randn(B, Hk * G, T, D, generator=generator, requires_grad=True)
    k, v = (torch.randn(B, Hk, T, D, generator=generator, requires_grad=True) for _ in range(2))
    depth_k, depth_v = [entry(i) for i in range(L)], [entry(i + 1) for i in range(L)]
    leaves = [q, k, v, *depth_k, *depth_v]
    out = moda_attention(q, k, v, depth_k, depth_v, backend=backend)
    expected = moda_attention(q, k, v, depth_k, depth_v, backend="reference")
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    grads = torch.autograd.grad(out.sin().sum(), leaves)
    for got, want in zip(grads, torch.autograd.grad(expected.sin().sum(), leaves)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
