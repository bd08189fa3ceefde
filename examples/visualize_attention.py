"""Heatmaps of a trained model's attention over ``[Sequence KV | Depth KV]``, and the masks it obeys.

    python examples/train_gpt.py
    python examples/visualize_attention.py --ckpt out/pydoc-4x128/moda-pre.pt

Writes three PNGs beside the checkpoint (or into ``--out-dir``), named after
it (``moda-pre-attention.png`` and so on):

- ``-attention.png``: for uniformly sampled layers (columns) and heads (rows),
  each query token's attention weights over its layer's sequence keys, then
  over its own depth slots (numbered from 0 again); a dashed line marks the
  boundary, one colorbar serves every panel. Layer 0 has no depth slots yet.
- ``-mask.png``: the element mask of the last layer (the one that reads the
  most depth), as the fused kernels see it: the G query heads that share a
  KV head folded into rows (row ``r`` is token ``r // G``), columns
  ``[sequence keys | depth slots of every token]``, token after token.
- ``-block-mask.png``: the flex backend's real ``BlockMask`` for the same
  layout at ``--block-tokens`` tokens: which 128 x 128 blocks it computes in
  full, computes under the mask, or skips. Because the G heads of a token sit
  in adjacent rows and a token's L slots in adjacent columns, a block of rows
  reads one narrow band of depth columns (chunk- and group-aware layout).

Needs matplotlib (``pip install matplotlib``); ``python -m moda_flex.visualize``
prints the masks as text without it.
"""

from __future__ import annotations

from pathlib import Path

import torch

import cli
from gpt import GPT, load_checkpoint
from training import load_text, split

from moda_flex.visualize import MaskView


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "visualize_attention.py needs matplotlib: pip install matplotlib "
            "(python -m moda_flex.visualize prints the masks as text without it)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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


def _column_edges(T: int, L: int) -> torch.Tensor:
    """x edges of a panel's columns: keys one unit wide, depth slots wider, so that a few slots stay visible."""
    slot_width = max(1.0, T / (3 * L)) if L else 1.0
    widths = torch.cat([torch.ones(T), torch.full((L,), slot_width)])
    return torch.cat([torch.zeros(1), widths.cumsum(0)])  # (T + L + 1,)


def plot_attention(maps: list[torch.Tensor], n_layers: int, n_heads: int, path: Path) -> None:
    """A grid of heatmaps: sampled layers as columns, heads as rows, one shared colour scale."""
    plt = _pyplot()
    from matplotlib.colors import PowerNorm

    layers = sorted({round(i * (len(maps) - 1) / max(1, n_layers - 1)) for i in range(n_layers)})
    heads = list(range(min(n_heads, maps[0].shape[0])))
    # A square-root scale: most weights are small, and a linear one shows only the largest few.
    norm = PowerNorm(0.5, vmin=0.0, vmax=max(float(maps[layer][heads].max()) for layer in layers))
    fig, axes = plt.subplots(len(heads), len(layers), figsize=(3.4 * len(layers) + 1.2, 2.9 * len(heads)),
                             squeeze=False, layout="constrained")  # fmt: skip
    for col, layer in enumerate(layers):
        weights = maps[layer]  # (Hq, T, T + L)
        T = weights.shape[1]
        L = weights.shape[2] - T
        x = _column_edges(T, L)
        centers = (x[:-1] + x[1:]) / 2
        keys = list(range(0, T, max(1, T // 6)))
        slots = list(range(0, L, max(1, L // 4)))
        for row, head in enumerate(heads):
            ax = axes[row][col]
            image = ax.pcolormesh(x.numpy(), torch.arange(T + 1).numpy() - 0.5, weights[head].float().numpy(),
                                  cmap="viridis", norm=norm)  # fmt: skip
            ax.invert_yaxis()  # query 0 at the top, as in the mask pictures
            if L:
                ax.axvline(float(x[T]), color="red", linestyle="--", linewidth=1.2)
            ax.set_title(f"layer {layer}, head {head}" + (f", {L} depth slots" if L else ""), fontsize=9)
            ax.set_xticks([float(centers[c]) for c in keys] + [float(centers[T + s]) for s in slots],
                          [str(c) for c in keys] + [str(s) for s in slots], fontsize=7)  # fmt: skip
            query_ticks = range(0, T, max(1, T // 6))
            ax.set_yticks(query_ticks, [str(t) for t in query_ticks], fontsize=7)
            if row == len(heads) - 1:
                ax.set_xlabel("sequence key | depth slot" if L else "sequence key", fontsize=8)
            if col == 0:
                ax.set_ylabel("query position", fontsize=8)
    fig.suptitle("MoDA attention: one softmax over sequence and depth")
    fig.colorbar(image, ax=axes, label="attention weight (square-root scale)", shrink=0.9)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mask_views(config, mask_tokens: int, block_tokens: int) -> tuple[MaskView, MaskView]:
    """The two mask pictures: the last layer's elements as the fused kernels see them, and its flex BlockMask.

    The last layer reads the most depth: ``(n_layer - 1) * depth_writes`` slots.
    """
    G = config.n_head // config.n_kv_head
    L = (config.n_layer - 1) * config.depth_writes
    elements = MaskView("causal", q_len=mask_tokens, kv_len=mask_tokens, slots=L, groups=G, folded=True, packed=True)
    blocks = MaskView("causal", q_len=block_tokens, kv_len=block_tokens, slots=L, groups=G)
    return elements, blocks


def main(argv=None) -> list[Path]:
    """Write the three PNGs; returns their paths."""
    p = cli.parser(__doc__)
    p.add_argument("--ckpt", required=True, help="a checkpoint written by train_gpt.py")
    p.add_argument("--data", default=None, help="text to take the tokens from (default: pydoc topics)")
    p.add_argument("--tokens", type=cli.at_least(1), default=48, help="query tokens shown")
    p.add_argument("--layers", type=cli.at_least(1), default=4, help="layers sampled uniformly")
    p.add_argument("--heads", type=cli.at_least(1), default=3, help="heads shown per layer")
    p.add_argument("--mask-tokens", type=cli.at_least(1), default=8, help="tokens in the element-mask picture")
    p.add_argument("--block-tokens", type=cli.at_least(1), default=512, help="tokens in the BlockMask picture")
    p.add_argument("--out-dir", help="where the PNGs go (default: the checkpoint's folder)")
    args = p.parse_args(argv)
    if not Path(args.ckpt).is_file():
        p.error(f"--ckpt {args.ckpt}: no such file")
    if args.data is not None and not Path(args.data).is_file():
        p.error(f"--data {args.data}: no such file")

    _pyplot()  # fail early, before any work, if matplotlib is missing
    model = load_checkpoint(args.ckpt)
    if args.tokens > model.config.block_size:
        p.error(f"--tokens {args.tokens}: the model was trained on {model.config.block_size} tokens at most")
    out_dir = Path(args.out_dir) if args.out_dir is not None else Path(args.ckpt).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(args.ckpt).stem
    paths = [out_dir / f"{stem}-{kind}.png" for kind in ("attention", "mask", "block-mask")]

    _, val = split(load_text(args.data))
    idx = val[: args.tokens].view(1, -1)
    plot_attention(attention_maps(model, idx), args.layers, args.heads, paths[0])

    elements, blocks = mask_views(model.config, args.mask_tokens, args.block_tokens)
    elements.plot(path=str(paths[1]))
    blocks.plot_blocks(path=str(paths[2]))
    for path in paths:
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    main()
