"""Depth entries stacked into one slab, up to GROUP entries a launch: a program copies BLOCK_R rows of one."""

import triton
import triton.language as tl

# Entries one launch copies: the kernel takes each as a pointer argument of its own.
GROUP = 16


@triton.jit
def stack_kernel(
    OUT, E0, E1, E2, E3, E4, E5, E6, E7, E8, E9, E10, E11, E12, E13, E14, E15,
    rows, Hk, T, L, first, se0, se1, se2, se3,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """``OUT[b, h, t, first + e, :] = E<e>[b, h, t, :]`` for the launch's entries (grid axis 1).

    ``OUT``: a contiguous (B, Hk, T, L, D) slab; the entries (B, Hk, T, D), strides ``se0`` .. ``se3`` alike;
    ``rows`` = B * Hk * T, BLOCK_R of them a program (grid axis 0).
    """
    e = tl.program_id(1)
    src = E0
    if e == 1:
        src = E1
    elif e == 2:
        src = E2
    elif e == 3:
        src = E3
    elif e == 4:
        src = E4
    elif e == 5:
        src = E5
    elif e == 6:
        src = E6
    elif e == 7:
        src = E7
    elif e == 8:
        src = E8
    elif e == 9:
        src = E9
    elif e == 10:
        src = E10
    elif e == 11:
        src = E11
    elif e == 12:
        src = E12
    elif e == 13:
        src = E13
    elif e == 14:
        src = E14
    elif e == 15:
        src = E15
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, DP)
    t = r % T
    h = (r // T) % Hk
    b = r // (T * Hk)
    ok = (r < rows)[:, None] & (d < D)[None, :]
    x = tl.load(src + (b * se0 + h * se1 + t * se2)[:, None] + d[None, :] * se3, mask=ok)
    tl.store(OUT + (r * L + first + e)[:, None] * D + d[None, :], x, mask=ok)
