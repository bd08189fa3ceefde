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
same entries twice. A stream built with gradients (eagerly, or compiled on
CUDA with static shapes) also carries a gradient path, whose gradient is one
buffer of all its entries' gradients: :meth:`DepthStream.attend` has each
layer add its depth gradients to it, rather than autograd summing each
entry's gradients one layer at a time (:mod:`moda_flex.backends.chain`,
:func:`buffers_gradients`).
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


class _Append(torch.autograd.Function):
    """A gradient path one slot longer; its gradient's last slot is the new entry's k and v gradient."""

    @staticmethod
    def forward(ctx, path, k, v):
        ctx.set_materialize_grads(False)  # no reader after: None, not a buffer of zeros
        two, B, Hk, T, n, D = path.shape
        return path.new_empty(()).expand(two, B, Hk, T, n + 1, D)  # never read: one element, expanded

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None
        n = grad.shape[4] - 1
        return grad[:, :, :, :, :n], grad[0, :, :, :, n], grad[1, :, :, :, n]


def buffers_gradients(choice: Optional[bool], k: Tensor) -> bool:
    """Whether a stream with ``gradient_buffer=choice``, given the entry ``k``, gives its entries their gradients
    through one buffer (:meth:`DepthStream.attend`). ``None``: eagerly, and compiled where the calls take the
    traced ops (CUDA, static shapes: :func:`moda_flex.backends.traced.traceable`).

    Eagerly autograd sums each entry's gradients one layer at a time, a kernel each, which the buffer spares
    (NVIDIA H100, the Table 6 step with FFN entries, BENCHMARKS.md "One gradient buffer a stream": 135.7 ->
    114.6 ms). Compiled, inductor fuses those sums into one kernel an entry, which runs once the last reader's
    gradient exists and so holds every layer's depth gradients until then; the traced calls' buffer, summed
    layer by layer, does not (the same step compiled, BENCHMARKS.md "A gradient buffer compiled": peak
    memory 1.39x -> 1.17x the baseline's, step 1.56x -> 1.53x). Compiled with dynamic shapes the calls are
    opaque ops, whose host time the buffer's extra op adds to.
    """
    if choice is not None:
        return choice
    if not torch.compiler.is_compiling():
        return True
    if not k.is_cuda:
        return False
    from .backends.traced import traceable  # CUDA: triton is there

    return traceable(k)


def _path_after(stream: "DepthStream", k: Tensor, v: Tensor) -> Optional[Tensor]:
    """The gradient path of ``stream`` with (k, v) appended: (2, B, Hk, T, n + 1, D); None where the entries
    get no gradient (no grad mode, or no entry needs one), the stream's gradients are not buffered
    (:func:`buffers_gradients`) or the path would not cover every entry."""
    if not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or stream.gradients is not None)):
        return None
    if not buffers_gradients(stream.gradient_buffer, k):
        return None
    path = stream.gradients
    if path is None:
        if len(stream):  # the earlier entries have no path: their gradients could not be handed back
            return None
        B, Hk, T, D = k.shape
        path = k.new_empty(()).expand(2, B, Hk, T, 0, D)
    return _Append.apply(path, k, v)


def _is_count(value) -> bool:
    """Whether ``value`` is an int >= 0 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclasses.dataclass(frozen=True)
class DepthStream:
    """The depth K/V written so far in one forward pass: an immutable sequence of entries.

    Each attention layer reads the stream, then appends its own K/V; with FFN
    depth, each FFN appends one more. ``append`` returns the longer stream::

        depth = DepthStream(capacity=2 * n_layer, readers=n_layer)
        for block in blocks:
            x, depth = block(x, depth)     # reads depth.read(), returns depth.append(k, v)...

    Attributes:
        capacity: the most entries the pass may append, or None for no limit.
        readers: the most times the pass may :meth:`attend` over the stream,
            or None for no limit. The last of those reads hands on no
            gradient path: nothing reads the entries after it, and compiled,
            a path that no later layer reads has a gradient of zeros, which
            the step would fill and the last reader's backward add (a
            buffer of every entry: 0.4 GB at Table 6 with FFN entries).
        reads: how many times the pass has attended over the stream so far.
        keys, values: the entries, each (B, Hk, T, D), oldest first.
        gradient_buffer: whether :meth:`attend` gathers the entries'
            gradients in one buffer: True, False, or None (the default:
            eagerly, and compiled on CUDA with static shapes;
            :func:`buffers_gradients` says why).
        gradients: the gradient path (2, B, Hk, T, n, D) of :meth:`attend`,
            or None: a stream appended to with gradients into a buffer has one.
    """

    capacity: Optional[int] = None
    keys: tuple = ()
    values: tuple = ()
    gradient_buffer: Optional[bool] = None
    gradients: Optional[Tensor] = dataclasses.field(default=None, compare=False, repr=False)
    readers: Optional[int] = None
    reads: int = 0

    def __post_init__(self):
        for name in ("capacity", "readers"):
            limit = getattr(self, name)
            if limit is not None and not _is_count(limit):
                raise ValueError(f"{name} must be an int >= 0 or None, got {limit!r}")
        if not _is_count(self.reads):
            raise ValueError(f"reads must be an int >= 0, got {self.reads!r}")
        if self.gradient_buffer not in (None, True, False):
            raise ValueError(f"gradient_buffer must be True, False or None, got {self.gradient_buffer!r}")
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
        return dataclasses.replace(self, keys=self.keys + (k,), values=self.values + (v,),
                                   gradients=_path_after(self, k, v))  # fmt: skip

    def attend(self, q: Tensor, k: Tensor, v: Tensor, **options) -> tuple:
        """``moda_attention`` over ``[k, v | every entry of the stream]``; returns its result and the stream.

        The same as ``moda_attention(q, k, v, *stream.read(), **options)``,
        except that where the backend is a kernel one that adds into the
        stream's gradient buffer (:mod:`moda_flex.backends.chain`), the
        entries' gradients gather there: one pass a layer, not a sum of
        each entry's gradients per layer.

        Args:
            q: (B, Hq, Tq, D); k, v: (B, Hk, Tk, D), as ``moda_attention`` takes them.
            options: ``moda_attention``'s keyword arguments (variant, score,
                scale, backend, return_lse).

        Returns:
            what ``moda_attention`` returns, and the stream to read or append
            to next (its entries are these; its gradient path goes on, but
            for the last of ``readers``).

        Raises:
            ValueError: once the stream was read ``readers`` times.
        """
        if self.readers is not None and self.reads >= self.readers:
            raise ValueError(f"the depth stream was read by all its {self.readers} readers")
        from .attention import stream_attention

        return stream_attention(q, k, v, self, **options)

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
