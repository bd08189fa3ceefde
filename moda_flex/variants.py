"""Mask variants: a sequence predicate and a depth predicate, written once.

Every backend reads the same two predicates. Positions are absolute: with
``Tq <= Tk`` query token ``i`` sits at ``q_pos = Tk - Tq + i`` (bottom-right
aligned), and the depth entries of query token ``i`` live at ``d_pos`` of the
same absolute position.

- sequence: ``(b, h, q_pos, k_pos) -> bool`` may query ``q_pos`` see key ``k_pos``
- depth: ``(b, h, q_pos, d_pos, slot) -> bool`` may it see depth slot ``slot``
  written for token ``d_pos``

Arguments arrive as broadcastable integer tensors (``h`` is the query head).
Depth predicates that depend on the number of slots ``L`` (the bounded depth
window) are built per call by :meth:`Variant.depth_predicate`.

Built-ins also carry a :class:`Structure`: what block-sparse backends may rely
on to skip work without evaluating the predicates densely. A variant without a
structure (a user's own) still runs on ``reference`` and ``flex``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import Tensor

SequencePredicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
DepthPredicate = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclasses.dataclass(frozen=True, eq=False)
class Structure:
    """What a variant promises about its masks, for block-sparse backends.

    Attributes:
        causal: keys satisfy ``k_pos <= q_pos``.
        window: if set, keys also satisfy ``k_pos > q_pos - window``.
        sequence: ``False`` when no sequence key is visible (depth-only).
        doc_ids: if set, (B, Tk) integer ids by absolute position; a key is
            visible only if its id equals the query's. Each document must be
            one contiguous run of positions for the block structure to hold.
        depth_chunk: ``None``: a query reads only its own token's depth.
            ``C``: it reads the depth of earlier-or-same tokens in its chunk
            of ``C`` positions.
        depth_window: if set, only the last ``depth_window`` of the ``L``
            depth slots are visible.
    """

    causal: bool = False
    window: Optional[int] = None
    sequence: bool = True
    doc_ids: Optional[Tensor] = None
    depth_chunk: Optional[int] = None
    depth_window: Optional[int] = None

    def intersect(self, other: "Structure") -> Optional["Structure"]:
        """The structure of ``self & other``, or None if it is not expressible."""
        if self.depth_chunk is None or other.depth_chunk is None:
            # A chunk always holds the token itself: own-token reads win.
            depth_chunk = None
        elif self.depth_chunk == other.depth_chunk:
            depth_chunk = self.depth_chunk
        else:
            return None
        if self.doc_ids is not None and other.doc_ids is not None:
            return None
        return Structure(
            causal=self.causal or other.causal,
            window=_min_optional(self.window, other.window),
            sequence=self.sequence and other.sequence,
            doc_ids=self.doc_ids if self.doc_ids is not None else other.doc_ids,
            depth_chunk=depth_chunk,
            depth_window=_min_optional(self.depth_window, other.depth_window),
        )

    @property
    def own_depth_only(self) -> bool:
        return self.depth_chunk is None


def _min_optional(a: Optional[int], b: Optional[int]) -> Optional[int]:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def own_token(b: Tensor, h: Tensor, q_pos: Tensor, d_pos: Tensor, slot: Tensor) -> Tensor:
    """The default depth predicate: a query reads only its own token's slots."""
    return q_pos == d_pos


class Variant:
    """A named pair of predicates over ``[sequence | depth]``.

    Args:
        name: shown in errors, reprs and test ids.
        sequence: ``(b, h, q_pos, k_pos) -> bool`` tensor.
        depth: ``(b, h, q_pos, d_pos, slot) -> bool`` tensor; defaults to
            :func:`own_token`.
        depth_for_slots: alternatively, ``L -> depth predicate`` for depth masks
            that depend on the number of slots.
        structure: what block-sparse backends may rely on; leave None for a
            variant of your own (it then runs on ``reference`` and ``flex``).

    ``a & b`` and ``a | b`` compose both predicates elementwise.
    """

    def __init__(
        self,
        name: str,
        sequence: SequencePredicate,
        depth: Optional[DepthPredicate] = None,
        *,
        depth_for_slots: Optional[Callable[[int], DepthPredicate]] = None,
        structure: Optional[Structure] = None,
    ):
        if depth is not None and depth_for_slots is not None:
            raise ValueError(f"variant {name!r}: pass depth or depth_for_slots, not both")
        self.name = name
        self.sequence = sequence
        self._depth = depth if depth is not None else own_token
        self._depth_for_slots = depth_for_slots
        self.structure = structure

    def depth_predicate(self, num_slots: int) -> DepthPredicate:
        """The depth predicate for calls with ``L = num_slots`` depth slots."""
        if self._depth_for_slots is not None:
            return self._depth_for_slots(num_slots)
        return self._depth

    @property
    def own_depth_only(self) -> bool:
        """True when a query is known to read only its own token's depth."""
        return self.structure is not None and self.structure.own_depth_only

    def __and__(self, other: "Variant") -> "Variant":
        return _combine(self, other, "&", torch.logical_and)

    def __or__(self, other: "Variant") -> "Variant":
        return _combine(self, other, "|", torch.logical_or)

    def __repr__(self) -> str:
        return f"Variant({self.name})"


def _combine(a: Variant, b: Variant, symbol: str, op) -> Variant:
    def sequence(bi, h, q_pos, k_pos):
        return op(a.sequence(bi, h, q_pos, k_pos), b.sequence(bi, h, q_pos, k_pos))

    def depth_for_slots(num_slots: int) -> DepthPredicate:
        depth_a, depth_b = a.depth_predicate(num_slots), b.depth_predicate(num_slots)

        def depth(bi, h, q_pos, d_pos, slot):
            return op(depth_a(bi, h, q_pos, d_pos, slot), depth_b(bi, h, q_pos, d_pos, slot))

        return depth

    structure = None
    # Only intersections keep a block structure; unions fall back to the generic path.
    if symbol == "&" and a.structure is not None and b.structure is not None:
        structure = a.structure.intersect(b.structure)
    return Variant(
        f"({a.name} {symbol} {b.name})",
        sequence,
        depth_for_slots=depth_for_slots,
        structure=structure,
    )


def causal() -> Variant:
    """Causal MoDA: keys up to the query's position, the token's own depth."""

    def sequence(b, h, q_pos, k_pos):
        return k_pos <= q_pos

    return Variant("causal", sequence, structure=Structure(causal=True))


def full() -> Variant:
    """Non-causal MoDA (vision): every key, the token's own depth."""

    def sequence(b, h, q_pos, k_pos):
        return torch.ones_like(k_pos == q_pos)

    return Variant("full", sequence, structure=Structure())


def sliding_window(window: int) -> Variant:
    """Causal attention over the last ``window`` positions (the query's own included)."""
    _check_positive("window", window)

    def sequence(b, h, q_pos, k_pos):
        return (k_pos <= q_pos) & (k_pos > q_pos - window)

    return Variant(f"sliding_window({window})", sequence, structure=Structure(causal=True, window=window))


def depth_window(slots: int) -> Variant:
    """Causal MoDA reading only the last ``slots`` depth slots (a bounded depth-KV slot cache)."""
    _check_positive("slots", slots)

    def sequence(b, h, q_pos, k_pos):
        return k_pos <= q_pos

    def depth_for_slots(num_slots: int) -> DepthPredicate:
        first_visible = num_slots - slots

        def depth(b, h, q_pos, d_pos, slot):
            return (q_pos == d_pos) & (slot >= first_visible)

        return depth

    return Variant(
        f"depth_window({slots})",
        sequence,
        depth_for_slots=depth_for_slots,
        structure=Structure(causal=True, depth_window=slots),
    )


def chunk_depth(chunk: int) -> Variant:
    """Causal MoDA whose depth reads span earlier-or-same tokens of the query's chunk of ``chunk`` positions."""
    _check_positive("chunk", chunk)

    def sequence(b, h, q_pos, k_pos):
        return k_pos <= q_pos

    def depth(b, h, q_pos, d_pos, slot):
        return (d_pos <= q_pos) & (d_pos // chunk == q_pos // chunk)

    return Variant(f"chunk_depth({chunk})", sequence, depth, structure=Structure(causal=True, depth_chunk=chunk))


def depth_only() -> Variant:
    """Plain depth attention: no sequence keys, the token's own depth slots."""

    def sequence(b, h, q_pos, k_pos):
        return torch.zeros_like(k_pos == q_pos)

    return Variant("depth_only", sequence, structure=Structure(sequence=False))


def document(doc_ids: Tensor) -> Variant:
    """Keys of the query's own document only (packed sequences); combine with ``causal()``.

    Args:
        doc_ids: (B, Tk) or (Tk,) integer document id of every absolute position.
            Each document should be one contiguous run of positions.
    """
    if not isinstance(doc_ids, Tensor) or doc_ids.dim() not in (1, 2) or doc_ids.is_floating_point():
        raise ValueError(
            f"doc_ids must be an integer tensor of shape (B, Tk) or (Tk,), got "
            f"{getattr(doc_ids, 'shape', type(doc_ids))}"
        )
    ids = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)  # (B or 1, Tk)
    last = ids.shape[1] - 1

    def sequence(b, h, q_pos, k_pos):
        on_device = ids if ids.device == q_pos.device else ids.to(q_pos.device)
        row = b if ids.shape[0] > 1 else torch.zeros_like(b)
        # Clamp so that padded positions a kernel may probe never index out of range.
        return on_device[row, q_pos.clamp(0, last)] == on_device[row, k_pos.clamp(0, last)]

    return Variant("document", sequence, structure=Structure(doc_ids=ids))


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def resolve(variant) -> Variant:
    """Turn ``"causal"`` / ``"full"`` / a :class:`Variant` into a :class:`Variant`."""
    if isinstance(variant, Variant):
        return variant
    if isinstance(variant, str) and variant in _NAMED:
        return _NAMED[variant]
    raise ValueError(f"variant must be 'causal', 'full' or a moda_flex Variant, got {variant!r}")


# The variants named by a string, made once: resolving a name costs a lookup on every call.
_NAMED = {"causal": causal(), "full": full()}
