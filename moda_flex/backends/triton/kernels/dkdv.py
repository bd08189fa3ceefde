"""The dK/dV kernel: the gradients of the sequence keys and values, summed over the G query heads that read them."""

import triton
import triton.language as tl

from .common import (
    batch_head, block_rows, documents, head_lanes, load_rows, query_ranges, row_lse2, sequence_score, visible,
)  # fmt: skip


@triton.jit
def _add_dq(DQA, sa, dsT, k, scale, tok, grp, row_ok, offs_d, d_ok):
    """Add one key block's part of dQ, ``dS K * scale`` (BLOCK_M, D), to the rows' float32 sums in ``DQA``.

    Atomic adds: the dQ kernel need not recompute ``QK^T`` and ``dO V^T``, but
    the order of the additions, and so the last bits of dQ, vary between runs.
    """
    dq = tl.dot(tl.trans(dsT), k) * scale
    tl.atomic_add(DQA + grp[:, None] * sa[1] + tok[:, None] * sa[2] + offs_d[None, :], dq,
                  mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")  # fmt: skip


@triton.jit
def _blocks(
    dk, dv, k, v, Q, DO, LSE, DELTA, DQA, sq, sdo, sl, sa, k_pos, k_doc, DOC_IDS, Tq, Tk, window,
    scale, qk_scale, softcap, start, end,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    G: tl.constexpr, ROW_G: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):  # fmt: skip
    """Accumulate dK, dV of one key block over query token blocks [start, end) (and dQ, :func:`_add_dq`).

    ``Q``, ``DO``, ``LSE``, ``DELTA`` and ``DQA`` point at the group's first head.
    """
    BLOCK_T: tl.constexpr = BLOCK_M // ROW_G
    offs_d, d_ok = head_lanes(HEAD_DIM=HEAD_DIM, D_REAL=D_REAL)
    for t0 in range(start, end, BLOCK_T):
        tok, grp, row_ok = block_rows(t0, Tq, G=G, ROW_G=ROW_G, BLOCK_M=BLOCK_M)
        lse = row_lse2(LSE + grp * sl[1] + tok * sl[2], row_ok)
        q = load_rows(Q, sq, tok, grp, row_ok, offs_d, d_ok, HEAD_DIM=HEAD_DIM, D_REAL=D_REAL)
        sT, dcapT = sequence_score(tl.dot(k, tl.trans(q)) * qk_scale, softcap, HAS_SOFTCAP=HAS_SOFTCAP)
        pT = tl.math.exp2(sT - lse[None, :])  # (BLOCK_N, BLOCK_M)
        if MASKED:
            q_pos = tok + (Tk - Tq)
            if DOC:
                q_doc = tl.load(DOC_IDS + q_pos, mask=tok < Tq, other=0)
            else:
                q_doc = q_pos
            vis = visible(q_pos[None, :], q_doc[None, :], k_pos[:, None], Tk, window, DOC_IDS,
                          CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=False)  # fmt: skip
            if DOC:
                vis = vis & (k_doc[:, None] == q_doc[None, :])
            pT = tl.where(vis, pT, 0.0)
        do = load_rows(DO, sdo, tok, grp, row_ok, offs_d, d_ok, HEAD_DIM=HEAD_DIM, D_REAL=D_REAL)
        dv += tl.dot(pT.to(do.dtype), do)
        delta = tl.load(DELTA + grp * sl[1] + tok * sl[2], mask=row_ok, other=0.0)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        if HAS_SOFTCAP:
            dsT *= dcapT
        dsT = dsT.to(q.dtype)
        dk += tl.dot(dsT, q)
        if DQ_ATOMIC:
            _add_dq(DQA, sa, dsT, k, scale, tok, grp, row_ok, offs_d, d_ok)
    return dk, dv


@triton.jit
def _interior_tma(
    dk, dv, k, v, QD, DOD, LSE, DELTA, DQA, DQD, b, hk, sl, sa, Tq, scale, qk_scale, softcap, start, end,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, LOOP_STAGES: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):  # fmt: skip
    """The unmasked query blocks of :func:`_blocks` with q and dO tiles copied by the TMA engine.

    ``QD``, ``DOD``: descriptors with (1, 1, BLOCK_T, GP, D) boxes over Q and
    dO seen as (B, Hk, Tq, G, D); a box is the block's rows in their order,
    rows past Tq or G read as zeros.
    ``DQ_ATOMIC == 2`` adds the block's part of dQ with one bulk reduction of
    the TMA engine per tile, through ``DQD`` (a descriptor like ``QD`` over
    the float32 sums ``DQA``), instead of one atomic per element (the
    interpreter runs only the latter).
    """
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    for t0 in tl.range(start, end, BLOCK_T, num_stages=LOOP_STAGES):
        tok, grp, row_ok = block_rows(t0, Tq, G=G, ROW_G=GP, BLOCK_M=BLOCK_M)
        lse = row_lse2(LSE + grp * sl[1] + tok * sl[2], row_ok)
        q = QD.load([b, hk, t0, 0, 0]).reshape(BLOCK_M, HEAD_DIM)
        do = DOD.load([b, hk, t0, 0, 0]).reshape(BLOCK_M, HEAD_DIM)
        sT, dcapT = sequence_score(tl.dot(k, q.T) * qk_scale, softcap, HAS_SOFTCAP=HAS_SOFTCAP)
        pT = tl.math.exp2(sT - lse[None, :])  # (BLOCK_N, BLOCK_M)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        delta = tl.load(DELTA + grp * sl[1] + tok * sl[2], mask=row_ok, other=0.0)
        dsT = pT * (tl.dot(v, do.T) - delta[None, :])
        if HAS_SOFTCAP:
            dsT *= dcapT
        dsT = dsT.to(q.dtype)
        dk = tl.dot(dsT, q, dk)
        if DQ_ATOMIC == 2:
            dq = tl.dot(tl.trans(dsT), k) * scale
            DQD.atomic_add([b, hk, t0, 0, 0], dq.reshape(1, 1, BLOCK_T, GP, HEAD_DIM))
        elif DQ_ATOMIC:
            offs_d, d_ok = head_lanes(HEAD_DIM=HEAD_DIM, D_REAL=HEAD_DIM)
            _add_dq(DQA, sa, dsT, k, scale, tok, grp, row_ok, offs_d, d_ok)
    return dk, dv


@triton.jit
def dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DKO, DVO, QD, DOD, DOC_IDS, DOC_LO, DOC_HI, DQA, DQD,
    sq, sk, sv, sdo, sl, sg, sa, sdoc,
    Hk, Tq, Tk, window, scale, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, ROW_G: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):  # fmt: skip
    """dK, dV (B, Hk, Tk, D) of one block of BLOCK_N sequence keys, summed over the G heads that read it.

    ``ROW_G``: the rows a query token takes (:func:`.common.block_rows`). This
    kernel has no depth tiles, so its tokens need no padding: G or GP, as the
    launch configuration says; GP with ``TMA``, whose boxes hold GP heads a token.

    ``sg``: the strides of dK and dV (allocated alike). ``TMA`` (Hopper): the
    unmasked query blocks come through the descriptors ``QD``, ``DOD``
    (:func:`_interior_tma`); else they are None. ``DQ_ATOMIC``: also add the block's
    part of dQ to ``DQA``, (B, Hq, Tq, D) float32 sums with unit last stride
    (strides ``sa``), which the dQ kernel began with the depth part
    (:func:`_add_dq`); 2: in the unmasked blocks by bulk reductions through
    ``DQD`` (``TMA`` only).
    """
    tl.static_assert(not TMA or ROW_G == GP, "the descriptors' boxes hold GP rows a token")
    BLOCK_T: tl.constexpr = BLOCK_M // ROW_G
    b, hk = batch_head(Hk)
    n0 = tl.program_id(0) * BLOCK_N
    DOC_IDS, DOC_LO, DOC_HI = documents(DOC_IDS, DOC_LO, DOC_HI, b, sdoc)
    Q += b * sq[0] + hk * G * sq[1]
    DO += b * sdo[0] + hk * G * sdo[1]
    LSE += b * sl[0] + hk * G * sl[1]
    DELTA += b * sl[0] + hk * G * sl[1]
    DQA += b * sa[0] + hk * G * sa[1]

    offs_d, d_ok = head_lanes(HEAD_DIM=HEAD_DIM, D_REAL=D_REAL)
    k_pos = n0 + tl.arange(0, BLOCK_N)
    k_ok = k_pos < Tk
    K += b * sk[0] + hk * sk[1]
    V += b * sv[0] + hk * sv[1]
    k = tl.load(K + k_pos[:, None] * sk[2] + offs_d[None, :] * sk[3], mask=k_ok[:, None], other=0.0)
    v = tl.load(V + k_pos[:, None] * sv[2] + offs_d[None, :] * sv[3], mask=k_ok[:, None], other=0.0)
    if DOC:
        k_doc = tl.load(DOC_IDS + k_pos, mask=k_ok, other=0)
    else:
        k_doc = k_pos
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)

    lo, a, b_, hi = query_ranges(n0, Tq, Tk, window, DOC_LO, DOC_HI,
                                 CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC, BLOCK_N=BLOCK_N, BLOCK_T=BLOCK_T)  # fmt: skip
    dk, dv = _blocks(
        dk, dv, k, v, Q, DO, LSE, DELTA, DQA, sq=sq, sdo=sdo, sl=sl, sa=sa, k_pos=k_pos, k_doc=k_doc,
        DOC_IDS=DOC_IDS, Tq=Tq, Tk=Tk, window=window, scale=scale, qk_scale=qk_scale, softcap=softcap,
        start=lo, end=a, MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC, G=G, ROW_G=ROW_G, HEAD_DIM=HEAD_DIM,
        D_REAL=D_REAL, BLOCK_M=BLOCK_M, HAS_SOFTCAP=HAS_SOFTCAP, DQ_ATOMIC=DQ_ATOMIC,
    )
    if TMA:
        dk, dv = _interior_tma(
            dk, dv, k, v, QD, DOD, LSE, DELTA, DQA, DQD, b=b.to(tl.int32), hk=hk.to(tl.int32), sl=sl, sa=sa,
            Tq=Tq, scale=scale, qk_scale=qk_scale, softcap=softcap, start=a, end=b_, G=G, GP=GP,
            HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, HAS_SOFTCAP=HAS_SOFTCAP, LOOP_STAGES=LOOP_STAGES, DQ_ATOMIC=DQ_ATOMIC,
        )
    else:
        dk, dv = _blocks(
            dk, dv, k, v, Q, DO, LSE, DELTA, DQA, sq=sq, sdo=sdo, sl=sl, sa=sa, k_pos=k_pos, k_doc=k_doc,
            DOC_IDS=DOC_IDS, Tq=Tq, Tk=Tk, window=window, scale=scale, qk_scale=qk_scale, softcap=softcap,
            start=a, end=b_, MASKED=False, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC, G=G, ROW_G=ROW_G, HEAD_DIM=HEAD_DIM,
            D_REAL=D_REAL, BLOCK_M=BLOCK_M, HAS_SOFTCAP=HAS_SOFTCAP, DQ_ATOMIC=DQ_ATOMIC,
        )
    dk, dv = _blocks(
        dk, dv, k, v, Q, DO, LSE, DELTA, DQA, sq=sq, sdo=sdo, sl=sl, sa=sa, k_pos=k_pos, k_doc=k_doc,
        DOC_IDS=DOC_IDS, Tq=Tq, Tk=Tk, window=window, scale=scale, qk_scale=qk_scale, softcap=softcap,
        start=b_, end=hi, MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC, G=G, ROW_G=ROW_G, HEAD_DIM=HEAD_DIM,
        D_REAL=D_REAL, BLOCK_M=BLOCK_M, HAS_SOFTCAP=HAS_SOFTCAP, DQ_ATOMIC=DQ_ATOMIC,
    )
    DKO += b * sg[0] + hk * sg[1]
    DVO += b * sg[0] + hk * sg[1]
    store_ok = k_ok[:, None] & d_ok[None, :]
    offs = k_pos[:, None] * sg[2] + offs_d[None, :] * sg[3]
    tl.store(DKO + offs, (dk * scale).to(DKO.dtype.element_ty), mask=store_ok)
    tl.store(DVO + offs, dv.to(DVO.dtype.element_ty), mask=store_ok)
