"""Depth K/V: the entries earlier layers write for each token, and the stream that carries them.

``moda_attention`` takes depth keys/values in either of two forms:

- one tensor (B, Hk, Tq, L, D), any strides;
- a sequence of L entries, each (B, Hk, Tq, D): slot ``l`` is entry ``l``.

The second is what a model has: every layer writes one entry. The kernel
backends read the entries where they are (through a table of slot
addresses), so a forward pass moves only the depth bytes its attention reads,
and autograd gives each entry the sum of the gradients of every layer that
read it, with no buffer written behind its back.

:class:`DepthStream` is that sequence as a value: ``append`` returns a new
stream and leaves the old one as it was. A pass builds its stream layer by
layer; nothing is mutated, so ``torch.compile(fullgraph=True)`` traces it,
activation checkpointing can re-run a block, and a stream used twice gives the
same entries twice.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

DepthKV = Union[Tensor, Sequence[Tensor]]


def is_entries(depth: DepthKV) -> bool:
    """True for the per-slot form (a sequence of (B, Hk, Tq, D) tensors)."""
    return not isinstance(depth, Tensor)


def as_list(depth: DepthKV) -> list[Tensor]:
    """The kernel ops' form of depth K/V (``Tensor[]``): ``[(B, Hk, Tq, L, D)]``, or the L entries (B, Hk, Tq, D)."""
    return [depth] if isinstance(depth, Tensor) else list(depth)


def is_slab(depth: list[Tensor]) -> bool:
    """True when the ops' list form holds one (B, Hk, Tq, L, D) tensor rather than L entries."""
    return len(depth) == 1 and depth[0].dim() == 5


def grads_shape(q: Tensor, k: Tensor, depth: list[Tensor]) -> tuple:
    """(B, Hk, Tq, L, D): the shape of a kernel call's depth gradient on either side, whatever the form of
    ``depth`` (the ops' list), for q (B, Hq, Tq, D) and k (B, Hk, Tk, D)."""
    return (k.shape[0], k.shape[1], q.shape[2], slot_count(depth), q.shape[3])


def empty_grads(q: Tensor, k: Tensor, depth: list[Tensor]) -> tuple[Tensor, Tensor]:
    """A kernel call's depth gradients, unwritten: two tensors of :func:`grads_shape` and q's dtype."""
    shape = grads_shape(q, k, depth)
    return q.new_empty(shape), q.new_empty(shape)


def grads_like(grad: Tensor, depth: list[Tensor]) -> list[Tensor]:
    """A (B, Hk, Tq, L, D) depth gradient in the ops' list form of ``depth``: itself, or one view per entry."""
    return [grad] if is_slab(depth) else list(grad.unbind(3))


def slot_count(depth: DepthKV) -> int:
    """L, the depth entries per token, of either form, or of the ops' list form."""
    if is_entries(depth) and is_slab(depth):
        return depth[0].shape[3]
    return len(depth) if is_entries(depth) else depth.shape[3]


def as_tensor(depth: DepthKV, empty_like: Tensor) -> Tensor:
    """Depth K/V as one (B, Hk, Tq, L, D) tensor; stacks the per-slot form (a copy).

    Args:
        depth: (B, Hk, Tq, L, D), or L entries (B, Hk, Tq, D).
        empty_like: a (B, Hk, Tq, D) tensor whose shape, dtype and device an
            empty sequence (L = 0) takes.
    """
    if not is_entries(depth):
        return depth
    if is_slab(depth):  # the ops' list form of one tensor
        return depth[0]
    if len(depth) == 0:
        return empty_like.new_empty(*empty_like.shape[:3], 0, empty_like.shape[3])
    return torch.stack(tuple(depth), dim=3)  # (B, Hk, Tq, L, D)


def _is_count(value) -> bool:
    """Whether ``value`` is an int >= 0 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclasses.dataclass(frozen=True)
class DepthStream:
    """The depth K/V written so far in one forward pass: an immutable sequence of entries.

    Each attention layer reads the stream, then appends its own K/V; with FFN
    depth, each FFN appends one more. ``append`` returns the longer stream::

        depth = DepthStream(capacity=2 * n_layer)
        for block in blocks:
            depth_k, depth_v = depth.read()                        # L entries (B, Hk, T, D) each
            y = moda_attention(q, k, v, depth_k, depth_v)          # one softmax over [sequence | depth]
            depth = depth.append(k, v)                             # this layer's entry, for the later ones

    Attributes:
        capacity: the most entries the pass may append, or None for no limit.
        keys, values: the entries, each (B, Hk, T, D), oldest first.
    """

    capacity: Optional[int] = None
    keys: tuple = ()
    values: tuple = ()

    def __post_init__(self):
        if self.capacity is not None and not _is_count(self.capacity):
            raise ValueError(f"capacity must be an int >= 0 or None, got {self.capacity!r}")
        if len(self.keys) != len(self.values):
            raise ValueError(f"keys and values must pair up, got {len(self.keys)} keys and {len(self.values)} values")

    def __len__(self) -> int:
        return len(self.keys)

    def append(self, k: Tensor, v: Tensor) -> "DepthStream":
        """The stream with one more entry per token: ``k``, ``v`` of shape (B, Hk, T, D).

        Raises:
            ValueError: past ``capacity``, or when ``k``/``v`` differ in shape,
                dtype or device from each other or from the entries already in
                the stream (another batch size, say).
        """
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a (B, Hk, T, D) tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
            raise ValueError(
                f"k and v must match, got k {tuple(k.shape)} {k.dtype} {k.device} and v {tuple(v.shape)} {v.dtype} "
                f"{v.device}"
            )
        if self.capacity is not None and len(self) == self.capacity:
            raise ValueError(f"the depth stream is full: all {self.capacity} entries were appended")
        if self.keys:
            first = self.keys[0]
            for what, seen, expected in (
                ("shape (B, Hk, T, D)", tuple(k.shape), tuple(first.shape)),
                ("dtype", k.dtype, first.dtype),
                ("device", k.device, first.device),
            ):
                if seen != expected:
                    raise ValueError(
                        f"entry {len(self)} has {what} {seen}, but the stream's entries have {expected}"
                    )
        return dataclasses.replace(self, keys=self.keys + (k,), values=self.values + (v,))

    def read(self, count: Optional[int] = None) -> tuple[Optional[list], Optional[list]]:
        """The first ``count`` entries (all by default) as two lists of (B, Hk, T, D), or (None, None) if none.

        The lists are what ``moda_attention`` takes as ``depth_k``, ``depth_v``.

        Raises:
            ValueError: if ``count`` exceeds the entries written.
        """
        if count is None:
            count = len(self)
        if not (_is_count(count) and count <= len(self)):
            raise ValueError(f"count must be an int in 0..{len(self)} (the entries written), got {count!r}")
        if count == 0:
            return None, None
        return list(self.keys[:count]), list(self.values[:count])
