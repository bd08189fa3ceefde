"""The layout of the kernel backends' out, and what their backwards take of its gradient.

out is (B, Hq, Tq, D) laid out as (B, Tq, Hq, D) in memory, as SDPA's flash
path returns it, whatever q's layout: a model's
``out.transpose(1, 2).reshape(B, Tq, Hq * D)`` is then a view, not a copy,
and the gradient that comes back through it has out's layout. The kernels
address out and its gradient by their strides, so a gradient is taken as it
comes wherever its last axis has unit stride.
"""

from torch import Tensor


def new_out(q: Tensor) -> Tensor:
    """An unwritten out for queries ``q`` (B, Hq, Tq, D): q's shape and dtype, laid out as (B, Tq, Hq, D)."""
    B, Hq, Tq, D = q.shape
    return q.new_empty(B, Tq, Hq, D).transpose(1, 2)


def unit_last(t: Tensor) -> Tensor:
    """``t`` with unit stride on its last axis, as the kernels index it (a copy only when it has another)."""
    return t if t.stride(-1) == 1 else t.contiguous()
