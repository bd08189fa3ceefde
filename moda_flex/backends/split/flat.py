"""The split path's kernels with every stride a scalar argument, for launches that ``torch.compile`` traces.

As :mod:`moda_flex.backends.triton.kernels.flat` for the fused kernels: a
wrapper takes its kernel's arguments with the stride tuples flattened
(``sq0`` .. ``sq3`` for ``sq``), rebuilds the tuples and casts its floats
to float32 (inductor passes them as float64). The depth kernels' wrappers,
one a direction for both designs (``TOKENS``), take each depth entry as a
pointer argument of its own (``DK0`` .. ``DK63``, ``DV0`` .. ``DV63``,
``TAB``, ``SLOT_PTRS``: :func:`..traced.pointer_depth`), or a side's one slab
or table as ``DK0``, ``DV0``.
"""

import triton
import triton.language as tl

from ..slot_pointers import depth_tables
from .kernels import (
    _depth_backward_kernel, _depth_backward_token_kernel, _depth_forward_kernel, _depth_forward_token_kernel,
)  # fmt: skip


@triton.jit
def depth_forward_flat(
    Q, TAB, OS, LS, O, LO,
    DK0, DK1, DK2, DK3, DK4, DK5, DK6, DK7, DK8, DK9, DK10, DK11, DK12, DK13, DK14, DK15, DK16, DK17, DK18, DK19,
    DK20, DK21, DK22, DK23, DK24, DK25, DK26, DK27, DK28, DK29, DK30, DK31, DK32, DK33, DK34, DK35, DK36, DK37,
    DK38, DK39, DK40, DK41, DK42, DK43, DK44, DK45, DK46, DK47, DK48, DK49, DK50, DK51, DK52, DK53, DK54, DK55,
    DK56, DK57, DK58, DK59, DK60, DK61, DK62, DK63,
    DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7, DV8, DV9, DV10, DV11, DV12, DV13, DV14, DV15, DV16, DV17, DV18, DV19,
    DV20, DV21, DV22, DV23, DV24, DV25, DV26, DV27, DV28, DV29, DV30, DV31, DV32, DV33, DV34, DV35, DV36, DV37,
    DV38, DV39, DV40, DV41, DV42, DV43, DV44, DV45, DV46, DV47, DV48, DV49, DV50, DV51, DV52, DV53, DV54, DV55,
    DV56, DV57, DV58, DV59, DV60, DV61, DV62, DV63,
    sq0, sq1, sq2, sq3, sdk0, sdk1, sdk2, sdk3, sdk4, sdv0, sdv1, sdv2, sdv3, sdv4, sos0, sos1, sos2, sos3,
    sls0, sls1, sls2, so0, so1, so2, so3, slo0, slo1, slo2,
    Hk, Tq, L, depth_first, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, HAS_SEQ: tl.constexpr, CAUSAL: tl.constexpr, SLOTS: tl.constexpr, SLOT_PTRS: tl.constexpr,
    TOKENS: tl.constexpr,
):  # fmt: skip
    """:func:`.kernels._depth_forward_kernel`, or with ``TOKENS`` :func:`.kernels._depth_forward_token_kernel`
    (``BLOCK_C`` unread)."""
    # the first SLOT_PTRS pointers of a side (None after them), or its one table or slab
    dk, dv = depth_tables(TAB, (
        DK0, DK1, DK2, DK3, DK4, DK5, DK6, DK7, DK8, DK9, DK10, DK11, DK12, DK13, DK14, DK15, DK16, DK17, DK18,
        DK19, DK20, DK21, DK22, DK23, DK24, DK25, DK26, DK27, DK28, DK29, DK30, DK31, DK32, DK33, DK34, DK35,
        DK36, DK37, DK38, DK39, DK40, DK41, DK42, DK43, DK44, DK45, DK46, DK47, DK48, DK49, DK50, DK51, DK52,
        DK53, DK54, DK55, DK56, DK57, DK58, DK59, DK60, DK61, DK62, DK63,
    )[:SLOT_PTRS], (
        DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7, DV8, DV9, DV10, DV11, DV12, DV13, DV14, DV15, DV16, DV17, DV18,
        DV19, DV20, DV21, DV22, DV23, DV24, DV25, DV26, DV27, DV28, DV29, DV30, DV31, DV32, DV33, DV34, DV35,
        DV36, DV37, DV38, DV39, DV40, DV41, DV42, DV43, DV44, DV45, DV46, DV47, DV48, DV49, DV50, DV51, DV52,
        DV53, DV54, DV55, DV56, DV57, DV58, DV59, DV60, DV61, DV62, DV63,
    )[:SLOT_PTRS], SLOTS=SLOTS)  # fmt: skip
    if TOKENS:
        _depth_forward_token_kernel(
            Q, dk, dv, OS, LS, O, LO, (sq0, sq1, sq2, sq3), (sdk0, sdk1, sdk2, sdk3, sdk4),
            (sdv0, sdv1, sdv2, sdv3, sdv4), (sos0, sos1, sos2, sos3), (sls0, sls1, sls2), (so0, so1, so2, so3),
            (slo0, slo1, slo2), Hk, Tq, L, depth_first, tl.cast(qk_scale, tl.float32),
            G=G, GP=GP, BLOCK_T=BLOCK_T, D=D, DP=DP, HAS_SEQ=HAS_SEQ, CAUSAL=CAUSAL, SLOTS=SLOTS,
        )  # fmt: skip
    else:
        _depth_forward_kernel(
            Q, dk, dv, OS, LS, O, LO, (sq0, sq1, sq2, sq3), (sdk0, sdk1, sdk2, sdk3, sdk4),
            (sdv0, sdv1, sdv2, sdv3, sdv4), (sos0, sos1, sos2, sos3), (sls0, sls1, sls2), (so0, so1, so2, so3),
            (slo0, slo1, slo2), Hk, Tq, L, depth_first, tl.cast(qk_scale, tl.float32),
            G=G, GP=GP, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, D=D, DP=DP, HAS_SEQ=HAS_SEQ, CAUSAL=CAUSAL, SLOTS=SLOTS,
        )  # fmt: skip


@triton.jit
def depth_backward_flat(
    Q, TAB, O, DO, LSE, GLSE, DQ, DDK, DDV,
    DK0, DK1, DK2, DK3, DK4, DK5, DK6, DK7, DK8, DK9, DK10, DK11, DK12, DK13, DK14, DK15, DK16, DK17, DK18, DK19,
    DK20, DK21, DK22, DK23, DK24, DK25, DK26, DK27, DK28, DK29, DK30, DK31, DK32, DK33, DK34, DK35, DK36, DK37,
    DK38, DK39, DK40, DK41, DK42, DK43, DK44, DK45, DK46, DK47, DK48, DK49, DK50, DK51, DK52, DK53, DK54, DK55,
    DK56, DK57, DK58, DK59, DK60, DK61, DK62, DK63,
    DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7, DV8, DV9, DV10, DV11, DV12, DV13, DV14, DV15, DV16, DV17, DV18, DV19,
    DV20, DV21, DV22, DV23, DV24, DV25, DV26, DV27, DV28, DV29, DV30, DV31, DV32, DV33, DV34, DV35, DV36, DV37,
    DV38, DV39, DV40, DV41, DV42, DV43, DV44, DV45, DV46, DV47, DV48, DV49, DV50, DV51, DV52, DV53, DV54, DV55,
    DV56, DV57, DV58, DV59, DV60, DV61, DV62, DV63,
    sq0, sq1, sq2, sq3, sdk0, sdk1, sdk2, sdk3, sdk4, sdv0, sdv1, sdv2, sdv3, sdv4, so0, so1, so2, so3,
    sdo0, sdo1, sdo2, sdo3, sl0, sl1, sl2, sgl0, sgl1, sgl2, sdq0, sdq1, sdq2, sdq3,
    sgk0, sgk1, sgk2, sgk3, sgk4, sgv0, sgv1, sgv2, sgv3, sgv4,
    Hk, Tq, L, depth_first, scale, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, HAS_GLSE: tl.constexpr, SLOTS: tl.constexpr,
    SLOT_PTRS: tl.constexpr, TOKENS: tl.constexpr,
):  # fmt: skip
    """:func:`.kernels._depth_backward_kernel`, or with ``TOKENS`` :func:`.kernels._depth_backward_token_kernel`
    (``BLOCK_C`` unread)."""
    # the first SLOT_PTRS pointers of a side (None after them), or its one table or slab
    dk, dv = depth_tables(TAB, (
        DK0, DK1, DK2, DK3, DK4, DK5, DK6, DK7, DK8, DK9, DK10, DK11, DK12, DK13, DK14, DK15, DK16, DK17, DK18,
        DK19, DK20, DK21, DK22, DK23, DK24, DK25, DK26, DK27, DK28, DK29, DK30, DK31, DK32, DK33, DK34, DK35,
        DK36, DK37, DK38, DK39, DK40, DK41, DK42, DK43, DK44, DK45, DK46, DK47, DK48, DK49, DK50, DK51, DK52,
        DK53, DK54, DK55, DK56, DK57, DK58, DK59, DK60, DK61, DK62, DK63,
    )[:SLOT_PTRS], (
        DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7, DV8, DV9, DV10, DV11, DV12, DV13, DV14, DV15, DV16, DV17, DV18,
        DV19, DV20, DV21, DV22, DV23, DV24, DV25, DV26, DV27, DV28, DV29, DV30, DV31, DV32, DV33, DV34, DV35,
        DV36, DV37, DV38, DV39, DV40, DV41, DV42, DV43, DV44, DV45, DV46, DV47, DV48, DV49, DV50, DV51, DV52,
        DV53, DV54, DV55, DV56, DV57, DV58, DV59, DV60, DV61, DV62, DV63,
    )[:SLOT_PTRS], SLOTS=SLOTS)  # fmt: skip
    if TOKENS:
        _depth_backward_token_kernel(
            Q, dk, dv, O, DO, LSE, GLSE, DQ, DDK, DDV,
            (sq0, sq1, sq2, sq3), (sdk0, sdk1, sdk2, sdk3, sdk4), (sdv0, sdv1, sdv2, sdv3, sdv4), (so0, so1, so2, so3),
            (sdo0, sdo1, sdo2, sdo3), (sl0, sl1, sl2), (sgl0, sgl1, sgl2), (sdq0, sdq1, sdq2, sdq3),
            (sgk0, sgk1, sgk2, sgk3, sgk4), (sgv0, sgv1, sgv2, sgv3, sgv4),
            Hk, Tq, L, depth_first, tl.cast(scale, tl.float32), tl.cast(qk_scale, tl.float32),
            G=G, GP=GP, BLOCK_T=BLOCK_T, D=D, DP=DP, HAS_GLSE=HAS_GLSE, SLOTS=SLOTS,
        )  # fmt: skip
    else:
        _depth_backward_kernel(
            Q, dk, dv, O, DO, LSE, GLSE, DQ, DDK, DDV,
            (sq0, sq1, sq2, sq3), (sdk0, sdk1, sdk2, sdk3, sdk4), (sdv0, sdv1, sdv2, sdv3, sdv4), (so0, so1, so2, so3),
            (sdo0, sdo1, sdo2, sdo3), (sl0, sl1, sl2), (sgl0, sgl1, sgl2), (sdq0, sdq1, sdq2, sdq3),
            (sgk0, sgk1, sgk2, sgk3, sgk4), (sgv0, sgv1, sgv2, sgv3, sgv4),
            Hk, Tq, L, depth_first, tl.cast(scale, tl.float32), tl.cast(qk_scale, tl.float32),
            G=G, GP=GP, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, D=D, DP=DP, HAS_GLSE=HAS_GLSE, SLOTS=SLOTS,
        )  # fmt: skip


# Each kernel's flat wrapper, and the constants the wrapper takes beyond the kernel's own.
FLAT = {
    _depth_forward_kernel: (depth_forward_flat, dict(TOKENS=False)),
    _depth_forward_token_kernel: (depth_forward_flat, dict(TOKENS=True, BLOCK_C=1)),
    _depth_backward_kernel: (depth_backward_flat, dict(TOKENS=False)),
    _depth_backward_token_kernel: (depth_backward_flat, dict(TOKENS=True, BLOCK_C=1)),
}
