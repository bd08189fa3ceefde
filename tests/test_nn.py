"""moda_flex.nn: blocks against the reference path, decoding, checkpointing, saved weights."""

import dataclasses
import io
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moda_flex.nn import (
    Block,
    BlockConfig,
    DepthKVProjection,
    DepthStream,
    KVCache,
    MoDAAttention,
    RotaryEmbedding,
    apply_rope,
)


# --- blocks -----------------------------------------------------------------


def _stack(config: BlockConfig, n_layer: int, seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList([Block(config, ffn_depth=i < n_layer - 1) for i in range(n_layer)]).to(dtype)
    for p in blocks.parameters():  # away from the identity init of the norms
        p.data.add_(0.1 * torch.randn_like(p))
    return blocks


def _run(blocks, x, caches=None, checkpointed=False):
    stream = DepthStream()
    for i, block in enumerate(blocks):
        if checkpointed:
            x, stream = checkpoint(block, x, stream, use_reentrant=False)
        else:
            x, stream = block(x, stream, caches[i] if caches is not None else None)
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
    """The layers' path (SDPA where no depth, auto elsewhere) against the reference backend everywhere."""
    n_layer, B, T = 3, 2, 7
    fast = _stack(config, n_layer)
    slow = _stack(dataclasses.replace(config, backend="reference"), n_layer)
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(B, T, config.n_embd, dtype=torch.float64, requires_grad=True)

    out = _run(fast, x)
    grads = torch.autograd.grad(out.sin().sum(), [x, *fast.parameters()])
    expected = _run(slow, x)
    expected_grads = torch.autograd.grad(expected.sin().sum(), [x, *slow.parameters()])

    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    names = ["x"] + [name for name, _ in fast.named_parameters()]
    for name, got, want in zip(names, grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("config", CONFIGS[1:3], ids=CONFIG_IDS[1:3])
def test_checkpointed_blocks_equal_plain_ones(config):
    blocks = _stack(config, 3)
    x = torch.randn(2, 5, config.n_embd, dtype=torch.float64, requires_grad=True)
    plain = _run(blocks, x)
    grads = torch.autograd.grad(plain.sin().sum(), [x, *blocks.parameters()])
    again = _run(blocks, x, checkpointed=True)
    again_grads = torch.autograd.grad(again.sin().sum(), [x, *blocks.parameters()])
    torch.testing.assert_close(again, plain, rtol=0, atol=0)
    for got, want in zip(again_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_depth_is_read_and_the_ffn_projection_learns():
    config = BlockConfig(n_embd=16, n_head=2, n_kv_head=1, depth_kv="attn+ffn")
    blocks = _stack(config, 2)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    out = _run(blocks, x)
    out.sum().backward()
    assert blocks[0].ffn_kv.kv_proj.weight.grad.abs().sum() > 0
    assert blocks[1].ffn_kv is None  # the last block writes no FFN entry: nothing would read it
    assert all(p.grad is not None for p in blocks.parameters())
    with torch.no_grad():
        blocks[0].ffn_kv.kv_proj.weight.zero_()
        assert not torch.allclose(_run(blocks, x), out)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("chunk", [1, 3], ids=["decode", "chunked"])
def test_decode_with_cache_matches_full_forward(config, chunk):
    n_layer, B, T, prompt = 3, 2, 9, 4
    blocks = _stack(config, n_layer).eval()
    x = torch.randn(B, T, config.n_embd, dtype=torch.float64)
    with torch.no_grad():
        full = _run(blocks, x)
        caches = [KVCache(T) for _ in blocks]
        pieces = [_run(blocks, x[:, :prompt], caches)]
        for start in range(prompt, T, chunk):
            pieces.append(_run(blocks, x[:, start : start + chunk], caches))
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
    saved = torch.load(buffer, weights_only=True)
    restored = torch.nn.ModuleList(
        [Block(BlockConfig(**saved["config"]), ffn_depth=i < 1) for i in range(2)]
    )
    restored.load_state_dict(saved["model"])
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(_run(restored, x), _run(blocks, x))


def test_probabilities_are_the_softmax_the_layer_uses():
    torch.manual_seed(0)
    attn = MoDAAttention(16, 4, 2).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    stream = DepthStream().append(
        torch.randn(1, 2, 6, 4, dtype=torch.float64), torch.randn(1, 2, 6, 4, dtype=torch.float64)
    )
    probs = attn.probabilities(x, stream)
    assert probs.shape == (1, 4, 6, 6 + 1)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 4, 6, dtype=torch.float64))
    assert (probs[..., :6].triu(1) == 0).all()  # causal over the sequence part


def test_rope_keeps_relative_positions():
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(m, n):
        return (apply_rope(q, m) * apply_rope(k, n)).sum()

    torch.testing.assert_close(score(5, 5), (q * k).sum())
    torch.testing.assert_close(score(7, 3), score(14, 10))
    assert not math.isclose(score(7, 3).item(), score(3, 7).item())


def test_rope_turns_dimension_i_with_i_plus_half_by_the_position_times_its_frequency():
    """GPT-NeoX layout: the pair (i, i + D/2) turns by ``position * base ** (-2 i / D)``, the others stay."""
    D, start, base = 8, 3, 100.0
    x = torch.eye(D, dtype=torch.float64).view(1, 1, D, D)  # head h holds the unit vector of dimension h
    rotated = apply_rope(x, start, base).view(D, D).float()
    for i in range(D // 2):
        angle = torch.tensor(start * base ** (-2 * i / D))
        cos, sin = angle.cos().item(), angle.sin().item()
        first, second = torch.zeros(D), torch.zeros(D)
        first[i], first[i + D // 2] = cos, sin
        second[i], second[i + D // 2] = -sin, cos
        torch.testing.assert_close(rotated[i], first)
        torch.testing.assert_close(rotated[i + D // 2], second)


@pytest.mark.parametrize("start", [0, 4, 6, 12])  # inside the table, at its end, across it, past it
def test_rotary_embedding_rotates_as_apply_rope_inside_and_past_its_table(start):
    x = torch.randn(2, 5, 3, 8)
    rotary = RotaryEmbedding(8, base=100.0, positions=9)
    torch.testing.assert_close(rotary(x, start), apply_rope(x, start, 100.0), rtol=0, atol=0)


def test_a_blocks_layers_share_one_rotation_table_and_blocks_may_share_theirs():
    config = BlockConfig(n_embd=16, n_head=4, n_kv_head=2, depth_kv="attn+ffn")
    block = Block(config)
    assert block.attn.rotary is block.ffn_kv.rotary is not None
    shared = RotaryEmbedding(4)
    blocks = [Block(config, rotary=shared) for _ in range(2)]
    assert all(b.attn.rotary is b.ffn_kv.rotary is shared for b in blocks)
    assert not any("rotary" in key for key in block.state_dict())  # the table is made, never saved
    assert Block(dataclasses.replace(config, rope=False)).attn.rotary is None


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MoDAAttention(16, 4, 2, rotary=RotaryEmbedding(8)), "head_dim=8"),
        (lambda: DepthKVProjection(16, 2, 4, rope_base=500.0, rotary=RotaryEmbedding(4)), "rope_base=500.0"),
        (lambda: MoDAAttention(16, 4, 2, rope=False, rotary=RotaryEmbedding(4)), "rope=False"),
        (lambda: RotaryEmbedding(5), "head_dim"),
    ],
)
def test_a_rotation_table_that_does_not_fit_the_layer_is_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_ffn_projection_appends_one_entry():
    proj = DepthKVProjection(16, 2, 4)
    stream = proj(torch.randn(3, 5, 16), DepthStream(), start=2)
    depth_k, depth_v = stream.read()
    assert len(depth_k) == len(depth_v) == 1
    assert depth_k[0].shape == depth_v[0].shape == (3, 2, 5, 4)


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


def test_a_layers_queries_and_keys_are_views_with_heads_after_tokens_as_the_projections_lay_them_out():
    """No transpose between the projection and the attention: q, k and v (B, H, T, D) keep the (B, T, H, D)
    order of memory, so compiled, the norm and the rotation run over rows as they lie."""
    attn = MoDAAttention(32, 4, 2)
    q, k, v = attn._project(torch.randn(2, 5, 32), 0)
    for t, heads in ((q, 4), (k, 2), (v, 2)):
        assert t.shape == (2, heads, 5, 8)
        assert t.stride(1) == 8 and t.stride(2) % (heads * 8) == 0  # a token's heads lie together
