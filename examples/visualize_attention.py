"""Heatmaps of a trained model's attention over ``[Sequence KV | Depth KV]``, and the mask it obeys.

    python examples/train_gpt.py
    python examples/visualize_attention.py --ckpt out/moda-pre.pt

Writes two PNGs:

- ``--out`` (default ``attention.png``): for uniformly sampled layers
  (columns) and heads (rows), each query token's attention weights over its
  layer's sequence keys, then over its own depth slots; a dashed line marks
  the boundary. Layer 0 has no depth slots yet.
- ``--mask-out`` (default ``mask.png``): the mask behind it, as the fused
  kernels see it: the G query heads that share a KV head folded into rows
  (row ``r`` is token ``r // G``), columns ``[sequence keys | depth slots of
  every token]`` (depth column ``j`` is slot ``j % L`` of token ``j // L``).

Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import load_text, split  # noqa: E402

from moda_flex import variants  # noqa: E402


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("visualize_attention.py needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_model(path: str) -> GPT:
    """A GPT from a checkpoint written by train_gpt.py (loaded with weights_only=True)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**checkpoint["config"]))
    model.load_state_dict(checkpoint["model"])
    return model.eval()


@torch.no_grad()
def attention_maps(model: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the weights (Hq, T, T + L_layer) over [sequence | depth] for the (1, T) tokens ``idx``."""
    maps = []

    def record(attn, args):
        x, depth = args[0], args[1]
        maps.append(attn.probabilities(x, depth)[0])  # (Hq, T, T + L)

    hooks = [block.attn.register_forward_pre_hook(record) for block in model.blocks]
    try:
        model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return maps


def plot_attention(maps: list[torch.Tensor], n_layers: int, n_heads: int, path: str) -> None:
    plt = _pyplot()
    layers = sorted({round(i * (len(maps) - 1) / max(1, n_layers - 1)) for i in range(n_layers)})
    heads = list(range(min(n_heads, maps[0].shape[0])))
    fig, axes = plt.subplots(
        len(heads), len(layers), figsize=(3.2 * len(layers), 2.8 * len(heads)), squeeze=False
    )
    for col, layer in enumerate(layers):
        weights = maps[layer]
        T = weights.shape[1]
        for row, head in enumerate(heads):
            ax = axes[row][col]
            ax.imshow(weights[head].float().numpy(), cmap="viridis", aspect="auto", interpolation="nearest")
            if weights.shape[2] > T:
                ax.axvline(T - 0.5, color="red", linestyle="--", linewidth=1.2)
            ax.set_title(f"layer {layer}, head {head}", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            if row == len(heads) - 1:
                ax.set_xlabel("Sequence KV | Depth KV" if weights.shape[2] > T else "Sequence KV", fontsize=8)
            if col == 0:
                ax.set_ylabel("query token", fontsize=8)
    fig.suptitle("MoDA attention: one softmax over sequence and depth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def folded_mask(variant, T: int, G: int, L: int) -> torch.Tensor:
    """(G*T, T + T*L) bool: the [sequence | depth] mask with query groups folded into rows."""
    row_token = torch.arange(G * T) // G  # (G*T,)
    q_pos = row_token.view(-1, 1)
    zero = torch.zeros((), dtype=torch.long)
    sequence = variant.sequence(zero, zero, q_pos, torch.arange(T).view(1, -1))  # (G*T, T)
    j = torch.arange(T * L).view(1, -1)
    depth = variant.depth_predicate(L)(zero, zero, q_pos, j // L, j % L)  # (G*T, T*L)
    return torch.cat([sequence.expand(G * T, T), depth.expand(G * T, T * L)], dim=1)


def plot_mask(mask: torch.Tensor, T: int, G: int, L: int, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.imshow(mask.numpy(), cmap="Blues", aspect="auto", interpolation="nearest")
    ax.axvline(T - 0.5, color="red", linestyle="--", linewidth=1.2)
    ax.set_xlabel(f"sequence keys (T={T}) | depth slots of every token (T*L={T * L})")
    ax.set_ylabel(f"query rows (T*G={T * G})")
    ax.set_title(f"causal MoDA mask, query groups folded (G={G}, L={L})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a checkpoint written by train_gpt.py")
    p.add_argument("--data", default=None, help="text to take the tokens from (default: pydoc topics)")
    p.add_argument("--tokens", type=int, default=48, help="query tokens shown")
    p.add_argument("--layers", type=int, default=4, help="layers sampled uniformly")
    p.add_argument("--heads", type=int, default=3, help="heads shown per layer")
    p.add_argument("--out", default="attention.png")
    p.add_argument("--mask-out", default="mask.png")
    p.add_argument("--mask-tokens", type=int, default=8, help="tokens in the mask picture")
    args = p.parse_args(argv)

    _pyplot()  # fail early, before any work, if matplotlib is missing
    model = load_model(args.ckpt)
    _, val = split(load_text(args.data))
    idx = val[: args.tokens].view(1, -1)
    plot_attention(attention_maps(model, idx), args.layers, args.heads, args.out)
    print(f"wrote {args.out}")

    config = model.config
    G = config.n_head // config.n_kv_head
    L = max(1, (config.n_layer - 1) * config.depth_writes)  # the last layer reads the most
    T = args.mask_tokens
    plot_mask(folded_mask(variants.resolve("causal"), T, G, L), T, G, L, args.mask_out)
    print(f"wrote {args.mask_out}")


if __name__ == "__main__":
    main()
