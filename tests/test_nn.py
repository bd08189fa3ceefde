"""moda_flex.nn: DepthStream against re-stacking, blocks against the reference path, decoding, checkpoints."""

import dataclasses
import gc
import io
import math
import weakref

import pytest
import torch

from moda_flex import moda_attention
from moda_flex.nn import (
    Block,
    BlockConfig,
    DepthKVProjection,
    DepthStream,
    KVCache,
    MoDAAttention,
    apply_rope,
)


class StackedStream:
    """The naive depth stream: a list of entries, re-stacked at every read."""

    def __init__(self):
        self.ks, self.vs = [], []

    def read(self):
        if not self.ks:
            return None, None
        return torch.stack(self.ks, dim=3), torch.stack(self.vs, dim=3)  # (B, Hk, T, L, D)

    def append(self, k, v):
        self.ks.append(k)
        self.vs.append(v)


def _close(a, b, tol):
    """Relative (RMS-ratio) closeness."""
    err = (a - b).double().pow(2).mean().sqrt()
    ref = b.double().pow(2).mean().sqrt().clamp_min(1e-12)
    return (err / ref).item() <= tol


# --- DepthStream ------------------------------------------------------------


def _depth_program(stream, qs, ks, vs, reads_per_layer):
    """A toy stack: every layer reads the stream (sometimes twice), attends, then appends."""
    total = 0.0
    for layer, (q, k, v) in enumerate(zip(qs, ks, vs)):
        for _ in range(reads_per_layer):
            depth_k, depth_v = stream.read()
            # A consumer that saves the read for backward, as fused kernels do.
            total = total + (moda_attention(q, k, v, depth_k, depth_v) * (layer + 1)).sin().sum()
            if depth_k is not None:
                total = total + (depth_k * depth_v).sum() * 0.1
        stream.append(k.tanh(), v * 2.0)  # non-leaf entries, as in a real model
    return total


@pytest.mark.parametrize("layers,reads", [(1, 1), (3, 1), (5, 2)], ids=["L1", "L3", "L5-read2"])
@pytest.mark.parametrize("shape", [(2, 2, 2, 5, 4), (1, 3, 1, 7, 8)], ids=["B2-Hk2-G2-T5-D4", "B1-Hk3-G1-T7-D8"])
def test_depth_stream_matches_restacking(shape, layers, reads):
    B, Hk, G, T, D = shape
    g = torch.Generator().manual_seed(0)

    def rand(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)

    qs = [rand(B, Hk * G, T, D) for _ in range(layers)]
    # Keys as transposed views, the layout a projection yields.
    ks = [rand(B, T, Hk, D) for _ in range(layers)]
    vs = [rand(B, Hk, T, D) for _ in range(layers)]
    leaves = qs + ks + vs
    k_views = [k.transpose(1, 2) for k in ks]

    out = _depth_program(DepthStream(layers), qs, k_views, vs, reads)
    grads = torch.autograd.grad(out, leaves)
    expected = _depth_program(StackedStream(), qs, k_views, vs, reads)
    expected_grads = torch.autograd.grad(expected, leaves)

    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_depth_stream_reads_are_views_of_one_buffer():
    stream = DepthStream(3)
    k = torch.randn(2, 1, 4, 8)
    for _ in range(2):
        stream.append(k, k)
    depth_k, _ = stream.read()
    assert depth_k.shape == (2, 1, 4, 2, 8)
    assert depth_k._base is not None and depth_k._base.shape == (2, 1, 4, 3, 8)
    assert depth_k.stride(3) == 8 and depth_k.stride(2) == 3 * 8


def test_depth_stream_repeated_backward():
    k = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    stream = DepthStream(2)
    stream.append(k * 3.0, k)
    depth_k, depth_v = stream.read()
    loss = moda_attention(q, k, k, depth_k, depth_v).square().sum()
    first = torch.autograd.grad(loss, k, retain_graph=True)[0]
    second = torch.autograd.grad(loss, k)[0]
    torch.testing.assert_close(first, second)


def test_depth_stream_memory_is_freed_after_backward():
    """No reference cycle: the buffers go as soon as the graph does, without the garbage collector."""
    k = torch.randn(1, 2, 3, 4, requires_grad=True)
    stream = DepthStream(2)
    stream.append(k * 2.0, k)
    depth_k, depth_v = stream.read()
    stream.append(k, k)
    buffer = weakref.ref(depth_k._base)
    loss = moda_attention(k, k, k, depth_k, depth_v).sum()
    gc.disable()
    try:
        del stream, depth_k, depth_v
        loss.backward()
        del loss
        assert buffer() is None
    finally:
        gc.enable()


def test_depth_stream_bfloat16_grads_keep_dtype():
    k = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    stream = DepthStream(2)
    stream.append(k, k)
    stream.append(k, k)
    depth_k, depth_v = stream.read()
    (depth_k.float().sum() + depth_v.float().sum()).backward()
    assert k.grad.dtype == torch.bfloat16
    torch.testing.assert_close(k.grad, torch.full_like(k, 4.0))


def test_depth_stream_without_grad():
    stream = DepthStream(2)
    with torch.no_grad():
        stream.append(torch.ones(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
        depth_k, depth_v = stream.read()
    assert not depth_k.requires_grad
    assert depth_k.shape == (1, 1, 2, 1, 4)
    assert stream.read() is not None and DepthStream(1).read() == (None, None)


def test_depth_stream_errors():
    with pytest.raises(ValueError, match="capacity"):
        DepthStream(-1)
    stream = DepthStream(1)
    with pytest.raises(ValueError, match=r"k and v must both have shape"):
        stream.append(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 5))
    stream.append(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(ValueError, match="full"):
        stream.append(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    stream = DepthStream(2)
    stream.append(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(ValueError, match=r"k must have shape \(1, 1, 2, 4\)"):
        stream.append(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))


# --- blocks -----------------------------------------------------------------


def _stack(config: BlockConfig, n_layer: int, seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList([Block(config) for _ in range(n_layer)]).to(dtype)
    for p in blocks.parameters():  # away from the identity init of the norms
        p.data.add_(0.1 * torch.randn_like(p))
    return blocks


def _run(blocks, x, stream=None, caches=None):
    for i, block in enumerate(blocks):
        x = block(x, stream, caches[i] if caches is not None else None)
    return x


CONFIGS = [
    BlockConfig(n_embd=24, n_head=4, n_kv_head=2, depth_kv="none", norm="pre"),
    BlockConfig(n_embd=24, n_head=4, n_kv_head=2, depth_kv="attn", norm="post"),
    BlockConfig(n_embd=24, n_head=4, n_kv_head=2, depth_kv="attn+ffn", norm="pre"),
    BlockConfig(n_embd=24, n_head=4, n_kv_head=1, depth_kv="attn+ffn", norm="post"),
    BlockConfig(n_embd=24, n_head=3, n_kv_head=3, depth_kv="attn+ffn", norm="post", rope=False, qk_norm=False),
]
CONFIG_IDS = ["none-pre-G2", "attn-post-G2", "ffn-pre-G2", "ffn-post-G4", "ffn-post-G1-plain"]


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_blocks_match_reference_with_restacking(config):
    """The fast path (DepthStream, SDPA where no depth) against the reference backend on re-stacked depth."""
    n_layer, B, T = 3, 2, 7
    fast = _stack(config, n_layer)
    slow = _stack(dataclasses.replace(config, backend="reference"), n_layer)
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(B, T, config.n_embd, dtype=torch.float64, requires_grad=True)

    out = _run(fast, x, DepthStream(n_layer * config.depth_writes))
    grads = torch.autograd.grad(out.sin().sum(), [x, *fast.parameters()], allow_unused=True)
    expected = _run(slow, x, StackedStream())
    expected_grads = torch.autograd.grad(expected.sin().sum(), [x, *slow.parameters()], allow_unused=True)

    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    names = ["x"] + [name for name, _ in fast.named_parameters()]
    for name, got, want in zip(names, grads, expected_grads):
        assert (got is None) == (want is None), name  # the last FFN projection has no reader
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


def test_depth_is_read_and_the_ffn_projection_learns():
    config = BlockConfig(n_embd=16, n_head=2, n_kv_head=1, depth_kv="attn+ffn")
    blocks = _stack(config, 2)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    out = _run(blocks, x, DepthStream(4))
    out.sum().backward()
    assert blocks[0].ffn_kv.kv_proj.weight.grad.abs().sum() > 0
    assert blocks[1].ffn_kv.kv_proj.weight.grad is None  # the last FFN entry has no reader
    with torch.no_grad():
        blocks[0].ffn_kv.kv_proj.weight.zero_()
        assert not torch.allclose(_run(blocks, x, DepthStream(4)), out)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("chunk", [1, 3], ids=["decode", "chunked"])
def test_decode_with_cache_matches_full_forward(config, chunk):
    n_layer, B, T, prompt = 3, 2, 9, 4
    blocks = _stack(config, n_layer).eval()
    x = torch.randn(B, T, config.n_embd, dtype=torch.float64)
    with torch.no_grad():
        full = _run(blocks, x, DepthStream(n_layer * config.depth_writes))
        caches = [KVCache(T) for _ in blocks]
        pieces = [_run(blocks, x[:, :prompt], DepthStream(n_layer * config.depth_writes), caches)]
        for start in range(prompt, T, chunk):
            piece = x[:, start : start + chunk]
            pieces.append(_run(blocks, piece, DepthStream(n_layer * config.depth_writes), caches))
    assert caches[0].length == T
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)


def test_kv_cache_overflow():
    cache = KVCache(3)
    cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(ValueError, match="3 tokens"):
        cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(ValueError, match="max_len"):
        KVCache(0)


def test_checkpoint_round_trip_weights_only():
    config = BlockConfig(n_embd=16, n_head=4, n_kv_head=2, depth_kv="attn+ffn", norm="post")
    blocks = _stack(config, 2, dtype=torch.float32)
    buffer = io.BytesIO()
    torch.save({"config": dataclasses.asdict(config), "model": blocks.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    restored = torch.nn.ModuleList([Block(BlockConfig(**checkpoint["config"])) for _ in range(2)])
    restored.load_state_dict(checkpoint["model"])
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(_run(restored, x, DepthStream(4)), _run(blocks, x, DepthStream(4)))


def test_probabilities_are_the_softmax_the_layer_uses():
    torch.manual_seed(0)
    attn = MoDAAttention(16, 4, 2).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    stream = DepthStream(2)
    stream.append(torch.randn(1, 2, 6, 4, dtype=torch.float64), torch.randn(1, 2, 6, 4, dtype=torch.float64))
    probs = attn.probabilities(x, stream)
    assert probs.shape == (1, 4, 6, 6 + 1)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 4, 6, dtype=torch.float64))
    assert stream.count == 1  # nothing was written
    assert (probs[..., :6].triu(1) == 0).all()  # causal over the sequence part


def test_rope_keeps_relative_positions():
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(m, n):
        return (apply_rope(q, m) * apply_rope(k, n)).sum()

    torch.testing.assert_close(score(5, 5), (q * k).sum())
    torch.testing.assert_close(score(7, 3), score(14, 10))
    assert not math.isclose(score(7, 3).item(), score(3, 7).item())


def test_ffn_projection_appends_one_entry():
    proj = DepthKVProjection(16, 2, 4)
    stream = DepthStream(1)
    proj(torch.randn(3, 5, 16), stream, start=2)
    depth_k, depth_v = stream.read()
    assert depth_k.shape == depth_v.shape == (3, 2, 5, 1, 4)


def test_config_and_argument_errors():
    with pytest.raises(ValueError, match="depth_kv"):
        BlockConfig(depth_kv="ffn")
    with pytest.raises(ValueError, match="norm"):
        BlockConfig(norm="sandwich")
    with pytest.raises(ValueError, match="n_head % n_kv_head"):
        BlockConfig(n_embd=24, n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="even head size"):
        BlockConfig(n_embd=12, n_head=4, n_kv_head=2)
    with pytest.raises(ValueError, match="n_embd % n_head"):
        MoDAAttention(10, 4, 2)
    block = Block(BlockConfig(n_embd=16, n_head=2, n_kv_head=1, depth_kv="attn"))
    with pytest.raises(ValueError, match="needs a DepthStream"):
        block(torch.randn(1, 3, 16))
