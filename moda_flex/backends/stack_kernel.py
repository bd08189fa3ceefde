"""Depth entries stacked into one slab a side, both sides in one launch, up to GROUP entries a side a launch.

A program copies BLOCK_R rows of one entry.
"""

import triton
import triton.language as tl

# Entries of a side one launch copies: the kernel takes each as a pointer argument of its own.
GROUP = 32


@triton.jit
def stack_kernel(
    OUT_K, OUT_V,
    K0, K1, K2, K3, K4, K5, K6, K7, K8, K9, K10, K11, K12, K13, K14, K15,
    K16, K17, K18, K19, K20, K21, K22, K23, K24, K25, K26, K27, K28, K29, K30, K31,
    V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11, V12, V13, V14, V15,
    V16, V17, V18, V19, V20, V21, V22, V23, V24, V25, V26, V27, V28, V29, V30, V31,
    rows, Hk, T, L, first, count, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """``OUT_K[b, h, t, first + e, :] = K<e>[b, h, t, :]`` for the launch's ``count`` key entries, and
    ``OUT_V`` from ``V<e>`` likewise: grid axis 1 is the entry, the keys' then the values'.

    ``OUT_K``, ``OUT_V``: contiguous (B, Hk, T, L, D) slabs; the entries (B, Hk, T, D), the keys' strides
    ``sk0`` .. ``sk3``, the values' ``sv0`` .. ``sv3``; ``rows`` = B * Hk * T, BLOCK_R of them a program (grid
    axis 0).
    """
    e = tl.program_id(1)
    if e < count:
        src = _entry(
            e,
            K0, K1, K2, K3, K4, K5, K6, K7, K8, K9, K10, K11, K12, K13, K14, K15,
            K16, K17, K18, K19, K20, K21, K22, K23, K24, K25, K26, K27, K28, K29, K30, K31,
        )  # fmt: skip
        _copy_rows(src, OUT_K, rows, Hk, T, L, first + e, sk0, sk1, sk2, sk3, D, DP, BLOCK_R)
    else:
        src = _entry(
            e - count,
            V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11, V12, V13, V14, V15,
            V16, V17, V18, V19, V20, V21, V22, V23, V24, V25, V26, V27, V28, V29, V30, V31,
        )  # fmt: skip
        _copy_rows(src, OUT_V, rows, Hk, T, L, first + e - count, sv0, sv1, sv2, sv3, D, DP, BLOCK_R)


@triton.jit
def _entry(
    e,
    E0, E1, E2, E3, E4, E5, E6, E7, E8, E9, E10, E11, E12, E13, E14, E15,
    E16, E17, E18, E19, E20, E21, E22, E23, E24, E25, E26, E27, E28, E29, E30, E31,
):  # fmt: skip
    """The pointer argument ``E<e>``."""
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
    elif e == 16:
        src = E16
    elif e == 17:
        src = E17
    elif e == 18:
        src = E18
    elif e == 19:
        src = E19
    elif e == 20:
        src = E20
    elif e == 21:
        src = E21
    elif e == 22:
        src = E22
    elif e == 23:
        src = E23
    elif e == 24:
        src = E24
    elif e == 25:
        src = E25
    elif e == 26:
        src = E26
    elif e == 27:
        src = E27
    elif e == 28:
        src = E28
    elif e == 29:
        src = E29
    elif e == 30:
        src = E30
    elif e == 31:
        src = E31
    return src


@triton.jit
def _copy_rows(src, OUT, rows, Hk, T, L, slot, s0, s1, s2, s3, D: tl.constexpr, DP: tl.constexpr,
               BLOCK_R: tl.constexpr):  # fmt: skip
    """This program's rows of entry ``src`` (strides ``s0`` .. ``s3``) into slot ``slot`` of the slab ``OUT``."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, DP)
    t = r % T
    h = (r // T) % Hk
    b = r // (T * Hk)
    ok = (r < rows)[:, None] & (d < D)[None, :]
    x = tl.load(src + (b * s0 + h * s1 + t * s2)[:, None] + d[None, :] * s3, mask=ok)
    tl.store(OUT + (r * L + slot)[:, None] * D + d[None, :], x, mask=ok)
