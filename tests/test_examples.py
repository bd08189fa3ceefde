"""The examples: the GPT's cached decoding, a tiny training run, and the heatmaps from its checkpoint."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_gpt  # noqa: E402
import visualize_attention  # noqa: E402
from gpt import GPT, GPTConfig, load_checkpoint  # noqa: E402

from moda_flex.nn import KVCache  # noqa: E402
from moda_flex.visualize import dense_mask  # noqa: E402


def _model(depth_kv, norm, rope=True):
    torch.manual_seed(0)
    config = GPTConfig(
        n_embd=16, n_head=4, n_kv_head=2, depth_kv=depth_kv, norm=norm, rope=rope, vocab_size=32, block_size=16, n_layer=3
    )
    return GPT(config).double().eval()


@pytest.mark.parametrize(
    "depth_kv,norm,rope",
    [("none", "pre", True), ("attn", "post", True), ("attn+ffn", "post", True), ("attn+ffn", "pre", False)],
    ids=["baseline-pre", "attn-post", "ffn-post", "ffn-pre-wpe"],
)
def test_cached_decoding_gives_the_full_forward_logits(depth_kv, norm, rope):
    model = _model(depth_kv, norm, rope)
    idx = torch.randint(0, 32, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(idx)
        caches = [KVCache(idx.shape[1]) for _ in model.blocks]
        steps = [model(idx[:, :5], caches=caches)[0]]
        steps += [model(idx[:, t : t + 1], caches=caches)[0] for t in range(5, idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)

    prompt = idx[:, :4]
    torch.manual_seed(2)
    cached = model.generate(prompt, 8, top_k=1)
    torch.manual_seed(2)
    uncached = model.generate(prompt, 8, top_k=1, use_cache=False)
    assert torch.equal(cached, uncached)
    assert cached.shape == (2, 12)


def test_train_compare_checkpoint_and_heatmaps(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    rows = train_gpt.main(
        ["--data", str(data), "--depth-kv", "none,attn,attn+ffn", "--norm", "post", "--n-layer", "2",
         "--n-embd", "16", "--n-head", "2", "--n-kv-head", "1", "--block-size", "16", "--batch-size", "4",
         "--steps", "4", "--skip-timing", "1", "--warmup", "2", "--eval-iters", "2", "--sample-tokens", "8",
         "--threads", "1", "--out-dir", str(tmp_path / "out")]
    )  # fmt: skip
    assert [r["name"] for r in rows] == ["baseline-post", "moda-attn-post", "moda-post"]
    assert rows[0]["params_m"] == rows[1]["params_m"] < rows[2]["params_m"]  # only FFN KV adds weights
    assert all(0 < r["val_loss"] < 10 for r in rows)
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| moda-post |" in table and table in capsys.readouterr().out

    ckpt = tmp_path / "out" / "moda-post.pt"
    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint["config"]["depth_kv"] == "attn+ffn"
    model = load_checkpoint(str(ckpt))
    idx = torch.randint(0, 256, (1, 6))
    maps = visualize_attention.attention_maps(model, idx)
    assert [m.shape for m in maps] == [(2, 6, 6), (2, 6, 6 + 2)]
    torch.testing.assert_close(maps[1].sum(-1), torch.ones(2, 6))

    pytest.importorskip("matplotlib")
    paths = visualize_attention.main(["--ckpt", str(ckpt), "--data", str(data), "--tokens", "12",
                                      "--block-tokens", "128"])  # fmt: skip
    assert [path.name for path in paths] == ["moda-post-attention.png", "moda-post-mask.png", "moda-post-block-mask.png"]
    for png in paths:
        assert png.parent == ckpt.parent and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.splitlines()[-3:] == [f"wrote {path}" for path in paths]


def test_folded_mask_matches_the_paper():
    # The mask of visualize_attention's picture: query groups folded into rows, every token's depth.
    T, G, L = 3, 2, 2
    mask = dense_mask("causal", q_len=T, kv_len=T, slots=L, groups=G, folded=True, packed=True)
    assert mask.shape == (G * T, T + T * L)
    for r in range(G * T):
        for k in range(T):
            assert mask[r, k] == (r // G >= k)  # grouped causal mask
        for j in range(T * L):
            assert mask[r, T + j] == (r // G == j // L)  # base-time depth mask


def test_bad_flags_are_rejected():
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--depth-kv", "none,ffn"])
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--norm", "sandwich"])
