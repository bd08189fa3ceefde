"""Heatmaps of a trained model's attention over ``[Sequence KV | Depth KV]``, and the masks it obeys.

    python examples/train_gpt.py
    python examples/visualize_attention.py --ckpt out/pydoc-4x128/moda-pre.pt

Writes three PNGs beside the checkpoint (or into ``--out-dir``), named after
it (``moda-pre-attention.png`` and so on):

- ``-attention.png``: for uniformly sampled layers (columns) and the first
  ``--heads`` query heads (rows; the title says which), each query token's
  attention weights over its layer's sequence keys, then over its own depth
  entries, each labelled with the layer that wrote it and whether that
  layer's attention or FFN did (``layer 1 FFN``). Every column is one unit
  wide, keys and entries alike; a dashed line marks the boundary. The colour
  is the square root of the weight (most weights are small), one colourbar,
  in weights, serves every panel. Layer 0 has no depth entries yet.
- ``-mask.png``: the element mask of the last layer (the one that reads the
  most depth), as the fused kernels see it: the G query heads that share a
  KV head folded into rows (each labelled with its token and head), columns
  ``[sequence keys | depth slots of every token]``, token after token, each
  token's group named above the picture.
- ``-block-mask.png``: the flex backend's real ``BlockMask`` for the same
  layout at ``--block-tokens`` tokens: which 128 x 128 blocks it computes in
  full, computes under the mask, or skips. Because the G heads of a token sit
  in adjacent rows and a token's L slots in adjacent columns, a block of rows
  reads one narrow band of depth columns (chunk- and group-aware layout).

Needs matplotlib, from the plot extra (pip install -e ".[plot]"); ``python -m
moda_flex.visualize`` prints the masks as text without it.
"""

from __future__ import annotations

from pathlib import Path

import torch

import cli
from gpt import GPT, load_checkpoint
from training import load_text, split

from moda_flex.visualize import MaskView

COLUMN_INCHES = 0.1  # one key or depth column in the attention picture: wide enough for its label, upright


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


def depth_writers(config, slots: int) -> list[str]:
    """Who wrote each of the first ``slots`` depth entries a layer reads: ``"layer 0 attn"``, ``"layer 0 FFN"``, ...

    Each block appends its attention's entry and then (``depth_kv="attn+ffn"``)
    its FFN's, so entry ``l`` comes from layer ``l // writes``.
    """
    kinds = ("attn", "FFN")[: config.depth_writes]
    return [f"layer {slot // len(kinds)} {kinds[slot % len(kinds)]}" for slot in range(slots)]


def _span(shown: list[int], total: int) -> str:
    """``"heads 0-2 of 4"``, ``"head 0 of 4"`` or ``"all 4 heads"`` for the consecutive heads ``shown``."""
    if len(shown) == total:
        return f"all {total} heads"
    if len(shown) == 1:
        return f"head {shown[0]} of {total}"
    return f"heads {shown[0]}-{shown[-1]} of {total}"


def plot_attention(maps: list[torch.Tensor], config, n_layers: int, n_heads: int, path: Path | None = None):
    """A grid of heatmaps: sampled layers as columns, query heads as rows, one shared colour scale.

    Every column of every panel is one unit wide, keys and depth entries
    alike; each depth column is labelled with the layer and the block part
    (attention or FFN) that wrote it.

    Args:
        maps: per layer, (Hq, T, T + L_layer) weights, from :func:`attention_maps`.
        config: the model's config (its depth writes name the entries).
        n_layers, n_heads: how many layers (sampled uniformly) and heads (the first ones) to show.
        path: where the PNG goes, if given.

    Returns:
        the matplotlib ``Figure``.
    """
    from matplotlib.colors import PowerNorm
    from matplotlib.figure import Figure

    layers = sorted({round(i * (len(maps) - 1) / max(1, n_layers - 1)) for i in range(n_layers)})
    heads = list(range(min(n_heads, maps[0].shape[0])))
    T = maps[0].shape[1]
    widths = [maps[layer].shape[2] for layer in layers]  # T + L of each sampled layer
    # A square-root scale: most weights are small, and a linear one shows only the largest few.
    norm = PowerNorm(0.5, vmin=0.0, vmax=max(float(maps[layer][heads].max()) for layer in layers))
    # Within a panel every column is COLUMN_INCHES wide; a narrow panel is widened whole, for its title.
    panel_inches = [max(3.0, COLUMN_INCHES * width) for width in widths]
    size = (max(8.0, sum(panel_inches) + 2.5), max(2.0, 0.07 * T) * len(heads) + 2.4)  # inches
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(len(heads), len(layers), sharex="col", squeeze=False, width_ratios=panel_inches)
    for col, layer in enumerate(layers):
        for row, head in enumerate(heads):
            image = _panel(axes[row][col], maps[layer][head], depth_writers(config, widths[col] - T), norm, layer, head)
        axes[-1][col].set_xlabel("sequence key | depth entry (who wrote it)" if widths[col] > T else "sequence key",
                                 fontsize=8)  # fmt: skip
    for row in axes:
        row[0].set_ylabel("query token", fontsize=8)
    fig.suptitle(
        "MoDA attention: one softmax over a layer's sequence keys and the depth entries earlier layers wrote\n"
        f"rows: query {_span(heads, maps[0].shape[0])}; columns: layers {', '.join(map(str, layers))} of {len(maps)}\n"
        "colour: sqrt(attention weight), the colourbar in weights",
        fontsize=10,
    )
    fig.colorbar(image, ax=axes, label="attention weight (colour: sqrt(weight))", shrink=0.9)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _panel(ax, weights: torch.Tensor, writers: list[str], norm, layer: int, head: int):
    """One layer's and head's (T, T + L) weights, keys then depth entries, the boundary dashed; returns the image."""
    T, L = weights.shape[0], len(writers)
    image = ax.imshow(weights.float().numpy(), cmap="viridis", norm=norm, aspect="auto", interpolation="nearest")
    keys = list(range(0, T, max(1, T // 6)))
    ax.set_xticks(keys + list(range(T, T + L)), [str(k) for k in keys] + writers, fontsize=7)
    for label in ax.get_xticklabels()[len(keys):]:
        label.set_rotation(90)
    queries = range(0, T, max(1, T // 6))
    ax.set_yticks(queries, [str(t) for t in queries], fontsize=7)
    if L:
        ax.axvline(T - 0.5, color="red", linestyle="--", linewidth=1.2)
        ax.set_title(f"layer {layer}, head {head}\n{T} keys | {L} depth entries", fontsize=9)
    else:
        ax.set_title(f"layer {layer}, head {head}\n{T} keys, no depth entries yet", fontsize=9)
    return image


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
    p.add_argument("--tokens", type=cli.at_least(1), default=32, help="query tokens shown")
    p.add_argument("--layers", type=cli.at_least(1), default=4, help="layers sampled uniformly")
    p.add_argument("--heads", type=cli.at_least(1), default=3, help="query heads shown per layer, the first ones")
    p.add_argument("--mask-tokens", type=cli.at_least(1), default=8, help="tokens in the element-mask picture")
    p.add_argument("--block-tokens", type=cli.at_least(1), default=512, help="tokens in the BlockMask picture")
    p.add_argument("--out-dir", help="where the PNGs go (default: the checkpoint's folder)")
    args = p.parse_args(argv)
    cli.require_extra(p, "matplotlib", "plot")  # before any work
    if not Path(args.ckpt).is_file():
        p.error(f"--ckpt {args.ckpt}: no such file")
    if args.data is not None and not Path(args.data).is_file():
        p.error(f"--data {args.data}: no such file")

    model = load_checkpoint(args.ckpt)
    if args.tokens > model.config.block_size:
        p.error(f"--tokens {args.tokens}: the model was trained on {model.config.block_size} tokens at most")
    out_dir = Path(args.out_dir) if args.out_dir is not None else Path(args.ckpt).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(args.ckpt).stem
    paths = [out_dir / f"{stem}-{kind}.png" for kind in ("attention", "mask", "block-mask")]

    _, val = split(load_text(args.data))
    idx = val[: args.tokens].view(1, -1)
    plot_attention(attention_maps(model, idx), model.config, args.layers, args.heads, paths[0])

    elements, blocks = mask_views(model.config, args.mask_tokens, args.block_tokens)
    elements.plot(path=str(paths[1]))
    blocks.plot_blocks(path=str(paths[2]))
    for path in paths:
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    main()
