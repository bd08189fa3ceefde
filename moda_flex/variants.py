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

Built-ins (:data:`BUILTINS`, the one list of them) also carry a
:class:`Structure`: what block-sparse backends may rely on to skip work
without evaluating the predicates densely. A variant without a structure (a
user's own) still runs on ``reference`` and ``flex``.

Predicates must return bool tensors; a variant checks this on every call and
names itself and the predicate otherwise. Arguments are validated where the
variant is made; document ids are also prepared there, once
(:class:`Documents`), and checked against each call's batch and length.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .scores import Score

SequencePredicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
DepthPredicate = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclasses.dataclass(frozen=True, eq=False)
class Documents:
    """Document ids of packed sequences, prepared once where the variant is made.

    Build with :meth:`from_ids`. Compared and hashed by identity, so a block
    mask cached for one set of ids is never served for another.

    Attributes:
        ids: (Bd, Tk) int32, each row's ids renumbered ``0, 1, ...`` in sorted
            order: equal ids stay equal and distinct ids stay distinct, whatever
            the caller's dtype (``0`` and ``2**32`` are two documents).
        start: (Bd, Tk) int32, the first position of the run of equal ids that
            holds each position.
        end: (Bd, Tk) int32, one past the last position of that run.
        contiguous: every document is one run of positions; then ``[start,
            end)`` is a position's whole document.
        packed: (3, Bd, Tk) int32, ``ids``, ``start`` and ``end`` in one
            tensor: what the fused kernels read.
    """

    ids: Tensor
    start: Tensor
    end: Tensor
    contiguous: bool
    packed: Tensor

    @classmethod
    def from_ids(cls, doc_ids: Tensor) -> "Documents":
        """Validate ``doc_ids``, (B, Tk) or (Tk,) integer ids, and compute its runs."""
        if not isinstance(doc_ids, Tensor):
            raise ValueError(
                f"doc_ids must be an integer tensor of shape (B, Tk) or (Tk,), got {type(doc_ids).__name__}"
            )
        integer = not (doc_ids.is_floating_point() or doc_ids.is_complex() or doc_ids.dtype == torch.bool)
        if not integer or doc_ids.dim() not in (1, 2):
            raise ValueError(
                f"doc_ids must be an integer tensor of shape (B, Tk) or (Tk,), got {doc_ids.dtype} of shape "
                f"{tuple(doc_ids.shape)}"
            )
        ids = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)  # (Bd, Tk)
        ranks, distinct = _dense_ranks(ids)
        start, end = document_runs(ranks)
        runs = (start == torch.arange(ids.shape[1], device=ids.device)).sum(dim=1)  # (Bd,)
        packed = torch.stack([ranks, start, end])  # (3, Bd, Tk)
        return cls(packed[0], packed[1], packed[2], bool((runs == distinct).all()), packed)

    def check(self, batch: int, kv_len: int) -> None:
        """Raise ValueError unless the ids fit a call with ``batch`` rows and ``kv_len`` keys."""
        rows, length = self.ids.shape
        if length != kv_len or rows not in (1, batch):
            raise ValueError(
                f"doc_ids must have shape (B, Tk) or (1, Tk) for inputs with B={batch}, Tk={kv_len}; "
                f"got doc_ids of shape {(rows, length)}"
            )


def _dense_ranks(ids: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's ids renumbered by rank among its distinct values: (Bd, Tk) int32, and the count per row (Bd,)."""
    sorted_ids, order = ids.sort(dim=1)
    new_value = torch.ones_like(sorted_ids, dtype=torch.bool)
    new_value[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    sorted_ranks = new_value.cumsum(dim=1, dtype=torch.int32) - 1
    ranks = torch.empty_like(sorted_ranks).scatter_(1, order, sorted_ranks)
    return ranks, new_value.sum(dim=1)


def document_runs(ids: Tensor) -> tuple[Tensor, Tensor]:
    """The run of equal ids that holds each position: its first position and one past its last.

    Args:
        ids: (Bd, Tk) integer ids.

    Returns:
        start, end: (Bd, Tk) int32, contiguous in memory.
    """
    rows, length = ids.shape
    pos = torch.arange(length, device=ids.device, dtype=torch.int32).expand(rows, length)
    starts_run = torch.ones_like(ids, dtype=torch.bool)
    starts_run[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start = torch.where(starts_run, pos, 0).cummax(dim=1).values
    ends_run = torch.ones_like(starts_run)
    ends_run[:, :-1] = starts_run[:, 1:]
    end = torch.where(ends_run, pos + 1, length).flip(1).cummin(dim=1).values.flip(1)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


@dataclasses.dataclass(frozen=True)
class Structure:
    """What a variant promises about its masks, exactly, for block-sparse backends.

    Backends skip and fill whole blocks from these promises without evaluating
    the predicates there, so they must describe the masks exactly; the flex
    backend also shares one block mask among variants of equal structure.
    Structures compare by value (documents by identity).

    Attributes:
        causal: keys satisfy ``k_pos <= q_pos``.
        window: if set, keys also satisfy ``k_pos > q_pos - window``.
        sequence: ``False`` when no sequence key is visible (depth-only).
        documents: if set, a key is visible only if its document id equals the
            query's (see :class:`Documents`).
        depth_chunk: ``None``: a query reads only its own token's depth.
            ``C``: it reads the depth of earlier-or-same tokens in its chunk
            of ``C`` positions.
        depth_window: if set, only the last ``depth_window`` of the ``L``
            depth slots are visible.
    """

    causal: bool = False
    window: Optional[int] = None
    sequence: bool = True
    documents: Optional[Documents] = None
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
        if self.documents is not None and other.documents is not None:
            return None
        return Structure(
            causal=self.causal or other.causal,
            window=_min_optional(self.window, other.window),
            sequence=self.sequence and other.sequence,
            documents=self.documents if self.documents is not None else other.documents,
            depth_chunk=depth_chunk,
            depth_window=_min_optional(self.depth_window, other.depth_window),
        )

    @property
    def own_depth_only(self) -> bool:
        return self.depth_chunk is None

    @property
    def doc_ids(self) -> Optional[Tensor]:
        """The dense int32 document ids (Bd, Tk), or None without documents."""
        return None if self.documents is None else self.documents.ids

    @property
    def keys_contiguous(self) -> bool:
        """Every query's visible keys form one interval, :meth:`key_spans` (not so for documents split into runs)."""
        return self.documents is None or self.documents.contiguous

    def key_spans(self, q_len: int, kv_len: int, device) -> tuple[Tensor, Tensor]:
        """Per query token, its visible keys ``[lo, hi]`` (none when ``lo > hi``).

        Both ends never decrease with the token, and ``0 <= lo``, ``-1 <= hi < kv_len``.

        Returns:
            lo, hi: (Bd, Tq) int64, Bd the rows of the document ids (else 1).
        """
        if not self.keys_contiguous:
            raise ValueError("key_spans needs every document to be one contiguous run of positions")
        pos = kv_len - q_len + torch.arange(q_len, device=device)  # absolute positions
        lo = torch.zeros_like(pos)
        hi = torch.full_like(pos, kv_len - 1)
        if not self.sequence:
            return lo.unsqueeze(0), (lo - 1).unsqueeze(0)
        if self.causal:
            hi = torch.minimum(hi, pos)
        if self.window is not None:
            lo = torch.maximum(lo, pos - self.window + 1)
        lo, hi = lo.unsqueeze(0), hi.unsqueeze(0)
        if self.documents is not None:
            if self.documents.ids.shape[1] != kv_len:
                raise ValueError(
                    f"doc_ids must have Tk={kv_len} positions, got shape {tuple(self.documents.ids.shape)}"
                )
            start, end = (t.to(device) for t in (self.documents.start, self.documents.end))
            lo = torch.maximum(lo, start[:, pos])
            hi = torch.minimum(hi, end[:, pos] - 1)
        return lo, hi

    def first_slot(self, slots: int) -> int:
        """The first of ``slots`` depth slots a token sees: a depth window leaves only its last ones (0: all)."""
        return 0 if self.depth_window is None else max(0, slots - self.depth_window)

    def depth_spans(self, q_len: int, kv_len: int, slots: int, device) -> tuple[Tensor, Tensor, int]:
        """Per query token ``t``, the tokens ``[d_lo, d_hi]`` whose depth slots ``slot_lo .. L-1`` it reads.

        Returns:
            d_lo, d_hi: (Tq,) int64 query-token indices (``d_hi`` is ``t``), and
            slot_lo, the first visible slot.
        """
        t = torch.arange(q_len, device=device)
        if self.depth_chunk is None:
            d_lo = t
        else:
            chunk, offset = self.depth_chunk, kv_len - q_len
            # Chunks are of absolute positions; depth exists only for query tokens.
            d_lo = (((t + offset) // chunk) * chunk - offset).clamp(min=0)
        return d_lo, t, self.first_slot(slots)


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
        documents: the :class:`Documents` the predicates read; each call checks
            that they fit its batch and length (:meth:`check_fits`).
        score: a :class:`~moda_flex.scores.Score` applied to the logits before
            the softmax (None: the plain ``scale * q . k``).

    ``a & b`` and ``a | b`` compose both predicates elementwise; ``a & b``
    applies a's score, then b's (``|`` refuses scores: join them after the
    union). ``variant & score`` is the variant with the score added.
    """

    def __init__(
        self,
        name: str,
        sequence: SequencePredicate,
        depth: Optional[DepthPredicate] = None,
        *,
        depth_for_slots: Optional[Callable[[int], DepthPredicate]] = None,
        structure: Optional[Structure] = None,
        documents: Sequence[Documents] = (),
        score: Optional[Score] = None,
    ):
        if score is not None and not isinstance(score, Score):
            raise TypeError(f"variant {name!r}: score must be a moda_flex Score, got {type(score).__name__}")
        if depth is not None and depth_for_slots is not None:
            raise ValueError(f"variant {name!r}: pass depth or depth_for_slots, not both")
        self.name = name
        self.sequence = _checked(name, "sequence", sequence)
        self._depth = _checked(name, "depth", depth if depth is not None else own_token)
        self._depth_for_slots = depth_for_slots
        self.structure = structure
        self.documents = tuple(documents)
        self.score = score

    def depth_predicate(self, num_slots: int) -> DepthPredicate:
        """The depth predicate for calls with ``L = num_slots`` depth slots."""
        if self._depth_for_slots is not None:
            return _checked(self.name, "depth", self._depth_for_slots(num_slots))
        return self._depth

    def check_fits(self, batch: int, kv_len: int) -> None:
        """Raise ValueError unless the variant's data (document ids) fits ``batch`` rows and ``kv_len`` keys."""
        for documents in self.documents:
            documents.check(batch, kv_len)

    @property
    def own_depth_only(self) -> bool:
        """True when a query is known to read only its own token's depth."""
        return self.structure is not None and self.structure.own_depth_only

    def with_score(self, score: Optional[Score]) -> "Variant":
        """This variant, same name, with ``score`` in place of its own (None: no score)."""
        if score is not None and not isinstance(score, Score):
            raise TypeError(f"score must be a moda_flex Score or None, got {type(score).__name__}")
        return Variant(
            self.name,
            self.sequence,
            None if self._depth_for_slots is not None else self._depth,
            depth_for_slots=self._depth_for_slots,
            structure=self.structure,
            documents=self.documents,
            score=score,
        )

    def __and__(self, other) -> "Variant":
        if isinstance(other, Score):
            variant = self.with_score(other if self.score is None else self.score & other)
            variant.name = f"({self.name} & {other.name})"
            return variant
        return _combine(self, other, "&", torch.logical_and)

    def __or__(self, other: "Variant") -> "Variant":
        return _combine(self, other, "|", torch.logical_or)

    def __rand__(self, other):
        if isinstance(other, Score):  # ``softcap(30.0) & causal()``
            return self & other
        # Reached only when the left operand is not a Variant: ``"full" & causal()``.
        raise _operand_error(other, "&", self)

    def __ror__(self, other):
        raise _operand_error(other, "|", self)

    def __repr__(self) -> str:
        return f"Variant({self.name})"


def _checked(variant: str, role: str, predicate: Callable) -> Callable:
    """``predicate``, failing with a clear error unless it returns a bool tensor."""

    if getattr(predicate, "_checked", False):
        return predicate  # a variant rebuilt from another's predicates

    @functools.wraps(predicate)
    def checked(*args):
        mask = predicate(*args)
        if not (isinstance(mask, Tensor) and mask.dtype == torch.bool):
            got = f"a {mask.dtype} tensor" if isinstance(mask, Tensor) else f"{type(mask).__name__} {mask!r}"
            name = getattr(predicate, "__name__", repr(predicate))
            raise TypeError(
                f"variant {variant!r}: its {role} predicate {name} must return a bool tensor of the broadcast "
                f"argument shape, got {got}; compare tensors (k_pos <= q_pos) or use torch.ones_like(q_pos == k_pos)"
            )
        return mask

    checked._checked = True
    return checked


def _operand_error(other, symbol: str, variant: Variant) -> TypeError:
    return TypeError(
        f"{symbol} combines two Variants, got {other!r} ({type(other).__name__}) with {variant!r}; "
        f"build the other operand with its factory, e.g. moda_flex.full() for 'full'"
    )


def _combine(a: Variant, b: Variant, symbol: str, op) -> Variant:
    if not isinstance(b, Variant):
        raise _operand_error(b, symbol, a)

    def sequence(bi, h, q_pos, k_pos):
        return op(a.sequence(bi, h, q_pos, k_pos), b.sequence(bi, h, q_pos, k_pos))

    def depth_for_slots(num_slots: int) -> DepthPredicate:
        depth_a, depth_b = a.depth_predicate(num_slots), b.depth_predicate(num_slots)

        def depth(bi, h, q_pos, d_pos, slot):
            return op(depth_a(bi, h, q_pos, d_pos, slot), depth_b(bi, h, q_pos, d_pos, slot))

        return depth

    if symbol == "|" and (a.score is not None or b.score is not None):
        raise ValueError(
            f"| combines masks only, got scores in {a.name!r} | {b.name!r}: join the score after the union, "
            f"(a | b) & score"
        )
    score = a.score if b.score is None else b.score if a.score is None else a.score & b.score
    structure = None
    # Only intersections keep a block structure; unions fall back to the generic path.
    if symbol == "&" and a.structure is not None and b.structure is not None:
        structure = a.structure.intersect(b.structure)
    return Variant(
        f"({a.name} {symbol} {b.name})",
        sequence,
        depth_for_slots=depth_for_slots,
        structure=structure,
        documents=a.documents + b.documents,
        score=score,
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

    A document is every position with its id, wherever those positions sit:
    one split into several runs is still one document (the ``triton`` backend
    refuses such ids; ``reference`` and ``flex`` compute them).

    Args:
        doc_ids: (B, Tk) or (Tk,) integer document id of every absolute
            position; each call checks ``Tk`` and ``B`` (or 1) against its inputs.
    """
    documents = Documents.from_ids(doc_ids)
    ids = documents.ids  # (Bd, Tk) int32
    last = ids.shape[1] - 1

    def sequence(b, h, q_pos, k_pos):
        on_device = ids if ids.device == q_pos.device else ids.to(q_pos.device)
        row = b if ids.shape[0] > 1 else torch.zeros_like(b)
        # Clamp so that padded positions a kernel may probe never index out of range.
        return on_device[row, q_pos.clamp(0, last)] == on_device[row, k_pos.clamp(0, last)]

    return Variant("document", sequence, structure=Structure(documents=documents), documents=(documents,))


def _check_positive(name: str, value: int) -> None:
    # bool is an int subclass: True would pass as 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Builtin:
    """A built-in variant family: its factory and what its one argument counts.

    Attributes:
        make: the factory (:func:`causal`, :func:`sliding_window`, ...).
        argument: ``"tokens"`` (positions, ``1 .. Tk``), ``"slots"`` (depth
            slots, ``1 .. L``), ``"doc_ids"`` (the ids :func:`document` takes)
            or None (no argument).
    """

    make: Callable[..., Variant]
    argument: Optional[str] = None

    @property
    def call(self) -> str:
        """How a user builds one: ``"moda_flex.sliding_window(window)"``, ``"moda_flex.causal()"``."""
        return f"moda_flex.{self.make.__name__}({', '.join(inspect.signature(self.make).parameters)})"

    @property
    def example_note(self) -> str:
        """In words, the argument :meth:`example` fills in (empty for a family without one)."""
        return _EXAMPLE_NOTES[self.argument]

    def example(self, kv_len: int, slots: int) -> Variant:
        """One instance for ``kv_len`` keys and ``slots`` depth slots, as pictures show it.

        A third of the keys, half the slots, or three contiguous documents
        under :func:`causal` (how packed sequences use them): :attr:`example_note`.
        """
        if self.argument == "tokens":
            return self.make(max(1, kv_len // 3))
        if self.argument == "slots":
            return self.make(max(1, slots // 2))
        if self.argument == "doc_ids":
            return causal() & self.make(torch.arange(kv_len) * 3 // kv_len)
        return self.make()


# What Builtin.example fills in, by the kind of argument, in the words of the command line's help.
_EXAMPLE_NOTES = {
    None: "",
    "tokens": "a third of the keys",
    "slots": "half the depth slots",
    "doc_ids": "three contiguous documents, under causal",
}

# Every built-in family by name: what the test strategies, the pictures, the
# tests and the variant names that ``resolve`` accepts are drawn from.
BUILTINS = {
    "causal": Builtin(causal),
    "full": Builtin(full),
    "sliding_window": Builtin(sliding_window, "tokens"),
    "depth_window": Builtin(depth_window, "slots"),
    "chunk_depth": Builtin(chunk_depth, "tokens"),
    "depth_only": Builtin(depth_only),
    "document": Builtin(document, "doc_ids"),
}

# The variants a string names, made once (resolving a name costs a lookup on
# every call): the built-ins that take no argument.
NAMED = {name: builtin.make() for name, builtin in BUILTINS.items() if builtin.argument is None}


def resolve(variant) -> Variant:
    """Turn a name of :data:`NAMED` (``"causal"``, ``"full"``, ``"depth_only"``) or a :class:`Variant` into a Variant.

    Raises:
        ValueError: naming ``variant``, what is accepted, and for a built-in
            that takes an argument (``"sliding_window"``), the call that makes it.
    """
    if isinstance(variant, Variant):
        return variant
    if isinstance(variant, str) and variant in NAMED:
        return NAMED[variant]
    if isinstance(variant, str) and variant in BUILTINS:
        raise ValueError(
            f"variant {variant!r} takes an argument: pass {BUILTINS[variant].call} "
            f"(a string names only the built-ins without one: {_quoted(NAMED)})"
        )
    made = ", ".join(builtin.call for builtin in BUILTINS.values() if builtin.argument is not None)
    raise ValueError(
        f"variant must be one of {_quoted(NAMED)} or a moda_flex Variant, got {variant!r}; "
        f"the built-ins with an argument are made by calling {made}"
    )


def _quoted(names) -> str:
    return ", ".join(repr(name) for name in names)
