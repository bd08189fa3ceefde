"""The three kernels with every stride a scalar argument, for launches that ``torch.compile`` traces.

Inductor launches a kernel of a traced op itself, and takes scalars and
tensors as its arguments, not tuples. Each wrapper takes the strides one by
one (``sq0`` .. ``sq3`` for ``sq``), rebuilds the tuples and runs its
kernel on the generic path (no tensor descriptors: ``TMA`` off). A
wrapper's arguments are its kernel's with the tuples flattened
(:func:`moda_flex.backends.traced.flat_arguments`). Inductor passes
a float as float64 where the GPU has it: each wrapper casts its floats to
float32, as Triton's own launch types them.
"""

import triton
import triton.language as tl

from ...slot_pointers import depth_tables
from .dkdv import dkdv_kernel
from .dq import dq_kernel
from .forward import forward_kernel


@triton.jit
def forward_flat(
    Q, K, V, O, LSE, DOC_IDS, DOC_LO, DOC_HI, BIAS, TAB,
    DK0, DK1, DK2, DK3, DK4, DK5, DK6, DK7, DK8, DK9, DK10, DK11, DK12, DK13, DK14, DK15, DK16, DK17, DK18, DK19,
    DK20, DK21, DK22, DK23, DK24, DK25, DK26, DK27, DK28, DK29, DK30, DK31, DK32, DK33, DK34, DK35, DK36, DK37,
    DK38, DK39, DK40, DK41, DK42, DK43, DK44, DK45, DK46, DK47, DK48, DK49, DK50, DK51, DK52, DK53, DK54, DK55,
    DK56, DK57, DK58, DK59, DK60, DK61, DK62, DK63,
    DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7, DV8, DV9, DV10, DV11, DV12, DV13, DV14, DV15, DV16, DV17, DV18, DV19,
    DV20, DV21, DV22, DV23, DV24, DV25, DV26, DV27, DV28, DV29, DV30, DV31, DV32, DV33, DV34, DV35, DV36, DV37,
    DV38, DV39, DV40, DV41, DV42, DV43, DV44, DV45, DV46, DV47, DV48, DV49, DV50, DV51, DV52, DV53, DV54, DV55,
    DV56, DV57, DV58, DV59, DV60, DV61, DV62, DV63,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, so0, so1, so2, so3, sl0, sl1, sl2,
    sdk0, sdk1, sdk2, sdk3, sdk4, sdv0, sdv1, sdv2, sdv3, sdv4, sdoc, sbias0, sbias1,
    Hk, Tq, Tk, L, depth_first, window, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_DEPTH: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, WS: tl.constexpr, SLOTS: tl.constexpr, SLOT_PTRS: tl.constexpr,
):  # fmt: skip
    """:func:`.forward.forward_kernel`."""
    qk_scale, softcap = tl.cast(qk_scale, tl.float32), tl.cast(softcap, tl.float32)
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
    forward_kernel(
        Q, K, V, O, LSE, None, None, None, dk, dv, DOC_IDS, DOC_LO, DOC_HI, BIAS,
        (sq0, sq1, sq2, sq3), (sk0, sk1, sk2, sk3), (sv0, sv1, sv2, sv3), (so0, so1, so2, so3), (sl0, sl1, sl2),
        (sdk0, sdk1, sdk2, sdk3, sdk4), (sdv0, sdv1, sdv2, sdv3, sdv4), sdoc, (sbias0, sbias1),
        Hk, Tq, Tk, L, depth_first, window, qk_scale, softcap,
        G=G, GP=GP, DEPTH_ROWS=DEPTH_ROWS, HEAD_DIM=HEAD_DIM, D_REAL=D_REAL,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC,
        HAS_SEQ=HAS_SEQ, HAS_DEPTH=HAS_DEPTH, HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=HAS_BIAS, BIAS_FIRST=BIAS_FIRST,
        TMA=TMA, LOOP_STAGES=LOOP_STAGES, WS=WS, SLOTS=SLOTS,
    )  # fmt: skip


@triton.jit
def dq_flat(
    Q, K, V, O, DO, LSE, GLSE, DELTA, DQO, DDKO, DDVO, GBIAS, DOC_IDS, DOC_LO, DOC_HI, BIAS, TAB,
    DK0, DK1, DK2, DK3, DK4, DK5, DK6, DK7, DK8, DK9, DK10, DK11, DK12, DK13, DK14, DK15, DK16, DK17, DK18, DK19,
    DK20, DK21, DK22, DK23, DK24, DK25, DK26, DK27, DK28, DK29, DK30, DK31, DK32, DK33, DK34, DK35, DK36, DK37,
    DK38, DK39, DK40, DK41, DK42, DK43, DK44, DK45, DK46, DK47, DK48, DK49, DK50, DK51, DK52, DK53, DK54, DK55,
    DK56, DK57, DK58, DK59, DK60, DK61, DK62, DK63,
    DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7, DV8, DV9, DV10, DV11, DV12, DV13, DV14, DV15, DV16, DV17, DV18, DV19,
    DV20, DV21, DV22, DV23, DV24, DV25, DV26, DV27, DV28, DV29, DV30, DV31, DV32, DV33, DV34, DV35, DV36, DV37,
    DV38, DV39, DV40, DV41, DV42, DV43, DV44, DV45, DV46, DV47, DV48, DV49, DV50, DV51, DV52, DV53, DV54, DV55,
    DV56, DV57, DV58, DV59, DV60, DV61, DV62, DV63,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, so0, so1, so2, so3, sdo0, sdo1, sdo2, sdo3,
    sl0, sl1, sl2, sgq0, sgq1, sgq2, sgq3, sgd0, sgd1, sgd2, sgd3, sgd4,
    sdk0, sdk1, sdk2, sdk3, sdk4, sdv0, sdv1, sdv2, sdv3, sdv4, sdoc, sbias0, sbias1,
    Hk, Tq, Tk, L, depth_first, window, scale, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_DEPTH: tl.constexpr, HAS_GLSE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr, BIAS_GRAD: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, SLOTS: tl.constexpr, SLOT_PTRS: tl.constexpr,
):  # fmt: skip
    """:func:`.dq.dq_kernel`, without descriptors."""
    scale, qk_scale = tl.cast(scale, tl.float32), tl.cast(qk_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
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
    dq_kernel(
        Q, K, V, O, DO, LSE, GLSE, DELTA, DQO, DDKO, DDVO, GBIAS, None, None, dk, dv,
        DOC_IDS, DOC_LO, DOC_HI, BIAS,
        (sq0, sq1, sq2, sq3), (sk0, sk1, sk2, sk3), (sv0, sv1, sv2, sv3), (so0, so1, so2, so3),
        (sdo0, sdo1, sdo2, sdo3), (sl0, sl1, sl2), (sgq0, sgq1, sgq2, sgq3), (sgd0, sgd1, sgd2, sgd3, sgd4),
        (sdk0, sdk1, sdk2, sdk3, sdk4), (sdv0, sdv1, sdv2, sdv3, sdv4), sdoc,
        (sbias0, sbias1), Hk, Tq, Tk, L, depth_first, window, scale, qk_scale, softcap,
        G=G, GP=GP, DEPTH_ROWS=DEPTH_ROWS, HEAD_DIM=HEAD_DIM, D_REAL=D_REAL,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC,
        HAS_SEQ=HAS_SEQ, HAS_DEPTH=HAS_DEPTH, HAS_GLSE=HAS_GLSE, HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=HAS_BIAS,
        BIAS_FIRST=BIAS_FIRST, BIAS_GRAD=BIAS_GRAD, TMA=TMA, LOOP_STAGES=LOOP_STAGES,
        SLOTS=SLOTS,
    )  # fmt: skip


@triton.jit
def dkdv_flat(
    Q, K, V, DO, LSE, DELTA, DKO, DVO, DOC_IDS, DOC_LO, DOC_HI, DQA,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sdo0, sdo1, sdo2, sdo3, sl0, sl1, sl2,
    sg0, sg1, sg2, sg3, sa0, sa1, sa2, sdoc,
    Hk, Tq, Tk, window, scale, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, ROW_G: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):  # fmt: skip
    """:func:`.dkdv.dkdv_kernel`, without descriptors (``DQ_ATOMIC`` 0 or 1)."""
    scale, qk_scale = tl.cast(scale, tl.float32), tl.cast(qk_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DKO, DVO, None, None, DOC_IDS, DOC_LO, DOC_HI, DQA, None,
        (sq0, sq1, sq2, sq3), (sk0, sk1, sk2, sk3), (sv0, sv1, sv2, sv3), (sdo0, sdo1, sdo2, sdo3),
        (sl0, sl1, sl2), (sg0, sg1, sg2, sg3), (sa0, sa1, sa2), sdoc,
        Hk, Tq, Tk, window, scale, qk_scale, softcap,
        G=G, GP=GP, ROW_G=ROW_G, HEAD_DIM=HEAD_DIM, D_REAL=D_REAL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC, HAS_SOFTCAP=HAS_SOFTCAP,
        TMA=TMA, LOOP_STAGES=LOOP_STAGES, DQ_ATOMIC=DQ_ATOMIC,
    )  # fmt: skip


# Each kernel's flat wrapper.
FLAT = {forward_kernel: forward_flat, dq_kernel: dq_flat, dkdv_kernel: dkdv_flat}
