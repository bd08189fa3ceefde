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

from .dkdv import dkdv_kernel
from .dq import dq_kernel
from .forward import forward_kernel


@triton.jit
def forward_flat(
    Q, K, V, O, LSE, DK_TAB, DV_TAB, DOC_IDS, DOC_LO, DOC_HI, BIAS,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, so0, so1, so2, so3, sl0, sl1, sl2,
    sdk0, sdk1, sdk2, sdk3, sdk4, sdv0, sdv1, sdv2, sdv3, sdv4, sdoc, sbias0, sbias1,
    Hk, Tq, Tk, L, depth_first, window, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_DEPTH: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, WS: tl.constexpr, SLOTS: tl.constexpr,
):  # fmt: skip
    """:func:`.forward.forward_kernel`."""
    qk_scale, softcap = tl.cast(qk_scale, tl.float32), tl.cast(softcap, tl.float32)
    forward_kernel(
        Q, K, V, O, LSE, None, None, None, DK_TAB, DV_TAB, DOC_IDS, DOC_LO, DOC_HI, BIAS,
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
    Q, K, V, O, DO, LSE, GLSE, DELTA, DQO, DDKO, DDVO, GBIAS, DK_TAB, DV_TAB, DOC_IDS, DOC_LO, DOC_HI, BIAS,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, so0, so1, so2, so3, sdo0, sdo1, sdo2, sdo3,
    sl0, sl1, sl2, sgq0, sgq1, sgq2, sgq3, sgd0, sgd1, sgd2, sgd3, sgd4,
    sdk0, sdk1, sdk2, sdk3, sdk4, sdv0, sdv1, sdv2, sdv3, sdv4, sdoc, sbias0, sbias1,
    Hk, Tq, Tk, L, depth_first, window, scale, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_DEPTH: tl.constexpr, HAS_GLSE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr, BIAS_GRAD: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, DEAD_FLAGS: tl.constexpr, SLOTS: tl.constexpr,
    DEPTH_ADD: tl.constexpr,
):  # fmt: skip
    """:func:`.dq.dq_kernel`, without the dead-row flags (a Hopper path's)."""
    scale, qk_scale = tl.cast(scale, tl.float32), tl.cast(qk_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    dq_kernel(
        Q, K, V, O, DO, LSE, GLSE, DELTA, DQO, DDKO, DDVO, GBIAS, None, None, None, DK_TAB, DV_TAB,
        DOC_IDS, DOC_LO, DOC_HI, BIAS,
        (sq0, sq1, sq2, sq3), (sk0, sk1, sk2, sk3), (sv0, sv1, sv2, sv3), (so0, so1, so2, so3),
        (sdo0, sdo1, sdo2, sdo3), (sl0, sl1, sl2), (sgq0, sgq1, sgq2, sgq3), (sgd0, sgd1, sgd2, sgd3, sgd4),
        (sdk0, sdk1, sdk2, sdk3, sdk4), (sdv0, sdv1, sdv2, sdv3, sdv4), sdoc, (sbias0, sbias1),
        Hk, Tq, Tk, L, depth_first, window, scale, qk_scale, softcap,
        G=G, GP=GP, DEPTH_ROWS=DEPTH_ROWS, HEAD_DIM=HEAD_DIM, D_REAL=D_REAL,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC,
        HAS_SEQ=HAS_SEQ, HAS_DEPTH=HAS_DEPTH, HAS_GLSE=HAS_GLSE, HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=HAS_BIAS,
        BIAS_FIRST=BIAS_FIRST, BIAS_GRAD=BIAS_GRAD, TMA=TMA, LOOP_STAGES=LOOP_STAGES, DEAD_FLAGS=DEAD_FLAGS,
        SLOTS=SLOTS, DEPTH_ADD=DEPTH_ADD,
    )  # fmt: skip


@triton.jit
def dkdv_flat(
    Q, K, V, DO, LSE, DELTA, DKO, DVO, DOC_IDS, DOC_LO, DOC_HI, DQA,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sdo0, sdo1, sdo2, sdo3, sl0, sl1, sl2,
    sg0, sg1, sg2, sg3, sa0, sa1, sa2, sdoc,
    Hk, Tq, Tk, window, scale, qk_scale, softcap, dead_blocks,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):  # fmt: skip
    """:func:`.dkdv.dkdv_kernel`, without descriptors (``DQ_ATOMIC`` 0 or 1)."""
    scale, qk_scale = tl.cast(scale, tl.float32), tl.cast(qk_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DKO, DVO, None, None, None, DOC_IDS, DOC_LO, DOC_HI, DQA, None,
        (sq0, sq1, sq2, sq3), (sk0, sk1, sk2, sk3), (sv0, sv1, sv2, sv3), (sdo0, sdo1, sdo2, sdo3),
        (sl0, sl1, sl2), (sg0, sg1, sg2, sg3), (sa0, sa1, sa2), sdoc,
        Hk, Tq, Tk, window, scale, qk_scale, softcap, dead_blocks,
        G=G, GP=GP, HEAD_DIM=HEAD_DIM, D_REAL=D_REAL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC, HAS_SOFTCAP=HAS_SOFTCAP,
        TMA=TMA, LOOP_STAGES=LOOP_STAGES, DQ_ATOMIC=DQ_ATOMIC,
    )  # fmt: skip


# Each kernel's flat wrapper.
FLAT = {forward_kernel: forward_flat, dq_kernel: dq_flat, dkdv_kernel: dkdv_flat}
