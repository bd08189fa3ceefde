"""Pictures of a variant's mask over ``[sequence | depth]``: text for the terminal, PNG with matplotlib.

Rows are queries, columns the sequence keys and then the depth slots, with the
boundary marked (``|`` in text, a dashed line in the PNG)::

    >>> print(MaskView(causal(), q_len=4, kv_len=6, slots=2).text())
    causal: Tq=4 Tk=6 L=2 G=1, query head 0; columns: key k | depth slot l (█ visible, · masked)
    Tq < Tk, bottom-right aligned: query i sits at position Tk - Tq + i = 2 + i, so rows start at 2
       p  012345|01
       2  ███···|██
       3  ████··|██
       4  █████·|██
       5  ██████|██

``folded=True`` shows the rows the flex and triton backends see: the ``G``
query heads of one KV head folded into rows, row ``r`` being token ``r // G``
of query head ``kv_head * G + r % G`` (each row labelled with its token and head).

Depth columns are the query's own ``L`` slots when the variant reads only its
own token's depth, else the chunk-packed depth of every query token
(column ``Tk + t * L + l`` is slot ``l`` of query token ``t``).

The predicates are evaluated densely over every (row, column) pair: for small
sizes only (at most :data:`MAX_CELLS` cells).

:meth:`MaskView.blocks` (text: :meth:`~MaskView.blocks_text`, PNG:
:meth:`~MaskView.plot_blocks`) shows instead the flex backend's real
``BlockMask`` at any size: which 128 x 128 blocks of folded rows and
``[sequence | depth]`` columns are computed in full, computed with the mask,
or skipped.

Command line::

    python -m moda_flex.visualize                                   # every built-in, as text
    python -m moda_flex.visualize causal chunk_depth --png masks    # two of them, text and PNGs
    python -m moda_flex.visualize examples/custom_variant.py:attention_slots_only
    python -m moda_flex.visualize causal --blocks --q-len 512 --kv-len 512 --slots 16 --groups 8

A variant is a built-in's name (:data:`moda_flex.variants.BUILTINS`) or ``module:attribute`` (a
module name or a ``.py`` file), where the attribute is a :class:`~moda_flex.Variant` or a function
of no arguments that returns one. The built-ins without an argument are the names
``moda_attention(variant=...)`` accepts too; for one with an argument the picture fills in a demo
value (``sliding_window``: a third of the keys), where a call needs ``moda_flex.sliding_window(window)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from .variants import BUILTINS, Variant, resolve

__all__ = ["MAX_CELLS", "MaskView", "load_variant"]

MAX_CELLS = 1 << 20  # dense evaluation bound, rows * columns

VISIBLE, MASKED, BOUNDARY = "█", "·", "|"

# Block kinds of a BlockMask grid, and how text and pictures draw them.
SKIPPED, PARTIAL, FULL = 0, 1, 2
BLOCK_CHARS = {SKIPPED: "·", PARTIAL: "▒", FULL: "█"}
BLOCK_NAMES = {SKIPPED: "skipped", PARTIAL: "partial: the mask is applied", FULL: "full: computed, no mask"}


@dataclasses.dataclass(frozen=True)
class MaskView:
    """One view of a variant's mask: its sizes, and which rows and depth columns are shown.

    Pictures of elements (:meth:`dense`, :meth:`text`, :meth:`plot`) evaluate
    the predicates densely, for small sizes only (at most :data:`MAX_CELLS`
    cells); pictures of blocks (:meth:`blocks`, :meth:`blocks_text`,
    :meth:`plot_blocks`) show the flex backend's real ``BlockMask`` at any
    size, in its own layout (folded rows, every token's depth).

    Attributes:
        variant: a name of :data:`moda_flex.variants.NAMED` (``"causal"``,
            ``"full"``, ``"depth_only"``) or a :class:`~moda_flex.Variant`.
        q_len, kv_len: Tq <= Tk; query ``i`` sits at position ``Tk - Tq + i``.
        slots: L, depth slots per token.
        groups: G, query heads per KV head (the predicates see the query head).
        folded: rows ``r = t * G + g`` of KV head ``kv_head`` (the flex /
            triton view) instead of the Tq rows of query head ``head``.
        head: the query head shown when not folded.
        kv_head: the KV head shown when folded.
        batch: the batch row (it matters for ``document``).
        packed: depth columns for every query token's slots (True), the
            query's own slots (False), or the latter whenever the variant
            reads only its own token's depth (None).

    Raises:
        ValueError: naming a size that is not an int in range, or ``q_len > kv_len``.
    """

    variant: Union[str, Variant]
    _: dataclasses.KW_ONLY
    q_len: int
    kv_len: int
    slots: int = 0
    groups: int = 1
    folded: bool = False
    head: int = 0
    kv_head: int = 0
    batch: int = 0
    packed: Optional[bool] = None

    def __post_init__(self):
        object.__setattr__(self, "variant", resolve(self.variant))
        for name, least in (
            ("q_len", 1), ("kv_len", 1), ("slots", 0), ("groups", 1), ("head", 0), ("kv_head", 0), ("batch", 0)
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if self.q_len > self.kv_len:
            raise ValueError(f"q_len ({self.q_len}) must be at most kv_len ({self.kv_len})")

    @property
    def rows(self) -> int:
        """Rows shown: Tq, or Tq * G folded."""
        return self.q_len * self.groups if self.folded else self.q_len

    def dense(self) -> Tensor:
        """The mask as a dense bool matrix, rows = queries.

        Returns:
            (Tq, Tk + C) or, folded, (Tq * G, Tk + C) bool, with ``C = L`` or,
            packed, ``C = Tq * L``.
        """
        return self._dense()[0]

    def _dense(self) -> tuple[Tensor, bool]:
        """:meth:`dense` and whether its depth columns are packed."""
        q_len, kv_len, slots, groups, rows = self.q_len, self.kv_len, self.slots, self.groups, self.rows
        widest = kv_len + q_len * slots
        if rows * widest > MAX_CELLS:
            raise ValueError(
                f"the picture would have {rows} x {widest} cells (q_len={q_len}, kv_len={kv_len}, slots={slots}, "
                f"groups={groups}); dense evaluation is for small sizes, at most {MAX_CELLS} cells"
            )
        if self.folded:
            r = torch.arange(rows)
            token = r // groups  # (rows,)
            q_head = self.kv_head * groups + r % groups  # (rows,)
        else:
            token = torch.arange(q_len)
            q_head = torch.full((q_len,), self.head)
        q_pos = kv_len - q_len + token  # (rows,) absolute positions
        b = torch.tensor(self.batch)

        k_pos = torch.arange(kv_len)
        sequence = self.variant.sequence(b, q_head[:, None], q_pos[:, None], k_pos[None, :])
        sequence = sequence.expand(rows, kv_len)  # (rows, Tk)

        # Every (query row, token whose depth, slot) triple: (rows, Tq, L).
        depth_fn = self.variant.depth_predicate(slots)
        d_pos = (kv_len - q_len + torch.arange(q_len)).view(1, q_len, 1)
        slot = torch.arange(slots).view(1, 1, slots)
        depth = depth_fn(b, q_head.view(rows, 1, 1), q_pos.view(rows, 1, 1), d_pos, slot)
        depth = depth.expand(rows, q_len, slots)

        reads_others = bool((depth & (token.view(rows, 1, 1) != torch.arange(q_len).view(1, q_len, 1))).any())
        packed = reads_others if self.packed is None else self.packed
        if packed:
            depth_columns = depth.reshape(rows, q_len * slots)  # (rows, Tq*L), (token, slot) order
        elif reads_others:
            raise ValueError(
                f"packed=False, but variant {self.variant.name!r} reads depth of other tokens; use packed=True or None"
            )
        else:
            depth_columns = depth[torch.arange(rows), token]  # (rows, L): the row's own token
        return torch.cat([sequence, depth_columns], dim=1).bool(), packed

    def text(self) -> str:
        """The mask as text: one line per query, ``█`` visible, ``·`` masked, ``|`` before the depth columns.

        Rows are labelled with the query's absolute position ``p`` (and,
        folded, its query head ``h``); with ``Tq < Tk`` a line under the title
        says why the rows start at ``Tk - Tq``.
        """
        mask, packed = self._dense()
        kv_len = self.kv_len
        packed_note = ", depth of every query token" if packed else ""
        if self.folded:
            view = f"rows: query token p and head h (the {self.groups} heads of KV head {self.kv_head} folded)"
            labels = [f"{p:>4} {h:>4}" for p, h in self._rows()]
            header = f"{'p':>4} {'h':>4}"
        else:
            view = f"query head {self.head}"
            labels = [f"{p:>4}" for p, _ in self._rows()]
            header = f"{'p':>4}"
        lines = [
            f"{self._title()}, {view}{packed_note}; "
            f"columns: key k {BOUNDARY} depth slot l ({VISIBLE} visible, {MASKED} masked)",
            *([self._alignment()] if self.q_len < kv_len else []),
            f"{header}  {_digits(range(kv_len))}{BOUNDARY}{_digits(range(mask.shape[1] - kv_len), self.slots)}",
        ]
        for label, row in zip(labels, mask.tolist()):
            cells = [VISIBLE if seen else MASKED for seen in row]
            lines.append(f"{label}  {''.join(cells[:kv_len])}{BOUNDARY}{''.join(cells[kv_len:])}")
        return "\n".join(lines)

    def plot(self, path: Optional[str] = None, ax=None):
        """The mask as a matplotlib picture, the sequence/depth boundary a dashed line.

        Rows are labelled in words (``token 4``, folded ``token 4, head 1``);
        columns by key position, then by depth slot from 0 again, with the
        token whose depth they are named above the picture (``depth of token
        4`` when packed). With ``Tq < Tk`` the title says why the rows start at
        position ``Tk - Tq``. Needs matplotlib (``pip install moda_flex[plot]``).

        Args:
            path: if given, save the figure there (PNG for a ``.png`` name).
            ax: draw into this Axes instead of a new figure.

        Returns:
            the matplotlib ``Figure``.
        """
        Figure, Patch, _ = _matplotlib("MaskView.plot", "MaskView.text")
        mask, packed = self._dense()
        kv_len, slots = self.kv_len, self.slots
        rows, columns = mask.shape
        size = (min(16.0, max(4.0, 0.25 * columns + 3.0)), min(12.0, max(3.0, 0.25 * rows + 1.6)))  # inches
        figure, ax = _figure(Figure, ax, size)
        image = ax.imshow(mask.numpy(), cmap="Blues", vmin=0, vmax=1.25, interpolation="nearest", aspect="auto")
        step = -(-columns // 40)  # at most about 40 labels; depth labels start again at slot 0
        x_ticks, y_ticks = list(range(0, kv_len, step)) + list(range(kv_len, columns, step)), _ticks(rows)
        ax.set_xticks(x_ticks, [_column_label(c, kv_len, slots) for c in x_ticks])
        row_labels = [f"token {p}, head {h}" if self.folded else f"token {p}" for p, h in self._rows()]
        ax.set_yticks(y_ticks, [row_labels[r] for r in y_ticks])
        title = self._title() + (f"\n{self._alignment()}" if self.q_len < kv_len else "")
        ax.set_title(title, fontsize=10)
        if slots:
            ax.axvline(kv_len - 0.5, color="black", linestyle="--", linewidth=1.2)
            self._label_depth_groups(ax, packed)
            ax.set_xlabel("sequence key position k | depth slot l")
        else:
            ax.set_xlabel("sequence key position k (no depth slots)")
        if self.folded:
            ax.set_ylabel(f"query token and head\n(the {self.groups} heads of KV head {self.kv_head}, folded)")
        else:
            ax.set_ylabel(f"query token (its position), head {self.head}")
        colors = {True: image.cmap(image.norm(1)), False: image.cmap(image.norm(0))}
        handles = [Patch(facecolor=colors[True], label="visible"),
                   Patch(facecolor=colors[False], edgecolor="0.6", label="masked")]  # fmt: skip
        return _finish(figure, ax, handles, path)

    def _rows(self) -> list:
        """Each row's query: (absolute position p, query head h)."""
        first = self.kv_len - self.q_len
        if self.folded:
            G = self.groups
            return [(first + r // G, self.kv_head * G + r % G) for r in range(self.rows)]
        return [(first + i, self.head) for i in range(self.q_len)]

    def _alignment(self) -> str:
        """Why the rows start at ``Tk - Tq`` (said only when ``Tq < Tk``)."""
        first = self.kv_len - self.q_len
        where = f"query i sits at position Tk - Tq + i = {first} + i"
        return f"Tq < Tk, bottom-right aligned: {where}, so rows start at {first}"

    def _label_depth_groups(self, ax, packed: bool) -> None:
        """Above the picture, whose depth each group of slots is: every query token's (packed) or the row's own."""
        kv_len, slots = self.kv_len, self.slots
        ticks, labels = [(kv_len - 1) / 2], ["sequence keys"]
        if packed:
            first = kv_len - self.q_len
            starts = [kv_len + t * slots for t in range(self.q_len)]
            for start in starts[1:]:
                ax.axvline(start - 0.5, color="0.55", linestyle=":", linewidth=0.8)
            ticks += [start + (slots - 1) / 2 for start in starts]
            labels += [f"depth of\ntoken {first + t}" for t in range(self.q_len)]
        else:
            ticks.append(kv_len + (slots - 1) / 2)
            labels.append("depth of the\nrow's own token")
        top = ax.secondary_xaxis("top")
        top.set_xticks(ticks, labels, fontsize=8)
        if packed and slots < 3:  # a group narrower than its label: the labels stand upright
            for label in top.get_xticklabels()[1:]:
                label.set_rotation(90)

    def blocks(self) -> Tensor:
        """Which blocks of the flex backend's ``BlockMask`` are full, partial or skipped.

        The mask is the one ``moda_attention(..., backend="flex")`` runs with
        (:func:`moda_flex.backends.flex.moda_block_mask`), for the batch row
        ``batch`` (KV heads all have the same mask): rows are the ``Tq * G``
        folded rows (row ``r`` is token ``r // G``), columns the sequence keys
        padded to whole blocks, then the depth slots of every query token,
        token after token. A causal variant's depth columns are a band: a
        block of 128 rows holds ``128 / G`` consecutive tokens, whose slots
        are ``128 * L / G`` consecutive columns.

        Returns:
            (row blocks, column blocks) int64 of :data:`SKIPPED`,
            :data:`PARTIAL`, :data:`FULL`; the sequence part is the first
            ``ceil(kv_len / 128)`` column blocks.
        """
        from .backends.flex import moda_block_mask

        block_mask = moda_block_mask(
            self.variant, batch=self.batch + 1, kv_heads=1, q_len=self.q_len, kv_len=self.kv_len,
            groups=self.groups, slots=self.slots, device="cpu",
        )  # fmt: skip
        rows, columns = block_mask.seq_lengths
        block_rows, block_columns = block_mask.BLOCK_SIZE
        grid = torch.full((-(-rows // block_rows), -(-columns // block_columns)), SKIPPED, dtype=torch.long)
        b = min(self.batch, block_mask.kv_num_blocks.shape[0] - 1)  # a structural mask has one row for every batch row
        for kind, counts, indices in (
            (PARTIAL, block_mask.kv_num_blocks, block_mask.kv_indices),
            (FULL, block_mask.full_kv_num_blocks, block_mask.full_kv_indices),
        ):
            if counts is None:
                continue
            for row in range(grid.shape[0]):
                grid[row, indices[b, 0, row, : counts[b, 0, row]].long()] = kind
        return grid

    def blocks_text(self) -> str:
        """:meth:`blocks` as text: ``█`` full, ``▒`` partial, ``·`` skipped, ``|`` before the depth blocks."""
        grid = self.blocks()
        split = self._sequence_blocks()
        legend = ", ".join(f"{BLOCK_CHARS[kind]} {BLOCK_NAMES[kind]}" for kind in (FULL, PARTIAL, SKIPPED))
        lines = [
            f"{self.variant.name}: BlockMask of Tq={self.q_len} Tk={self.kv_len} L={self.slots} G={self.groups}: "
            f"{grid.shape[0]} x {grid.shape[1]} blocks of 128 folded rows x 128 columns [sequence {BOUNDARY} depth]; "
            f"{legend}"
        ]
        for row, kinds in enumerate(grid.tolist()):
            cells = [BLOCK_CHARS[kind] for kind in kinds]
            lines.append(f"{row:>4}  {''.join(cells[:split])}{BOUNDARY}{''.join(cells[split:])}")
        return "\n".join(lines)

    def plot_blocks(self, path: Optional[str] = None, ax=None):
        """:meth:`blocks` as a matplotlib picture, with a legend and the sequence/depth boundary dashed.

        Arguments and return as :meth:`plot`.
        """
        Figure, Patch, MaxNLocator = _matplotlib("MaskView.plot_blocks", "MaskView.blocks_text")
        from matplotlib.colors import ListedColormap

        grid = self.blocks()
        rows, columns = grid.shape
        size = (min(16.0, max(5.0, 0.2 * columns + 3.5)), min(10.0, max(2.5, 0.2 * rows + 1.5)))  # inches
        figure, ax = _figure(Figure, ax, size)
        colors = {SKIPPED: "#f4f4f4", PARTIAL: "#9ecae1", FULL: "#08519c"}
        cmap = ListedColormap([colors[kind] for kind in (SKIPPED, PARTIAL, FULL)])
        ax.imshow(grid.numpy(), cmap=cmap, vmin=-0.5, vmax=2.5, interpolation="nearest", aspect="auto")
        # Thin white lines between blocks, so that single blocks can be counted.
        ax.set_xticks([c - 0.5 for c in range(1, columns)], minor=True)
        ax.set_yticks([r - 0.5 for r in range(1, rows)], minor=True)
        ax.grid(which="minor", color="white", linewidth=0.5)
        ax.tick_params(which="minor", length=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        split = self._sequence_blocks()
        ax.axvline(split - 0.5, color="black", linestyle="--", linewidth=1.2)
        ax.set_title(
            f"{self.variant.name}: flex BlockMask, Tq={self.q_len} Tk={self.kv_len} L={self.slots} G={self.groups} "
            f"(a row block: {128 / self.groups:g} tokens x {self.groups} query heads)"
        )
        ax.set_xlabel(f"column block: sequence keys ({split} blocks) | depth slots of every token, token-major")
        ax.set_ylabel("block of 128 folded rows")
        kinds = (FULL, PARTIAL, SKIPPED)
        handles = [Patch(facecolor=colors[kind], edgecolor="0.6", label=BLOCK_NAMES[kind]) for kind in kinds]
        return _finish(figure, ax, handles, path)

    def _title(self) -> str:
        return f"{self.variant.name}: Tq={self.q_len} Tk={self.kv_len} L={self.slots} G={self.groups}"

    def _sequence_blocks(self) -> int:
        """Column blocks of the sequence part: ``kv_len`` rounded up to whole blocks."""
        from .backends.flex import BLOCK

        return -(-self.kv_len // BLOCK)


def _digits(columns: range, period: Optional[int] = None) -> str:
    """Column labels, last digit only: key positions, or depth slots (``period = L``)."""
    return "".join(str((c % period if period else c) % 10) for c in columns)


def _ticks(count: int, most: int = 40) -> list:
    """Every cell's index, or every n-th one so that at most ``most`` are labelled."""
    return list(range(0, count, -(-count // most)))


def _column_label(column: int, kv_len: int, slots: int) -> str:
    """A column's tick: the key position, or the depth slot counted from 0 again."""
    if column < kv_len:
        return str(column)
    return str((column - kv_len) % slots) if slots else ""


def _matplotlib(what: str, instead: str):
    """The matplotlib names the pictures use, or an ImportError that says what to install."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:
        raise ImportError(
            f"{what} needs matplotlib: pip install matplotlib (or moda_flex[plot]); "
            f"{instead} draws the same without it"
        ) from error
    return Figure, Patch, MaxNLocator


def _figure(Figure, ax, size: tuple):
    """``ax`` and its figure, or a new figure of ``size`` (width, height) inches and its axes."""
    if ax is not None:
        return ax.figure, ax
    figure = Figure(figsize=size)
    return figure, figure.subplots()


def _finish(figure, ax, handles: list, path: Optional[str]):
    """The legend beside the picture; the figure saved to ``path`` if given."""
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if path is not None:
        figure.savefig(path, dpi=120, bbox_inches="tight")
    return figure


def load_variant(spec: str) -> Variant:
    """The variant named by ``module:attribute`` (a module name or a ``.py`` path, then a name in it).

    The attribute is a :class:`~moda_flex.Variant`, or a function of no
    arguments that returns one (a factory such as ``causal``).

    Raises:
        ValueError: naming ``spec`` when the module, the attribute or the
            variant cannot be had.
    """
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ValueError(f"variant {spec!r}: expected module:attribute, e.g. my_masks:window_of_8")
    try:
        if module_name.endswith(".py"):
            location = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if location is None or not Path(module_name).is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(location)
            # As python runs a script: the file's folder first on the path, so that it imports its siblings.
            folder = str(Path(module_name).resolve().parent)
            sys.path.insert(0, folder)
            try:
                location.loader.exec_module(module)
            finally:
                sys.path.remove(folder)
        else:
            module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"variant {spec!r}: cannot import {module_name!r}: {error}") from error
    if not hasattr(module, attribute):
        raise ValueError(f"variant {spec!r}: module {module_name!r} has no attribute {attribute!r}")
    found = getattr(module, attribute)
    if callable(found) and not isinstance(found, Variant):
        try:
            inspect.signature(found).bind()
        except (TypeError, ValueError):
            raise ValueError(
                f"variant {spec!r}: {attribute} takes arguments; name a Variant or a function of no arguments"
            ) from None
        found = found()
    if not isinstance(found, Variant):
        raise ValueError(f"variant {spec!r}: got {type(found).__name__}, not a moda_flex Variant")
    return found


def _select(specs: Sequence[str], kv_len: int, slots: int) -> list:
    """The variants the command line names: built-ins by name, others as module:attribute; all built-ins if none."""
    builtins = {name: builtin.example(kv_len, slots) for name, builtin in BUILTINS.items()}
    if not specs:
        return list(builtins.values())
    selected = []
    for spec in specs:
        if spec in builtins:
            selected.append(builtins[spec])
        elif ":" in spec:
            selected.append(load_variant(spec))
        else:
            raise ValueError(f"variant {spec!r}: not a built-in ({', '.join(BUILTINS)}) nor module:attribute")
    return selected


def _variant_help() -> str:
    """The VARIANT argument's help: every built-in, and the demo argument the picture gives those that take one."""
    plain = [name for name, builtin in BUILTINS.items() if builtin.argument is None]
    demos = [f"{name} ({builtin.example_note}; in a call {builtin.call})"
             for name, builtin in BUILTINS.items() if builtin.argument is not None]  # fmt: skip
    return (
        f"a built-in: {', '.join(plain)} (the names moda_attention(variant=...) accepts), or, drawn with a demo "
        f"argument, {', '.join(demos)}; or module:attribute (default: every built-in)"
    )


def _has_matplotlib() -> bool:
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Print variants' masks as text; with ``--png DIR`` also save PNGs (matplotlib)."""
    parser = argparse.ArgumentParser(
        prog="python -m moda_flex.visualize",
        description=main.__doc__ + "\n\n" + __doc__[__doc__.index("Command line::") :],
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("variants", nargs="*", metavar="VARIANT", help=_variant_help())
    parser.add_argument("--q-len", type=int, default=6, help="query tokens Tq")
    parser.add_argument("--kv-len", type=int, default=9, help="sequence keys Tk (>= Tq; queries sit at the end)")
    parser.add_argument("--slots", type=int, default=3, help="depth slots L per token")
    parser.add_argument("--groups", type=int, default=1, help="query heads G per KV head")
    parser.add_argument("--folded", action="store_true", help="show the folded rows of the flex/triton backends")
    parser.add_argument("--blocks", action="store_true",
                        help="show the flex backend's BlockMask (128 x 128 blocks) instead of every element")
    parser.add_argument("--png", metavar="DIR", help="also write one PNG per variant into DIR (default: none)")
    args = parser.parse_args(argv)
    try:
        selected = _select(args.variants, args.kv_len, args.slots)
    except ValueError as error:
        parser.error(str(error))
    pictures = args.png is not None and _has_matplotlib()
    for variant in selected:
        try:
            view = MaskView(variant, q_len=args.q_len, kv_len=args.kv_len, slots=args.slots, groups=args.groups,
                            folded=args.folded)  # fmt: skip
            text, plot = (view.blocks_text, view.plot_blocks) if args.blocks else (view.text, view.plot)
            print(text(), end="\n\n")
        except ValueError as error:
            parser.error(str(error))
        if pictures:
            os.makedirs(args.png, exist_ok=True)
            name = "".join(c if c.isalnum() else "_" for c in variant.name).strip("_")
            path = os.path.join(args.png, f"{name}{'_blocks' if args.blocks else ''}.png")
            plot(path=path)
            print(f"wrote {path}")
    if args.png is not None and not pictures:
        print("PNGs need matplotlib (pip install matplotlib, or moda_flex[plot]): none written, the text is above")


if __name__ == "__main__":
    main()
