"""Block arithmetic the kernel backends share."""


def cdiv(a, b):
    """The number of blocks of ``b`` that cover ``a``: ceil(a / b), for ints or integer tensors, ``b > 0``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``): a block size Triton can tile."""
    return 1 << max(0, (n - 1).bit_length())
