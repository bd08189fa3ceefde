"""Triton kernels for MoDA: forward (Algorithm 1) and backward. ``@triton.jit`` only.

Row layout (group-aware, Algorithm 1 lines 3-4). One program owns one KV head
``hk`` of one batch element and a block of ``BLOCK_T`` query tokens. Its
``BLOCK_M = BLOCK_T * GP`` rows fold the ``G`` query heads of that KV head into
rows: row ``r`` is token ``t0 + r // GP`` of query head ``hk * G + r % GP``
(``GP`` is ``G`` rounded up to a power of two; rows with ``r % GP >= G`` are
padding, loaded as zeros and never stored). So the block is aligned to ``G``
and a token's ``G`` rows never straddle two blocks.

Sequence phase: a FlashAttention loop over key blocks with one online-softmax
state ``(m, l, acc)``, split into masked edge blocks and unmasked interior
blocks (keys every row of the block may see).

Depth phase (group-aware, beyond the paper): a token's depth logits are the
``G x L`` product of its own ``G`` query rows with its own ``L`` depth keys.
The paper multiplies the whole ``BLOCK_M`` rows by whole depth blocks and masks
all but ``G / BLOCK_M`` of the products away (12.5% at ``G = 8``). Here the
phase runs as batched 3D dots over tokens: ``[BLOCK_T, GPD, D] x [BLOCK_T, D,
BLOCK_L]``, where ``GPD = max(GP, 16)`` rows per token (the smallest M a Tensor
Core dot takes). Depth utilization is therefore ``G / GPD`` (times
``L / (BLOCK_L * ceil(L / BLOCK_L))``): 50% at ``G = 8``, 100% at ``G >= 16``.
The state ``(m, l, acc)`` is re-laid out from ``[BLOCK_M]`` rows to
``[BLOCK_T, GPD]`` once when the phase starts.

Scores are kept in base 2: ``qk_scale = scale * log2(e)``; LSE is stored in
natural log.
"""

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _pad_rows_3d(x, BLOCK_T: tl.constexpr, GP: tl.constexpr, GPD: tl.constexpr, N: tl.constexpr):
    """[BLOCK_T * GP, N] rows -> [BLOCK_T, GPD, N], the extra rows of each token zero."""
    x = tl.reshape(x, (BLOCK_T, 1, GP, N))
    x = tl.reshape(tl.broadcast_to(x, (BLOCK_T, GPD // GP, GP, N)), (BLOCK_T, GPD, N))
    j = tl.arange(0, GPD)
    return tl.where((j < GP)[None, :, None], x, 0.0)


@triton.jit
def _pad_rows_2d(x, BLOCK_T: tl.constexpr, GP: tl.constexpr, GPD: tl.constexpr):
    """[BLOCK_T * GP] rows -> [BLOCK_T, GPD], the extra rows of each token zero."""
    return tl.reshape(_pad_rows_3d(tl.reshape(x, (BLOCK_T * GP, 1)), BLOCK_T, GP, GPD, 1), (BLOCK_T, GPD))


@triton.jit
def _key_ranges(
    p_first, p_last, Tk, window, doc_lo_ptr, doc_hi_ptr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Key blocks for queries at positions [p_first, p_last].

    Returns ``lo <= a <= b <= hi``: keys in ``[lo, hi)`` may be visible to some
    row (``lo`` aligned to ``BLOCK_N``); blocks in ``[a, b)`` are visible to
    every row and need no mask.
    """
    lo = 0
    hi = Tk
    full_lo = 0
    full_hi = Tk
    if CAUSAL:
        hi = tl.minimum(hi, p_last + 1)
        full_hi = tl.minimum(full_hi, p_first + 1)
    if WINDOW:
        lo = tl.maximum(lo, p_first - window + 1)
        full_lo = tl.maximum(full_lo, p_last - window + 1)
    if DOC:
        lo = tl.maximum(lo, tl.load(doc_lo_ptr + p_first))
        hi = tl.minimum(hi, tl.load(doc_hi_ptr + p_last))
        full_lo = tl.maximum(full_lo, tl.load(doc_lo_ptr + p_last))
        full_hi = tl.minimum(full_hi, tl.load(doc_hi_ptr + p_first))
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    a = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi)
    b = tl.minimum(tl.maximum((full_hi // BLOCK_N) * BLOCK_N, a), hi)
    return lo, a, b, hi


@triton.jit
def _visible(
    q_pos, q_doc, k_pos, Tk, window, doc_ptr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
):
    """Sequence mask for broadcastable query/key positions."""
    vis = k_pos < Tk
    if CAUSAL:
        vis = vis & (k_pos <= q_pos)
    if WINDOW:
        vis = vis & (k_pos > q_pos - window)
    if DOC:
        k_doc = tl.load(doc_ptr + k_pos, mask=k_pos < Tk, other=0)
        vis = vis & (k_doc == q_doc)
    return vis


@triton.jit
def _fwd_seq_blocks(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kt, stride_vt, q_pos, q_doc, doc_ptr,
    start, end, Tk, window, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online-softmax update of ``(acc, m, l)`` over key blocks ``[start, end)`` (Alg. 1 lines 11-22)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + offs_n
        if MASKED:
            kT = tl.load(k_ptrs + k_pos[None, :] * stride_kt, mask=k_pos[None, :] < Tk, other=0.0)
        else:
            kT = tl.load(k_ptrs + k_pos[None, :] * stride_kt)
        s = tl.dot(q, kT) * qk_scale  # (BLOCK_M, BLOCK_N), base-2 logits
        if MASKED:
            vis = _visible(q_pos[:, None], q_doc[:, None], k_pos[None, :], Tk, window, doc_ptr, CAUSAL, WINDOW, DOC)
            s = tl.where(vis, s, float("-inf"))
        # rescale the running max and denominator; a row that has seen nothing keeps m = -inf
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs + k_pos[:, None] * stride_vt, mask=k_pos[:, None] < Tk, other=0.0)
        else:
            v = tl.load(v_ptrs + k_pos[:, None] * stride_vt)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(
    Q, K, V, DK, DV, DOC_IDS, DOC_LO, DOC_HI, O, LSE,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdkb, sdkh, sdkt, sdkl, sdkd,
    sdvb, sdvh, sdvt, sdvl, sdvd,
    sdoc,
    sob, soh, sot, sod,
    slb, slh, slt,
    Hk, Tq, Tk, L, depth_first, window, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, GPD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_DEPTH: tl.constexpr,
):
    """Fused MoDA forward: writes O (B, Hq, Tq, D) and LSE (B, Hq, Tq)."""
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    # Causal blocks at the end of the sequence are the longest: launch them first.
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hk
    hk = pid_bh % Hk
    t0 = block * BLOCK_T
    shift = Tk - Tq  # query token t sits at absolute position t + shift
    Q += b * sqb + hk * G * sqh
    K += b * skb + hk * skh
    V += b * svb + hk * svh
    DK += b * sdkb + hk * sdkh
    DV += b * sdvb + hk * sdvh
    O += b * sob + hk * G * soh
    LSE += b * slb + hk * G * slh
    DOC_IDS += b * sdoc
    DOC_LO += b * sdoc
    DOC_HI += b * sdoc

    offs_d = tl.arange(0, HEAD_DIM)
    offs_m = tl.arange(0, BLOCK_M)
    tok = t0 + offs_m // GP  # base time of each row (Alg. 1 line 8)
    grp = offs_m % GP
    row_ok = (tok < Tq) & (grp < G)
    q = tl.load(Q + grp[:, None] * sqh + tok[:, None] * sqt + offs_d[None, :] * sqd, mask=row_ok[:, None], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)

    if HAS_SEQ:
        q_pos = tok + shift
        if DOC:
            q_doc = tl.load(DOC_IDS + q_pos, mask=tok < Tq, other=0)
        else:
            q_doc = q_pos
        p_first = t0 + shift
        p_last = tl.minimum(t0 + BLOCK_T, Tq) - 1 + shift
        lo, a, b_, hi = _key_ranges(p_first, p_last, Tk, window, DOC_LO, DOC_HI, CAUSAL, WINDOW, DOC, BLOCK_N)
        k_ptrs = K + offs_d[:, None] * skd
        v_ptrs = V + offs_d[None, :] * svd
        # edge blocks before the interior (window / document start), masked
        acc, m_i, l_i = _fwd_seq_blocks(acc, m_i, l_i, q, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                                        lo, a, Tk, window, qk_scale, True, CAUSAL, WINDOW, DOC, BLOCK_N)
        # interior blocks every row sees in full (Alg. 1 lines 11-17): no mask
        acc, m_i, l_i = _fwd_seq_blocks(acc, m_i, l_i, q, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                                        a, b_, Tk, window, qk_scale, False, CAUSAL, WINDOW, DOC, BLOCK_N)
        # boundary blocks with the grouped causal mask (Alg. 1 lines 18-23)
        acc, m_i, l_i = _fwd_seq_blocks(acc, m_i, l_i, q, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                                        b_, hi, Tk, window, qk_scale, True, CAUSAL, WINDOW, DOC, BLOCK_N)

    if HAS_DEPTH:
        # Depth phase (Alg. 1 lines 24-29), per token: [G, D] x [D, L] batched over tokens.
        offs_t = tl.arange(0, BLOCK_T)
        offs_j = tl.arange(0, GPD)
        offs_l = tl.arange(0, BLOCK_L)
        tok3 = t0 + offs_t
        tok_ok = tok3 < Tq
        row_ok3 = tok_ok[:, None] & (offs_j < G)[None, :]  # (BLOCK_T, GPD)
        q3 = tl.load(
            Q + offs_j[None, :, None] * sqh + tok3[:, None, None] * sqt + offs_d[None, None, :] * sqd,
            mask=row_ok3[:, :, None], other=0.0,
        )  # (BLOCK_T, GPD, D)
        acc3 = _pad_rows_3d(acc, BLOCK_T, GP, GPD, HEAD_DIM)  # (BLOCK_T, GPD, D)
        m3 = _pad_rows_2d(m_i, BLOCK_T, GP, GPD)  # (BLOCK_T, GPD)
        l3 = _pad_rows_2d(l_i, BLOCK_T, GP, GPD)
        tok64 = tok3.to(tl.int64)
        dk_ptrs = DK + tok64[:, None, None] * sdkt + offs_d[None, :, None] * sdkd
        dv_ptrs = DV + tok64[:, None, None] * sdvt + offs_d[None, None, :] * sdvd
        for l0 in range(depth_first, L, BLOCK_L):
            slot = l0 + offs_l
            slot_ok = slot < L
            dkT = tl.load(dk_ptrs + slot[None, None, :] * sdkl,
                          mask=tok_ok[:, None, None] & slot_ok[None, None, :], other=0.0)  # (BLOCK_T, D, BLOCK_L)
            s = tl.dot(q3, dkT) * qk_scale  # (BLOCK_T, GPD, BLOCK_L)
            s = tl.where(slot_ok[None, None, :], s, float("-inf"))
            m_new = tl.maximum(m3, tl.max(s, 2))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, :, None])
            alpha = tl.math.exp2(m3 - m_use)
            l3 = l3 * alpha + tl.sum(p, 2)
            dv = tl.load(dv_ptrs + slot[None, :, None] * sdvl,
                         mask=tok_ok[:, None, None] & slot_ok[None, :, None], other=0.0)  # (BLOCK_T, BLOCK_L, D)
            acc3 = acc3 * alpha[:, :, None] + tl.dot(p.to(dv.dtype), dv)
            m3 = m_new
        # normalize once and store O and LSE (Alg. 1 lines 30-31); an empty row gives 0 and -inf
        out = acc3 / tl.where(l3 == 0.0, 1.0, l3)[:, :, None]
        lse = tl.where(l3 == 0.0, float("-inf"), (m3 + tl.math.log2(l3)) * _LN2)
        tl.store(O + offs_j[None, :, None] * soh + tok3[:, None, None] * sot + offs_d[None, None, :] * sod,
                 out.to(O.dtype.element_ty), mask=row_ok3[:, :, None])
        tl.store(LSE + offs_j[None, :] * slh + tok3[:, None] * slt, lse, mask=row_ok3)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_i)) * _LN2)
        tl.store(O + grp[:, None] * soh + tok[:, None] * sot + offs_d[None, :] * sod,
                 out.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + grp * slh + tok * slt, lse, mask=row_ok)


@triton.jit
def _bwd_dkdv_blocks(
    dk, dv, k, v, Q, DO, LSE, DELTA,
    sqh, sqt, sqd, sdoh, sdot, sdod, slh, slt,
    k_pos, Tq, Tk, shift, window, doc_ptr, k_doc, qk_scale, start, end,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query token blocks [start, end)."""
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    grp = offs_m % GP
    for t0 in range(start, end, BLOCK_T):
        tok = t0 + offs_m // GP
        row_ok = (tok < Tq) & (grp < G)
        q = tl.load(Q + grp[:, None] * sqh + tok[:, None] * sqt + offs_d[None, :] * sqd,
                    mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + grp * slh + tok * slt, mask=row_ok, other=float("inf"))
        # a row that saw no key has lse = -inf: give it zero probability, not inf
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])  # (BLOCK_N, BLOCK_M)
        if MASKED:
            q_pos = tok + shift
            if DOC:
                q_doc = tl.load(doc_ptr + q_pos, mask=tok < Tq, other=0)
            else:
                q_doc = q_pos
            vis = _visible(q_pos[None, :], q_doc[None, :], k_pos[:, None], Tk, window, doc_ptr, CAUSAL, WINDOW, False)
            if DOC:
                vis = vis & (k_doc[:, None] == q_doc[None, :])
            pT = tl.where(vis, pT, 0.0)
        do = tl.load(DO + grp[:, None] * sdoh + tok[:, None] * sdot + offs_d[None, :] * sdod,
                     mask=row_ok[:, None], other=0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        delta = tl.load(DELTA + grp * slh + tok * slt, mask=row_ok, other=0.0)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DOC_IDS, DOC_LO, DOC_HI, DKO, DVO,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdob, sdoh, sdot, sdod,
    slb, slh, slt,
    sdoc,
    sgb, sgh, sgt, sgd,
    Hk, Tq, Tk, window, scale, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
):
    """dK, dV (B, Hk, Tk, D) of one block of BLOCK_N sequence keys, summed over the G heads that read it."""
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hk
    hk = pid_bh % Hk
    n0 = tl.program_id(0) * BLOCK_N
    shift = Tk - Tq
    Q += b * sqb + hk * G * sqh
    DO += b * sdob + hk * G * sdoh
    LSE += b * slb + hk * G * slh
    DELTA += b * slb + hk * G * slh
    K += b * skb + hk * skh
    V += b * svb + hk * svh
    DKO += b * sgb + hk * sgh
    DVO += b * sgb + hk * sgh
    DOC_IDS += b * sdoc
    DOC_LO += b * sdoc
    DOC_HI += b * sdoc

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_pos = n0 + offs_n
    k_ok = k_pos < Tk
    k = tl.load(K + k_pos[:, None] * skt + offs_d[None, :] * skd, mask=k_ok[:, None], other=0.0)
    v = tl.load(V + k_pos[:, None] * svt + offs_d[None, :] * svd, mask=k_ok[:, None], other=0.0)
    if DOC:
        k_doc = tl.load(DOC_IDS + k_pos, mask=k_ok, other=0)
    else:
        k_doc = k_pos
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)

    # Query positions that see some key of the block, and those that see all of them.
    n_last = tl.minimum(n0 + BLOCK_N, Tk) - 1
    lo = shift
    hi = Tk
    full_lo = shift
    full_hi = Tk
    if CAUSAL:
        lo = tl.maximum(lo, n0)
        full_lo = tl.maximum(full_lo, n_last)
    if WINDOW:
        hi = tl.minimum(hi, n_last + window)
        full_hi = tl.minimum(full_hi, n0 + window)
    if DOC:
        lo = tl.maximum(lo, tl.load(DOC_LO + n0))
        hi = tl.minimum(hi, tl.load(DOC_HI + n_last))
        full_lo = tl.maximum(full_lo, tl.load(DOC_LO + n_last))
        full_hi = tl.minimum(full_hi, tl.load(DOC_HI + n0))
    # positions -> query tokens, in blocks of BLOCK_T tokens
    lo = ((lo - shift) // BLOCK_T) * BLOCK_T
    hi = tl.maximum(hi - shift, lo)
    a = tl.minimum(tl.maximum(tl.cdiv(full_lo - shift, BLOCK_T) * BLOCK_T, lo), hi)
    b_ = tl.minimum(tl.maximum(((full_hi - shift) // BLOCK_T) * BLOCK_T, a), hi)
    dk, dv = _bwd_dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, sqh, sqt, sqd, sdoh, sdot, sdod, slh, slt,
                              k_pos, Tq, Tk, shift, window, DOC_IDS, k_doc, qk_scale, lo, a,
                              True, CAUSAL, WINDOW, DOC, G, GP, HEAD_DIM, BLOCK_M)
    dk, dv = _bwd_dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, sqh, sqt, sqd, sdoh, sdot, sdod, slh, slt,
                              k_pos, Tq, Tk, shift, window, DOC_IDS, k_doc, qk_scale, a, b_,
                              False, CAUSAL, WINDOW, DOC, G, GP, HEAD_DIM, BLOCK_M)
    dk, dv = _bwd_dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, sqh, sqt, sqd, sdoh, sdot, sdod, slh, slt,
                              k_pos, Tq, Tk, shift, window, DOC_IDS, k_doc, qk_scale, b_, hi,
                              True, CAUSAL, WINDOW, DOC, G, GP, HEAD_DIM, BLOCK_M)
    tl.store(DKO + k_pos[:, None] * sgt + offs_d[None, :] * sgd, (dk * scale).to(DKO.dtype.element_ty),
             mask=k_ok[:, None])
    tl.store(DVO + k_pos[:, None] * sgt + offs_d[None, :] * sgd, dv.to(DVO.dtype.element_ty), mask=k_ok[:, None])


@triton.jit
def _bwd_dq_seq_blocks(
    dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kt, stride_vt, q_pos, q_doc, doc_ptr,
    start, end, Tk, window, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Accumulate dQ (unscaled) over key blocks [start, end)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + offs_n
        if MASKED:
            kT = tl.load(k_ptrs + k_pos[None, :] * stride_kt, mask=k_pos[None, :] < Tk, other=0.0)
            vT = tl.load(v_ptrs + k_pos[None, :] * stride_vt, mask=k_pos[None, :] < Tk, other=0.0)
        else:
            kT = tl.load(k_ptrs + k_pos[None, :] * stride_kt)
            vT = tl.load(v_ptrs + k_pos[None, :] * stride_vt)
        p = tl.math.exp2(tl.dot(q, kT) * qk_scale - lse[:, None])  # (BLOCK_M, BLOCK_N)
        if MASKED:
            vis = _visible(q_pos[:, None], q_doc[:, None], k_pos[None, :], Tk, window, doc_ptr, CAUSAL, WINDOW, DOC)
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, vT)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DK, DV, DO, LSE, DELTA, DOC_IDS, DOC_LO, DOC_HI, DQO, DDKO, DDVO,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdkb, sdkh, sdkt, sdkl, sdkd,
    sdvb, sdvh, sdvt, sdvl, sdvd,
    sdob, sdoh, sdot, sdod,
    slb, slh, slt,
    sdoc,
    sgqb, sgqh, sgqt, sgqd,
    sgdb, sgdh, sgdt, sgdl, sgdd,
    Hk, Tq, Tk, L, depth_first, window, scale, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, GPD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_DEPTH: tl.constexpr,
):
    """dQ of one query block, and the depth gradients of its tokens.

    A token's depth entries are read only by its own G rows, which all live in
    this block, so dK_depth and dV_depth are written once, without atomics.
    """
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hk
    hk = pid_bh % Hk
    t0 = block * BLOCK_T
    shift = Tk - Tq
    Q += b * sqb + hk * G * sqh
    DO += b * sdob + hk * G * sdoh
    LSE += b * slb + hk * G * slh
    DELTA += b * slb + hk * G * slh
    DQO += b * sgqb + hk * G * sgqh
    K += b * skb + hk * skh
    V += b * svb + hk * svh
    DK += b * sdkb + hk * sdkh
    DV += b * sdvb + hk * sdvh
    DDKO += b * sgdb + hk * sgdh
    DDVO += b * sgdb + hk * sgdh
    DOC_IDS += b * sdoc
    DOC_LO += b * sdoc
    DOC_HI += b * sdoc

    offs_d = tl.arange(0, HEAD_DIM)
    offs_m = tl.arange(0, BLOCK_M)
    tok = t0 + offs_m // GP
    grp = offs_m % GP
    row_ok = (tok < Tq) & (grp < G)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)

    if HAS_SEQ:
        q = tl.load(Q + grp[:, None] * sqh + tok[:, None] * sqt + offs_d[None, :] * sqd,
                    mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + grp[:, None] * sdoh + tok[:, None] * sdot + offs_d[None, :] * sdod,
                     mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + grp * slh + tok * slt, mask=row_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E
        delta = tl.load(DELTA + grp * slh + tok * slt, mask=row_ok, other=0.0)
        q_pos = tok + shift
        if DOC:
            q_doc = tl.load(DOC_IDS + q_pos, mask=tok < Tq, other=0)
        else:
            q_doc = q_pos
        p_first = t0 + shift
        p_last = tl.minimum(t0 + BLOCK_T, Tq) - 1 + shift
        lo, a, b_, hi = _key_ranges(p_first, p_last, Tk, window, DOC_LO, DOC_HI, CAUSAL, WINDOW, DOC, BLOCK_N)
        k_ptrs = K + offs_d[:, None] * skd
        v_ptrs = V + offs_d[:, None] * svd
        dq = _bwd_dq_seq_blocks(dq, q, do, lse, delta, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                                lo, a, Tk, window, qk_scale, True, CAUSAL, WINDOW, DOC, BLOCK_N)
        dq = _bwd_dq_seq_blocks(dq, q, do, lse, delta, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                                a, b_, Tk, window, qk_scale, False, CAUSAL, WINDOW, DOC, BLOCK_N)
        dq = _bwd_dq_seq_blocks(dq, q, do, lse, delta, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                                b_, hi, Tk, window, qk_scale, True, CAUSAL, WINDOW, DOC, BLOCK_N)

    if HAS_DEPTH:
        # Depth phase, per token and in the padded [BLOCK_T, GPD] row layout of the forward.
        offs_t = tl.arange(0, BLOCK_T)
        offs_j = tl.arange(0, GPD)
        offs_l = tl.arange(0, BLOCK_L)
        tok3 = t0 + offs_t
        tok_ok = tok3 < Tq
        row_ok3 = tok_ok[:, None] & (offs_j < G)[None, :]  # (BLOCK_T, GPD)
        rows3 = offs_j[None, :, None] * sqh + tok3[:, None, None] * sqt + offs_d[None, None, :] * sqd
        q3 = tl.load(Q + rows3, mask=row_ok3[:, :, None], other=0.0)  # (BLOCK_T, GPD, D)
        do3 = tl.load(DO + offs_j[None, :, None] * sdoh + tok3[:, None, None] * sdot + offs_d[None, None, :] * sdod,
                      mask=row_ok3[:, :, None], other=0.0)
        lse3 = tl.load(LSE + offs_j[None, :] * slh + tok3[:, None] * slt, mask=row_ok3, other=float("inf"))
        lse3 = tl.where(lse3 == float("-inf"), float("inf"), lse3) * _LOG2E
        delta3 = tl.load(DELTA + offs_j[None, :] * slh + tok3[:, None] * slt, mask=row_ok3, other=0.0)
        dq3 = _pad_rows_3d(dq, BLOCK_T, GP, GPD, HEAD_DIM)  # (BLOCK_T, GPD, D)
        tok64 = tok3.to(tl.int64)
        dk_ptrs = DK + tok64[:, None, None] * sdkt + offs_d[None, None, :] * sdkd
        dv_ptrs = DV + tok64[:, None, None] * sdvt + offs_d[None, None, :] * sdvd
        gk_ptrs = DDKO + tok64[:, None, None] * sgdt + offs_d[None, None, :] * sgdd
        gv_ptrs = DDVO + tok64[:, None, None] * sgdt + offs_d[None, None, :] * sgdd
        for l0 in range(depth_first, L, BLOCK_L):
            slot = l0 + offs_l
            slot_ok = slot < L
            ld_ok = tok_ok[:, None, None] & slot_ok[None, :, None]
            kd = tl.load(dk_ptrs + slot[None, :, None] * sdkl, mask=ld_ok, other=0.0)  # (BLOCK_T, BLOCK_L, D)
            vd = tl.load(dv_ptrs + slot[None, :, None] * sdvl, mask=ld_ok, other=0.0)
            p = tl.math.exp2(tl.dot(q3, tl.permute(kd, (0, 2, 1))) * qk_scale - lse3[:, :, None])
            p = tl.where(slot_ok[None, None, :], p, 0.0)  # (BLOCK_T, GPD, BLOCK_L)
            dp = tl.dot(do3, tl.permute(vd, (0, 2, 1)))
            ds = p * (dp - delta3[:, :, None])
            dq3 += tl.dot(ds.to(kd.dtype), kd)
            # each token's G rows sum into its own depth gradients
            gv = tl.dot(tl.permute(p, (0, 2, 1)).to(do3.dtype), do3)  # (BLOCK_T, BLOCK_L, D)
            gk = tl.dot(tl.permute(ds, (0, 2, 1)).to(q3.dtype), q3) * scale
            tl.store(gk_ptrs + slot[None, :, None] * sgdl, gk.to(DDKO.dtype.element_ty), mask=ld_ok)
            tl.store(gv_ptrs + slot[None, :, None] * sgdl, gv.to(DDVO.dtype.element_ty), mask=ld_ok)
        tl.store(DQO + offs_j[None, :, None] * sgqh + tok3[:, None, None] * sgqt + offs_d[None, None, :] * sgqd,
                 (dq3 * scale).to(DQO.dtype.element_ty), mask=row_ok3[:, :, None])
    else:
        tl.store(DQO + grp[:, None] * sgqh + tok[:, None] * sgqt + offs_d[None, :] * sgqd,
                 (dq * scale).to(DQO.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _bwd_delta_kernel(
    O, DO, GLSE, DELTA, R, sor, sod, sdor, sdod,
    HAS_GLSE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """delta = rowsum(dO * O) - dLSE over R = B * Hq * Tq rows (dS = P * (dP - delta))."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    o = tl.load(O + rows64[:, None] * sor + offs_d[None, :] * sod, mask=ok[:, None], other=0.0)
    do = tl.load(DO + rows64[:, None] * sdor + offs_d[None, :] * sdod, mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_GLSE:
        delta -= tl.load(GLSE + rows, mask=ok, other=0.0)
    tl.store(DELTA + rows, delta, mask=ok)
