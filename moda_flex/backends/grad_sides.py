"""How a backward kernel reaches the depth gradients it writes, and the gradient buffer it adds to them.

The keys' and values' depth gradients, (B, Hk, Tq, L, D) each, reach a kernel
as a pair of pointers with their strides: two tensors, or one
(2, B, Hk, Tq, L, D) buffer, a depth stream's (:mod:`.chain`), whose values'
side the kernel finds ``at`` elements past its keys' (the second pointer
None: :func:`.slot_pointers.second_side`). A traced kernel must be given a buffer so: given
the buffer's two halves as views, inductor would copy them.
"""

from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

# Two (B, Hk, Tq, L, D) tensors, the keys' and the values' depth gradients, or one (2, B, Hk, Tq, L, D) buffer.
Sides = Union[tuple[Tensor, Tensor], Tensor]


def side_arguments(sides: Sides) -> tuple[Tensor, Optional[Tensor], int, tuple, tuple]:
    """A kernel's arguments for ``sides``: the keys' pointer, the values' (None for a buffer), how far the
    values lie past the keys in a buffer (else 0), and each side's (b, h, t, l, d) strides."""
    if isinstance(sides, Tensor):
        return sides, None, sides.stride(0), sides.stride()[1:], sides.stride()[1:]
    keys, values = sides
    return keys, values, 0, keys.stride(), values.stride()
