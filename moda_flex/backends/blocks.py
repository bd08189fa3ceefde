"""Block arithmetic and launch arguments the kernel backends share."""

import functools
from typing import Sequence


def cdiv(a, b):
    """The number of blocks of ``b`` that cover ``a``: ceil(a / b), for ints or integer tensors, ``b > 0``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``): a block size Triton can tile."""
    return 1 << max(0, (n - 1).bit_length())


def stride_args(prefix: str, strides: Sequence[int], axes: str) -> dict:
    """A tensor's stride arguments by name: ``stride_args("sq", q.stride(), "bht")`` gives sqb, sqh, sqt."""
    return dict(zip(_stride_names(prefix, axes), strides))


@functools.lru_cache(maxsize=None)
def _stride_names(prefix: str, axes: str) -> tuple[str, ...]:
    return tuple(prefix + axis for axis in axes)
