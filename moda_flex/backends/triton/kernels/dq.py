"""The dQ kernel: dQ of a block of rows, the depth (and depth bias) gradients of its tokens, and delta."""

import triton
import triton.language as tl

from ...slot_pointers import slot_bases
from .common import (
    batch_head, bias_tile, block_rows, depth_offsets, depth_tiles, documents, head_lanes,
    key_columns,
    load_rows, query_block, query_keys, row_lse2, score, sequence_score, store_rows, visible,
)  # fmt: skip


@triton.jit
def _seq_blocks(
    dq, q, do, lse, delta, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS, start, end, Tk, window, qk_scale, softcap,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Accumulate dQ (unscaled) over key blocks [start, end)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + offs_n
        kT = key_columns(k_ptrs, k_pos, skt, Tk, MASKED=MASKED)
        vT = key_columns(v_ptrs, k_pos, svt, Tk, MASKED=MASKED)
        s, dcap = sequence_score(tl.dot(q, kT) * qk_scale, softcap, HAS_SOFTCAP=HAS_SOFTCAP)
        p = tl.math.exp2(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
        if MASKED:
            vis = visible(q_pos[:, None], q_doc[:, None], k_pos[None, :], Tk, window, DOC_IDS,
                          CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC)  # fmt: skip
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, vT)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds *= dcap
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    return dq


@triton.jit
def _interior_tma(
    dq, q, do, lse, delta, KD, VD, b, hk, start, end, qk_scale, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, LOOP_STAGES: tl.constexpr,
):  # fmt: skip
    """The unmasked blocks of :func:`_seq_blocks` with K and V tiles (BLOCK_N, D) copied by the TMA engine."""
    for start_n in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
        k = KD.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = VD.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        s, dcap = sequence_score(tl.dot(q, k.T) * qk_scale, softcap, HAS_SOFTCAP=HAS_SOFTCAP)
        p = tl.math.exp2(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
        ds = p * (tl.dot(do, v.T) - delta[:, None])
        if HAS_SOFTCAP:
            ds *= dcap
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _sequence(
    dq, q, do, lse, delta, K, V, KD, VD, b, hk, sk, sv, offs_d, q_pos, q_doc, DOC_IDS, lo, a, b_, hi,
    Tk, window, qk_scale, softcap,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, TMA: tl.constexpr, LOOP_STAGES: tl.constexpr,
):  # fmt: skip
    """dQ over the key ranges of :func:`.common.key_ranges`, as the forward visits them: masked, unmasked, masked.

    With ``TMA`` the unmasked blocks read K and V through the descriptors ``KD``, ``VD``.
    """
    k_ptrs = K + offs_d[:, None] * sk[3]
    v_ptrs = V + offs_d[:, None] * sv[3]
    dq = _seq_blocks(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, sk[2], sv[2], q_pos, q_doc, DOC_IDS, start=lo, end=a, Tk=Tk,
        window=window, qk_scale=qk_scale, softcap=softcap, MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC,
        HAS_SOFTCAP=HAS_SOFTCAP, BLOCK_N=BLOCK_N,
    )
    if TMA:
        dq = _interior_tma(
            dq, q, do, lse, delta, KD, VD, b, hk, start=a, end=b_, qk_scale=qk_scale, softcap=softcap,
            HAS_SOFTCAP=HAS_SOFTCAP, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, LOOP_STAGES=LOOP_STAGES,
        )
    else:
        dq = _seq_blocks(
            dq, q, do, lse, delta, k_ptrs, v_ptrs, sk[2], sv[2], q_pos, q_doc, DOC_IDS, start=a, end=b_, Tk=Tk,
            window=window, qk_scale=qk_scale, softcap=softcap, MASKED=False, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC,
            HAS_SOFTCAP=HAS_SOFTCAP, BLOCK_N=BLOCK_N,
        )
    return _seq_blocks(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, sk[2], sv[2], q_pos, q_doc, DOC_IDS, start=b_, end=hi, Tk=Tk,
        window=window, qk_scale=qk_scale, softcap=softcap, MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC,
        HAS_SOFTCAP=HAS_SOFTCAP, BLOCK_N=BLOCK_N,
    )


@triton.jit
def _store_bias_grad(GBIAS, ds, l0, L, G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr,
                     BLOCK_C: tl.constexpr):  # fmt: skip
    """Sum a depth tile's dS (U, DEPTH_ROWS, BLOCK_C) per (head, slot) into slots ``l0 ...`` of a (GP, L) row.

    Row ``r`` of a tile is head ``r % GP`` of its token ``r // GP``; column
    ``c`` is slot ``c % BLOCK_S`` of token ``c // BLOCK_S``. dS is zero off a
    row's own token, so summing over all tokens of rows and columns keeps
    exactly the own-token terms.
    """
    P: tl.constexpr = DEPTH_ROWS // GP
    BLOCK_S: tl.constexpr = BLOCK_C // P
    g = tl.sum(ds, 0)  # (DEPTH_ROWS, BLOCK_C)
    g = tl.sum(tl.reshape(g, (P, GP, BLOCK_C)), 0)  # (GP, BLOCK_C)
    g = tl.sum(tl.reshape(g, (GP, P, BLOCK_S)), 1)  # (GP, BLOCK_S)
    head = tl.arange(0, GP)
    slot = l0 + tl.arange(0, BLOCK_S)
    tl.store(GBIAS + head[:, None] * L + slot[None, :], g, mask=(head < G)[:, None] & (slot < L)[None, :])


@triton.jit
def _depth(
    dq, q, do, lse, delta, DK_TAB, DV_TAB, DDKO, DDVO, BIAS, GBIAS, b, hk, t0, offs_d, d_ok, sdk, sdv, sgd, sbias,
    Tq, L, depth_first, scale, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr, BIAS_GRAD: tl.constexpr,
    SLOTS: tl.constexpr,
):  # fmt: skip
    """The depth phase of the backward in the forward's tiles: dQ, and the depth (and bias) gradients written.

    ``DDKO``, ``DDVO`` point at this program's head of the (B, Hk, Tq, L, D)
    gradients (strides ``sgd``). A token's depth entries are read only by its
    own G rows, which all live in this block, so its depth gradients are
    written once, without atomics.
    """
    U: tl.constexpr = BLOCK_M // DEPTH_ROWS
    BLOCK_S: tl.constexpr = BLOCK_C // (DEPTH_ROWS // GP)
    col_token, col_slot, own = depth_tiles(t0, DEPTH_ROWS=DEPTH_ROWS, GP=GP, BLOCK_M=BLOCK_M, BLOCK_C=BLOCK_C)
    dk_offs = depth_offsets(b, hk, col_token, offs_d, sdk, KEYS_T=False)  # (U, BLOCK_C, D)
    dv_offs = depth_offsets(b, hk, col_token, offs_d, sdv, KEYS_T=False)
    grad_offs = col_token.to(tl.int64)[:, :, None] * sgd[2] + offs_d[None, None, :] * sgd[4]
    q3 = tl.reshape(q, (U, DEPTH_ROWS, HEAD_DIM))
    do3 = tl.reshape(do, (U, DEPTH_ROWS, HEAD_DIM))
    lse3 = tl.reshape(lse, (U, DEPTH_ROWS))
    delta3 = tl.reshape(delta, (U, DEPTH_ROWS))
    dq3 = tl.reshape(dq, (U, DEPTH_ROWS, HEAD_DIM))
    for l0 in range(depth_first, L, BLOCK_S):
        slot = l0 + col_slot  # (BLOCK_C,)
        col_ok = ((col_token < Tq) & (slot < L)[None, :])[:, :, None]  # (U, BLOCK_C, 1)
        store_ok = col_ok & d_ok[None, None, :]
        dk_slot, dv_slot = slot_bases(DK_TAB, DV_TAB, slot, L, sdk, sdv, ELEM=q.dtype, SLOTS=SLOTS)
        kd = tl.load(dk_slot[None, :, None] + dk_offs, mask=col_ok, other=0.0)  # (U, BLOCK_C, D)
        vd = tl.load(dv_slot[None, :, None] + dv_offs, mask=col_ok, other=0.0)
        bias = 0.0
        if HAS_BIAS:
            bias = bias_tile(BIAS, sbias, slot, L, G=G, GP=GP, DEPTH_ROWS=DEPTH_ROWS)
        s, dcap = score(tl.dot(q3, tl.permute(kd, (0, 2, 1))) * qk_scale, bias, softcap,
                        HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=HAS_BIAS, BIAS_FIRST=BIAS_FIRST)  # fmt: skip
        p = tl.math.exp2(s - lse3[:, :, None])
        p = tl.where(own[None, :, :] & (slot < L)[None, None, :], p, 0.0)  # (U, DEPTH_ROWS, BLOCK_C)
        dp = tl.dot(do3, tl.permute(vd, (0, 2, 1)))
        ds = p * (dp - delta3[:, :, None])  # gradient of the scored logit
        if BIAS_GRAD and not BIAS_FIRST:  # bias added last: its gradient is dS itself
            _store_bias_grad(GBIAS, ds, l0, L, G=G, GP=GP, DEPTH_ROWS=DEPTH_ROWS, BLOCK_C=BLOCK_C)
        if HAS_SOFTCAP:
            ds *= dcap
        if BIAS_GRAD and BIAS_FIRST:  # bias added before the cap: its gradient is the raw logit's
            _store_bias_grad(GBIAS, ds, l0, L, G=G, GP=GP, DEPTH_ROWS=DEPTH_ROWS, BLOCK_C=BLOCK_C)
        dq3 += tl.dot(ds.to(kd.dtype), kd)
        # a column's gradient sums over its own token's G rows (p and ds are zero elsewhere)
        gv = tl.dot(tl.permute(p, (0, 2, 1)).to(do3.dtype), do3)  # (U, BLOCK_C, D)
        gk = tl.dot(tl.permute(ds, (0, 2, 1)).to(q3.dtype), q3) * scale
        slot_offs = grad_offs + slot[None, :, None] * sgd[3]
        tl.store(DDKO + slot_offs, gk.to(DDKO.dtype.element_ty), mask=store_ok)
        tl.store(DDVO + slot_offs, gv.to(DDVO.dtype.element_ty), mask=store_ok)
    return tl.reshape(dq3, (BLOCK_M, HEAD_DIM))


@triton.jit
def dq_kernel(
    Q, K, V, O, DO, LSE, GLSE, DELTA, DQO, DDKO, DDVO, GBIAS, KD, VD, DK_TAB, DV_TAB, DOC_IDS, DOC_LO,
    DOC_HI, BIAS,
    sq, sk, sv, so, sdo, sl, sgq, sgd, sdk, sdv, sdoc, sbias,
    Hk, Tq, Tk, L, depth_first, window, scale, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_DEPTH: tl.constexpr, HAS_GLSE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr, BIAS_GRAD: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, SLOTS: tl.constexpr,
):  # fmt: skip
    """dQ of one query block, the depth gradients of its tokens, and DELTA of its rows for the dK/dV kernel.

    ``DELTA = rowsum(dO * O) - dLSE`` (so that ``dS = P * (dP - DELTA)`` also
    carries the lse gradient; LSE, GLSE and DELTA share the strides ``sl``).
    ``sgq``: dQ's strides; ``sgd``: the depth gradients' (b, h, t, l, d). With
    ``BIAS_GRAD``, the program also writes its part of the depth bias's
    gradient, summed over its tokens: row ``(b, hk, block)`` of GBIAS
    (B * Hk, blocks, GP, L) float32, which the launcher reduces. ``TMA``
    (Hopper): the unmasked key blocks come through the descriptors ``KD``,
    ``VD`` (:func:`_interior_tma`), else they are None. The depth gradients go to
    ``DDKO``, ``DDVO`` (strides ``sgd``).
    """
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    b, hk = batch_head(Hk)
    block = query_block()
    t0 = block * BLOCK_T
    DOC_IDS, DOC_LO, DOC_HI = documents(DOC_IDS, DOC_LO, DOC_HI, b, sdoc)
    LSE += b * sl[0] + hk * G * sl[1]
    GLSE += b * sl[0] + hk * G * sl[1]
    DELTA += b * sl[0] + hk * G * sl[1]

    offs_d, d_ok = head_lanes(HEAD_DIM=HEAD_DIM, D_REAL=D_REAL)
    tok, grp, row_ok = block_rows(t0, Tq, G=G, ROW_G=GP, BLOCK_M=BLOCK_M)
    lse = row_lse2(LSE + grp * sl[1] + tok * sl[2], row_ok)
    q = load_rows(Q + b * sq[0] + hk * G * sq[1], sq, tok, grp, row_ok, offs_d, d_ok, HEAD_DIM=HEAD_DIM, D_REAL=D_REAL)
    do = load_rows(DO + b * sdo[0] + hk * G * sdo[1], sdo, tok, grp, row_ok, offs_d, d_ok,
                   HEAD_DIM=HEAD_DIM, D_REAL=D_REAL)  # fmt: skip
    o = load_rows(O + b * so[0] + hk * G * so[1], so, tok, grp, row_ok, offs_d, d_ok, HEAD_DIM=HEAD_DIM, D_REAL=D_REAL)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_GLSE:
        delta -= tl.load(GLSE + grp * sl[1] + tok * sl[2], mask=row_ok, other=0.0)
    tl.store(DELTA + grp * sl[1] + tok * sl[2], delta, mask=row_ok)

    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    if HAS_SEQ:
        q_pos, q_doc, lo, a, b_, hi = query_keys(
            t0, tok, Tq, Tk, window, DOC_IDS, DOC_LO, DOC_HI,
            CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N,
        )
        dq = _sequence(
            dq, q, do, lse, delta, K=K + b * sk[0] + hk * sk[1], V=V + b * sv[0] + hk * sv[1], KD=KD, VD=VD,
            b=b.to(tl.int32), hk=hk.to(tl.int32), sk=sk, sv=sv, offs_d=offs_d, q_pos=q_pos, q_doc=q_doc,
            DOC_IDS=DOC_IDS, lo=lo, a=a, b_=b_, hi=hi, Tk=Tk, window=window, qk_scale=qk_scale, softcap=softcap,
            CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC, HAS_SOFTCAP=HAS_SOFTCAP, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
            TMA=TMA, LOOP_STAGES=LOOP_STAGES,
        )
    if HAS_DEPTH:
        dq = _depth(
            dq, q, do, lse, delta, DK_TAB=DK_TAB, DV_TAB=DV_TAB, DDKO=DDKO + b * sgd[0] + hk * sgd[1],
            DDVO=DDVO + b * sgd[0] + hk * sgd[1], BIAS=BIAS + hk * G * sbias[0],
            GBIAS=GBIAS + ((b * Hk + hk) * tl.num_programs(0) + block) * GP * L, b=b, hk=hk, t0=t0,
            offs_d=offs_d, d_ok=d_ok, sdk=sdk, sdv=sdv, sgd=sgd, sbias=sbias, Tq=Tq, L=L, depth_first=depth_first,
            scale=scale, qk_scale=qk_scale, softcap=softcap, G=G, GP=GP, DEPTH_ROWS=DEPTH_ROWS, HEAD_DIM=HEAD_DIM,
            BLOCK_M=BLOCK_M, BLOCK_C=BLOCK_C, HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=HAS_BIAS, BIAS_FIRST=BIAS_FIRST,
            BIAS_GRAD=BIAS_GRAD, SLOTS=SLOTS,
        )

    store_rows(DQO + b * sgq[0] + hk * G * sgq[1], sgq, dq * scale, tok, grp, row_ok, offs_d, d_ok)
