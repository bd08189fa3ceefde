"""The forward kernel (Algorithm 1): the sequence phase, then the depth phase, one online softmax."""

import triton
import triton.language as tl

from ...slot_pointers import slot_bases
from .common import (
    LN2, batch_head, bias_tile, block_rows, depth_offsets, depth_tiles, documents, head_lanes, key_columns,
    load_rows, query_block, query_keys, score, sequence_score, store_rows, visible,
)  # fmt: skip


@triton.jit
def _softmax_step(m_i, s, AXIS: tl.constexpr):
    """The online softmax's new running max, the weights ``exp2(s - max)`` and the rescale of the old state.

    A row that has seen nothing keeps m = -inf (and weights 0).
    """
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    if AXIS == 1:
        p = tl.math.exp2(s - m_use[:, None])
    else:
        p = tl.math.exp2(s - m_use[:, :, None])
    return m_new, p, tl.math.exp2(m_i - m_use)


@triton.jit
def _seq_blocks(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS, start, end, Tk, window, qk_scale, softcap,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of ``(acc, m, l)`` over key blocks ``[start, end)`` (Alg. 1 lines 11-22)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + offs_n
        kT = key_columns(k_ptrs, k_pos, skt, Tk, MASKED=MASKED)
        x = tl.dot(q, kT) * qk_scale  # (BLOCK_M, BLOCK_N), base-2 logits
        s, _ = sequence_score(x, softcap, HAS_SOFTCAP=HAS_SOFTCAP)
        if MASKED:
            vis = visible(q_pos[:, None], q_doc[:, None], k_pos[None, :], Tk, window, DOC_IDS,
                          CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC)  # fmt: skip
            s = tl.where(vis, s, float("-inf"))
        m_new, p, alpha = _softmax_step(m_i, s, AXIS=1)
        if MASKED:
            v = tl.load(v_ptrs + k_pos[:, None] * svt, mask=k_pos[:, None] < Tk, other=0.0)
        else:
            v = tl.load(v_ptrs + k_pos[:, None] * svt)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _interior_tma(
    acc, m_i, l_i, q, KD, VD, b, hk, start, end, qk_scale, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    LOOP_STAGES: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    """The unmasked blocks of :func:`_seq_blocks` with K and V tiles (BLOCK_N, D) copied by the TMA engine.

    ``KD``, ``VD``: tensor descriptors over (B, Hk, Tk, D) with (1, 1,
    BLOCK_N, D) boxes; ``b``, ``hk`` int32. ``WS`` asks Triton to split the
    loop into a producer warp group (the copies) and consumer ones; Triton
    3.6 does not compile that for this kernel on sm_90 (docs/design-notes.md "The fused kernel").
    """
    for start_n in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES, warp_specialize=WS):
        k = KD.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        x = tl.dot(q, k.T) * qk_scale  # (BLOCK_M, BLOCK_N), base-2 logits
        s, _ = sequence_score(x, softcap, HAS_SOFTCAP=HAS_SOFTCAP)
        m_new, p, alpha = _softmax_step(m_i, s, AXIS=1)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = VD.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _sequence(
    acc, m_i, l_i, q, K, V, KD, VD, b, hk, sk, sv, offs_d, q_pos, q_doc, DOC_IDS, lo, a, b_, hi,
    Tk, window, qk_scale, softcap,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    """The sequence phase over the key ranges of :func:`.common.key_ranges`: masked, unmasked, masked.

    ``K``, ``V`` point at this program's head. With ``TMA`` the unmasked
    blocks read K and V through the descriptors ``KD``, ``VD`` (:func:`_interior_tma`).
    """
    k_ptrs = K + offs_d[:, None] * sk[3]
    v_ptrs = V + offs_d[None, :] * sv[3]
    # edge blocks before the interior (window / document start), masked
    acc, m_i, l_i = _seq_blocks(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, sk[2], sv[2], q_pos, q_doc, DOC_IDS, start=lo, end=a, Tk=Tk,
        window=window, qk_scale=qk_scale, softcap=softcap, MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC,
        HAS_SOFTCAP=HAS_SOFTCAP, BLOCK_N=BLOCK_N,
    )
    # interior blocks every row sees in full (Alg. 1 lines 11-17): no mask
    if TMA:
        acc, m_i, l_i = _interior_tma(
            acc, m_i, l_i, q, KD, VD, b, hk, start=a, end=b_, qk_scale=qk_scale, softcap=softcap,
            HAS_SOFTCAP=HAS_SOFTCAP, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, LOOP_STAGES=LOOP_STAGES, WS=WS,
        )
    else:
        acc, m_i, l_i = _seq_blocks(
            acc, m_i, l_i, q, k_ptrs, v_ptrs, sk[2], sv[2], q_pos, q_doc, DOC_IDS, start=a, end=b_, Tk=Tk,
            window=window, qk_scale=qk_scale, softcap=softcap, MASKED=False, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC,
            HAS_SOFTCAP=HAS_SOFTCAP, BLOCK_N=BLOCK_N,
        )
    # boundary blocks with the grouped causal mask (Alg. 1 lines 18-23)
    return _seq_blocks(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, sk[2], sv[2], q_pos, q_doc, DOC_IDS, start=b_, end=hi, Tk=Tk,
        window=window, qk_scale=qk_scale, softcap=softcap, MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC,
        HAS_SOFTCAP=HAS_SOFTCAP, BLOCK_N=BLOCK_N,
    )


@triton.jit
def _depth(
    acc, m_i, l_i, q, DK_TAB, DV_TAB, BIAS, b, hk, t0, offs_d, sdk, sdv, sbias, Tq, L, depth_first, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr, SLOTS: tl.constexpr,
):  # fmt: skip
    """The depth phase (Alg. 1 lines 24-29): each tile of DEPTH_ROWS rows against its own tokens' slots.

    The tiles are a reshape of the block's rows: the online-softmax state
    ``(acc, m, l)`` carries over from the sequence phase in place.
    """
    U: tl.constexpr = BLOCK_M // DEPTH_ROWS
    BLOCK_S: tl.constexpr = BLOCK_C // (DEPTH_ROWS // GP)
    col_token, col_slot, own = depth_tiles(t0, DEPTH_ROWS=DEPTH_ROWS, GP=GP, BLOCK_M=BLOCK_M, BLOCK_C=BLOCK_C)
    # element offsets inside one slot: (U, D, BLOCK_C) for keys, (U, BLOCK_C, D) for values
    dk_offs = depth_offsets(b, hk, col_token, offs_d, sdk, KEYS_T=True)
    dv_offs = depth_offsets(b, hk, col_token, offs_d, sdv, KEYS_T=False)
    q3 = tl.reshape(q, (U, DEPTH_ROWS, HEAD_DIM))
    acc3 = tl.reshape(acc, (U, DEPTH_ROWS, HEAD_DIM))
    m3 = tl.reshape(m_i, (U, DEPTH_ROWS))
    l3 = tl.reshape(l_i, (U, DEPTH_ROWS))
    for l0 in range(depth_first, L, BLOCK_S):
        slot = l0 + col_slot  # (BLOCK_C,)
        col_ok = (col_token < Tq) & (slot < L)[None, :]  # (U, BLOCK_C)
        dk_slot, dv_slot = slot_bases(DK_TAB, DV_TAB, slot, L, sdk, sdv, ELEM=q.dtype, SLOTS=SLOTS)
        dkT = tl.load(dk_slot[None, None, :] + dk_offs, mask=col_ok[:, None, :], other=0.0)
        x = tl.dot(q3, dkT) * qk_scale  # (U, DEPTH_ROWS, BLOCK_C)
        bias = 0.0
        if HAS_BIAS:
            bias = bias_tile(BIAS, sbias, slot, L, G=G, GP=GP, DEPTH_ROWS=DEPTH_ROWS)
        s, _ = score(x, bias, softcap, HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=HAS_BIAS, BIAS_FIRST=BIAS_FIRST)
        vis = own[None, :, :] & (slot < L)[None, None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new, p, alpha = _softmax_step(m3, s, AXIS=2)
        dv = tl.load(dv_slot[None, :, None] + dv_offs, mask=col_ok[:, :, None], other=0.0)
        l3 = l3 * alpha + tl.sum(p, 2)
        acc3 = acc3 * alpha[:, :, None] + tl.dot(p.to(dv.dtype), dv)
        m3 = m_new
    return tl.reshape(acc3, (BLOCK_M, HEAD_DIM)), tl.reshape(m3, (BLOCK_M,)), tl.reshape(l3, (BLOCK_M,))


@triton.jit
def forward_kernel(
    Q, K, V, O, LSE, QD, KD, VD, DK_TAB, DV_TAB, DOC_IDS, DOC_LO, DOC_HI, BIAS,
    sq, sk, sv, so, sl, sdk, sdv, sdoc, sbias,
    Hk, Tq, Tk, L, depth_first, window, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_DEPTH: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, WS: tl.constexpr, SLOTS: tl.constexpr,
):  # fmt: skip
    """Fused MoDA forward: writes O (B, Hq, Tq, D) and LSE (B, Hq, Tq).

    Depth slot ``l`` of every token lives at address ``DK_TAB[l]`` (``DV_TAB[l]``)
    plus the (b, h, t, d) strides ``sdk`` (``sdv``): the slots may be separate
    tensors; with ``SLOTS`` 2 ``DK_TAB`` and ``DV_TAB`` are slabs, slot ``l``
    at the fifth stride times ``l`` (:func:`...slot_pointers.slot_bases`). ``BIAS``:
    the depth bias (Hq, L) float32 (strides ``sbias``) with ``HAS_BIAS``;
    ``softcap`` the cap with ``HAS_SOFTCAP`` (:func:`.common.score`).

    ``TMA`` (Hopper): the query block comes through ``QD``, a descriptor over
    Q seen as (B, Hk, Tq, G, D) with (1, 1, BLOCK_T, GP, D) boxes, which
    gives the block's rows in their order, and the unmasked key blocks
    through ``KD``, ``VD`` (:func:`_interior_tma`); ``LOOP_STAGES`` and
    ``WS`` pipeline that loop. Without ``TMA`` the descriptors are None.
    """
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    b, hk = batch_head(Hk)
    t0 = query_block() * BLOCK_T
    DOC_IDS, DOC_LO, DOC_HI = documents(DOC_IDS, DOC_LO, DOC_HI, b, sdoc)
    offs_d, d_ok = head_lanes(HEAD_DIM=HEAD_DIM, D_REAL=D_REAL)
    tok, grp, row_ok = block_rows(t0, Tq, G=G, ROW_G=GP, BLOCK_M=BLOCK_M)
    if TMA:  # rows past Tq and heads past G are out of the descriptor's bounds: read as zeros
        q = QD.load([b.to(tl.int32), hk.to(tl.int32), t0, 0, 0]).reshape(BLOCK_M, HEAD_DIM)
    else:
        q = load_rows(Q + b * sq[0] + hk * G * sq[1], sq, tok, grp, row_ok, offs_d, d_ok,
                      HEAD_DIM=HEAD_DIM, D_REAL=D_REAL)  # fmt: skip

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    if HAS_SEQ:
        q_pos, q_doc, lo, a, b_, hi = query_keys(
            t0, tok, Tq, Tk, window, DOC_IDS, DOC_LO, DOC_HI,
            CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N,
        )
        acc, m_i, l_i = _sequence(
            acc, m_i, l_i, q, K=K + b * sk[0] + hk * sk[1], V=V + b * sv[0] + hk * sv[1], KD=KD, VD=VD,
            b=b.to(tl.int32), hk=hk.to(tl.int32), sk=sk, sv=sv, offs_d=offs_d, q_pos=q_pos, q_doc=q_doc,
            DOC_IDS=DOC_IDS, lo=lo, a=a, b_=b_, hi=hi, Tk=Tk, window=window, qk_scale=qk_scale, softcap=softcap,
            CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC, HAS_SOFTCAP=HAS_SOFTCAP, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
            TMA=TMA, LOOP_STAGES=LOOP_STAGES, WS=WS,
        )
    if HAS_DEPTH:
        acc, m_i, l_i = _depth(
            acc, m_i, l_i, q, DK_TAB=DK_TAB, DV_TAB=DV_TAB, BIAS=BIAS + hk * G * sbias[0], b=b, hk=hk, t0=t0,
            offs_d=offs_d, sdk=sdk, sdv=sdv, sbias=sbias, Tq=Tq, L=L, depth_first=depth_first, qk_scale=qk_scale,
            softcap=softcap, G=G, GP=GP, DEPTH_ROWS=DEPTH_ROWS, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_C=BLOCK_C,
            HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=HAS_BIAS, BIAS_FIRST=BIAS_FIRST, SLOTS=SLOTS,
        )

    # normalize once and store O and LSE (Alg. 1 lines 30-31); an empty row gives 0 and -inf
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_i)) * LN2)
    store_rows(O + b * so[0] + hk * G * so[1], so, out, tok, grp, row_ok, offs_d, d_ok)
    tl.store(LSE + b * sl[0] + hk * G * sl[1] + grp * sl[1] + tok * sl[2], lse, mask=row_ok)
