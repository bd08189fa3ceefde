"""Pictures of a variant's mask over ``[sequence | depth]``: text for the terminal, PNG with matplotlib.

Rows are queries, columns the sequence keys and then the depth slots, with the
boundary marked (``|`` in text, a dashed line in the PNG)::

    >>> print(mask_text(causal(), q_len=4, kv_len=6, slots=2))
    causal: Tq=4 Tk=6 L=2 G=1, query head 0; columns: key k | depth slot l (█ visible, · masked)
       p  012345|01
       2  ███···|██
       3  ████··|██
       4  █████·|██
       5  ██████|██

``folded=True`` shows the rows the flex and triton backends see: the ``G``
query heads of one KV head folded into rows, row ``r`` being token ``r // G``
of query head ``kv_head * G + r % G``.

Depth columns are the query's own ``L`` slots when the variant reads only its
own token's depth, else the chunk-packed depth of every query token
(column ``Tk + t * L + l`` is slot ``l`` of query token ``t``).

The predicates are evaluated densely over every (row, column) pair: for small
sizes only (at most :data:`MAX_CELLS` cells).

``python -m moda_flex.visualize`` prints every built-in at a small size
(``--png DIR`` also writes the PNGs).
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import variants as _variants
from .variants import Variant

__all__ = ["MAX_CELLS", "dense_mask", "mask_text", "plot_mask"]

MAX_CELLS = 1 << 20  # dense evaluation bound, rows * columns

VISIBLE, MASKED, BOUNDARY = "█", "·", "|"


def dense_mask(
    variant,
    *,
    q_len: int,
    kv_len: int,
    slots: int = 0,
    groups: int = 1,
    folded: bool = False,
    head: int = 0,
    kv_head: int = 0,
    batch: int = 0,
    packed: Optional[bool] = None,
) -> Tensor:
    """The variant's mask as a dense bool matrix, rows = queries.

    Args:
        variant: ``"causal"``, ``"full"`` or a :class:`~moda_flex.Variant`.
        q_len, kv_len: Tq <= Tk; query ``i`` sits at position ``Tk - Tq + i``.
        slots: L, depth slots per token.
        groups: G, query heads per KV head (the predicates see the query head).
        folded: rows ``r = t * G + g`` of KV head ``kv_head`` (the flex /
            triton view) instead of the Tq rows of query head ``head``.
        head: the query head shown when not folded, ``0 <= head``.
        kv_head: the KV head shown when folded.
        batch: the batch row (it matters for ``document``).
        packed: depth columns for every query token's slots (True), the
            query's own slots (False), or the latter whenever the variant
            reads only its own token's depth (None).

    Returns:
        (Tq, Tk + C) or, folded, (Tq * G, Tk + C) bool, with ``C = L`` or,
        packed, ``C = Tq * L``.
    """
    return _mask(
        _variants.resolve(variant), q_len, kv_len, slots, groups, folded, head, kv_head, batch, packed
    )[0]


def _mask(variant: Variant, q_len, kv_len, slots, groups, folded, head, kv_head, batch, packed):
    """``dense_mask`` and whether its depth columns are packed."""
    for name, value, least in (
        ("q_len", q_len, 1),
        ("kv_len", kv_len, 1),
        ("slots", slots, 0),
        ("groups", groups, 1),
        ("head", head, 0),
        ("kv_head", kv_head, 0),
        ("batch", batch, 0),
    ):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if q_len > kv_len:
        raise ValueError(f"q_len ({q_len}) must be at most kv_len ({kv_len})")
    rows = q_len * groups if folded else q_len
    widest = kv_len + q_len * slots
    if rows * widest > MAX_CELLS:
        raise ValueError(
            f"the picture would have {rows} x {widest} cells (q_len={q_len}, kv_len={kv_len}, slots={slots}, "
            f"groups={groups}); dense evaluation is for small sizes, at most {MAX_CELLS} cells"
        )

    if folded:
        r = torch.arange(rows)
        token = r // groups  # (rows,)
        q_head = kv_head * groups + r % groups  # (rows,)
    else:
        token = torch.arange(q_len)
        q_head = torch.full((q_len,), head)
    q_pos = kv_len - q_len + token  # (rows,) absolute positions
    b = torch.tensor(batch)

    k_pos = torch.arange(kv_len)
    sequence = variant.sequence(b, q_head[:, None], q_pos[:, None], k_pos[None, :])
    sequence = sequence.expand(rows, kv_len)  # (rows, Tk)

    # Every (query row, token whose depth, slot) triple: (rows, Tq, L).
    depth_fn = variant.depth_predicate(slots)
    d_pos = (kv_len - q_len + torch.arange(q_len)).view(1, q_len, 1)
    slot = torch.arange(slots).view(1, 1, slots)
    depth = depth_fn(b, q_head.view(rows, 1, 1), q_pos.view(rows, 1, 1), d_pos, slot)
    depth = depth.expand(rows, q_len, slots)

    reads_others = bool((depth & (token.view(rows, 1, 1) != torch.arange(q_len).view(1, q_len, 1))).any())
    if packed is None:
        packed = reads_others
    if packed:
        depth_columns = depth.reshape(rows, q_len * slots)  # (rows, Tq*L), (token, slot) order
    elif reads_others:
        raise ValueError(
            f"packed=False, but variant {variant.name!r} reads depth of other tokens; use packed=True or None"
        )
    else:
        depth_columns = depth[torch.arange(rows), token]  # (rows, L): the row's own token
    return torch.cat([sequence, depth_columns], dim=1).bool(), packed


def mask_text(
    variant,
    *,
    q_len: int,
    kv_len: int,
    slots: int = 0,
    groups: int = 1,
    folded: bool = False,
    head: int = 0,
    kv_head: int = 0,
    batch: int = 0,
    packed: Optional[bool] = None,
) -> str:
    """The mask as text: one line per query, ``█`` visible, ``·`` masked, ``|`` before the depth columns.

    Arguments as :func:`dense_mask`. Rows are labelled with the query's
    absolute position ``p`` (and, folded, the row ``r``).
    """
    variant = _variants.resolve(variant)
    mask, packed = _mask(variant, q_len, kv_len, slots, groups, folded, head, kv_head, batch, packed)
    rows = mask.shape[0]
    packed_note = ", depth of every query token" if packed else ""
    if folded:
        view = f"folded rows r = t * G + g of KV head {kv_head}"
        labels = [f"{r:>4} {kv_len - q_len + r // groups:>4}" for r in range(rows)]
        header = f"{'r':>4} {'p':>4}"
    else:
        view = f"query head {head}"
        labels = [f"{kv_len - q_len + i:>4}" for i in range(rows)]
        header = f"{'p':>4}"
    lines = [
        f"{variant.name}: Tq={q_len} Tk={kv_len} L={slots} G={groups}, {view}{packed_note}; "
        f"columns: key k {BOUNDARY} depth slot l ({VISIBLE} visible, {MASKED} masked)",
        f"{header}  {_digits(range(kv_len))}{BOUNDARY}{_digits(range(mask.shape[1] - kv_len), slots)}",
    ]
    for label, row in zip(labels, mask.tolist()):
        cells = [VISIBLE if seen else MASKED for seen in row]
        lines.append(f"{label}  {''.join(cells[:kv_len])}{BOUNDARY}{''.join(cells[kv_len:])}")
    return "\n".join(lines)


def _digits(columns: range, period: Optional[int] = None) -> str:
    """Column labels, last digit only: key positions, or depth slots (``period = L``)."""
    return "".join(str((c % period if period else c) % 10) for c in columns)


def plot_mask(
    variant,
    *,
    q_len: int,
    kv_len: int,
    slots: int = 0,
    groups: int = 1,
    folded: bool = False,
    head: int = 0,
    kv_head: int = 0,
    batch: int = 0,
    packed: Optional[bool] = None,
    path: Optional[str] = None,
    ax=None,
):
    """The mask as a matplotlib picture, the sequence/depth boundary a dashed line.

    Needs matplotlib (``pip install moda_flex[plot]``). Arguments as
    :func:`dense_mask`, plus:

    Args:
        path: if given, save the figure there (PNG for a ``.png`` name).
        ax: draw into this Axes instead of a new figure.

    Returns:
        the matplotlib ``Figure``.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:
        raise ImportError(
            "plot_mask needs matplotlib: pip install matplotlib (or moda_flex[plot]); "
            "mask_text draws the same mask without it"
        ) from error
    variant = _variants.resolve(variant)
    mask, packed = _mask(variant, q_len, kv_len, slots, groups, folded, head, kv_head, batch, packed)
    rows, columns = mask.shape
    if ax is None:
        figure = Figure(figsize=(max(4.0, 0.25 * columns + 1.5), max(3.0, 0.25 * rows + 1.2)))
        ax = figure.subplots()
    else:
        figure = ax.figure
    ax.imshow(mask.numpy(), cmap="Blues", vmin=0, vmax=1.25, interpolation="nearest", aspect="auto")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.axvline(kv_len - 0.5, color="black", linestyle="--", linewidth=1.2)
    ax.set_title(f"{variant.name}: Tq={q_len} Tk={kv_len} L={slots} G={groups}")
    ax.set_xlabel("sequence keys | depth slots")
    if folded:
        ax.set_ylabel(f"folded row r (token r // {groups}), KV head {kv_head}")
    else:
        ax.set_ylabel(f"query token (position - {kv_len - q_len}), head {head}")
    if path is not None:
        figure.savefig(path, dpi=120, bbox_inches="tight")
    return figure


def _builtin_examples(q_len: int, kv_len: int, slots: int) -> list:
    """One instance of every built-in, sized for a picture."""
    ids = torch.arange(kv_len) * 3 // kv_len  # three contiguous documents
    return [
        _variants.causal(),
        _variants.full(),
        _variants.sliding_window(max(1, kv_len // 3)),
        _variants.depth_window(max(1, slots // 2)),
        _variants.chunk_depth(max(1, kv_len // 3)),
        _variants.depth_only(),
        _variants.causal() & _variants.document(ids),
    ]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Print every built-in variant's mask; with ``--png DIR`` also save PNGs."""
    parser = argparse.ArgumentParser(prog="python -m moda_flex.visualize", description=main.__doc__)
    parser.add_argument("--q-len", type=int, default=6)
    parser.add_argument("--kv-len", type=int, default=9)
    parser.add_argument("--slots", type=int, default=3)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--folded", action="store_true", help="show the folded rows of the flex/triton backends")
    parser.add_argument("--png", metavar="DIR", help="also write one PNG per variant into DIR")
    args = parser.parse_args(argv)
    sizes = dict(q_len=args.q_len, kv_len=args.kv_len, slots=args.slots, groups=args.groups, folded=args.folded)
    for variant in _builtin_examples(args.q_len, args.kv_len, args.slots):
        print(mask_text(variant, **sizes), end="\n\n")
        if args.png:
            os.makedirs(args.png, exist_ok=True)
            name = "".join(c if c.isalnum() else "_" for c in variant.name).strip("_")
            plot_mask(variant, path=os.path.join(args.png, f"{name}.png"), **sizes)


if __name__ == "__main__":
    main()
