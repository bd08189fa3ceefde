"""Block arithmetic the backends share."""


def cdiv(a, b):
    """The number of blocks of ``b`` that cover ``a``: ceil(a / b), for ints or integer tensors, ``b > 0``."""
    return -(-a // b)
