"""Triton kernels of the split path: the depth part and its merge with the sequence part. ``@triton.jit`` only.

The depth kernels come in two designs, which ``ops._layout`` picks by G: Tensor Core tiles (described here),
and per-token products on the CUDA cores for G <= 4 (their section, "Per-token products", below).

Row layout (group-aware). A program owns one KV head ``hk`` of one batch
element and ``BLOCK_T`` consecutive query tokens; its ``R = BLOCK_T * GP``
rows fold the G query heads of that KV head into rows: row ``r`` is token
``t0 + r // GP`` of query head ``hk * G + r % GP`` (``GP``: G rounded up to
a power of two; rows with ``r % GP >= G`` are padding, never stored). ``R``
is at least 16, the least M of a Tensor Core dot.

Depth phase: the program's (token, slot) pairs, token-major, are its
columns, ``BLOCK_C`` a step: column ``c`` is slot ``c % span`` (from the
first visible one) of token ``t0 + c // span``. Every row meets every
column of a step, and keeps the columns of its own token, so a token's G rows
meet only its own depth keys, read where they lie through their strides;
short depth (a model's early layers) fills a step with several tokens' slots
instead of a step each. The softmax state ``(m, l, acc)`` starts from the
sequence part, ``m = lse_s``, ``l = 1``, ``acc = o_s``: after the last
column, ``acc / l`` and ``m + log l`` are the output and lse of the one
softmax over ``[sequence | depth]``.

The backward: the vendor's backward gives the sequence part's gradients from
the merged out and lse, the depth kernel the depth slots' and the depth
part of dq, which goes apart, for the caller to add to the vendor's.

Strides arrive as one tuple per tensor, in its axis order: ``sq`` is
``q.stride()``, ``sgk`` a depth gradient's (b, h, t, l, d). The depth slots
are read where they lie, through their address table
(:mod:`moda_flex.backends.slots`): ``sdk``, ``sdv`` are the slots' (b, h, t, d).
"""

import triton
import triton.language as tl

from ..slot_pointers import slot_bases

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _program_rows(Hk, Tq, G: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr):  # fmt: skip
    """This program's rows in the layout above: batch b, KV head hk (and b * Hk + hk), first token t0, each
    row's token within the block (rt) and in the sequence (tok), its query head h, which rows are real, and
    the head dim's lanes d with which are real."""
    bhk = tl.program_id(1)
    b = bhk // Hk
    hk = bhk % Hk
    r = tl.arange(0, BLOCK_T * GP)
    rt = r // GP
    t0 = tl.program_id(0) * BLOCK_T
    tok = t0 + rt
    h = hk * G + r % GP
    row_ok = (r % GP < G) & (tok < Tq)
    d = tl.arange(0, DP)
    return b, hk, bhk, t0, rt, tok, h, row_ok, d, d < D


@triton.jit
def _pair_columns(c0, span, first, t0, Tq, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Step ``c0``'s columns: each one's token within the block (j) and in the sequence (tok), its slot, and
    which columns are pairs of this program's real tokens (the last step's tail is not: its j passes BLOCK_T,
    into the next program's tokens). The program has ``BLOCK_T * span`` pairs; ``span > 0``."""
    c = c0 + tl.arange(0, BLOCK_C)
    j = c // span
    tok = t0 + j
    return j, tok, first + c - j * span, (j < BLOCK_T) & (tok < Tq)


@triton.jit
def _slot_rows(DK_TAB, DV_TAB, slot, L, b, hk, tok, sdk, sdv, ELEM: tl.constexpr, SLOTS: tl.constexpr):
    """Where the depth key and value of each (token ``tok``, slot ``slot``) pair start, a pointer a pair each:
    slot ``l`` lives at address ``DK_TAB[l]`` (``DV_TAB[l]``), a token at its (b, h, t) strides ``sdk``, ``sdv``
    in it, and lane ``d`` is ``d * sdk[3]`` (``sdv[3]``) elements past its start."""
    k_slot, v_slot = slot_bases(DK_TAB, DV_TAB, slot, L, sdk, sdv, ELEM=ELEM, SLOTS=SLOTS)
    b64, hk64, tok64 = b.to(tl.int64), hk.to(tl.int64), tok.to(tl.int64)  # a slab's offsets may pass 2**31
    k_row = k_slot + b64 * sdk[0] + hk64 * sdk[1] + tok64 * sdk[2]
    v_row = v_slot + b64 * sdv[0] + hk64 * sdv[1] + tok64 * sdv[2]
    return k_row, v_row


@triton.jit
def _slot_tiles(DK_TAB, DV_TAB, slot, L, b, hk, tok, sdk, sdv, d, tile, ELEM: tl.constexpr, SLOTS: tl.constexpr):
    """The depth keys and values of the (token ``tok``, slot ``slot``) pairs, (BLOCK_C, DP) each, zero off
    ``tile`` (:func:`_slot_rows`)."""
    k_row, v_row = _slot_rows(DK_TAB, DV_TAB, slot, L, b, hk, tok, sdk, sdv, ELEM=ELEM, SLOTS=SLOTS)
    kd = tl.load(k_row[:, None] + d[None, :] * sdk[3], mask=tile, other=0.0)
    vd = tl.load(v_row[:, None] + d[None, :] * sdv[3], mask=tile, other=0.0)
    return kd, vd


@triton.jit
def _depth_forward_kernel(
    Q, DK_TAB, DV_TAB, OS, LS, O, LO,
    sq, sdk, sdv, sos, sls, so, slo,
    Hk, Tq, L, depth_first, qk_scale,
    G: tl.constexpr,
    GP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    CAUSAL: tl.constexpr,
    SLOTS: tl.constexpr,
):  # fmt: skip
    """out, lse of ``[sequence | depth]`` from the sequence part (``OS``, ``LS``) and the depth slots.

    Without ``HAS_SEQ`` the softmax is over the depth slots alone. A row that
    sees nothing gets zeros and lse = -inf.
    """
    R: tl.constexpr = BLOCK_T * GP
    b, hk, bhk, t0, rt, tok, h, row_ok, d, d_ok = _program_rows(Hk, Tq, G, GP, BLOCK_T, D, DP)
    rows2 = row_ok[:, None] & d_ok[None, :]
    ninf = float("-inf")

    q = tl.load(Q + b * sq[0] + h[:, None] * sq[1] + tok[:, None] * sq[2] + d[None, :], mask=rows2, other=0.0)
    if HAS_SEQ:
        m = tl.load(LS + b * sls[0] + h * sls[1] + tok * sls[2], mask=row_ok, other=ninf) * _LOG2E
        acc = tl.load(OS + b * sos[0] + h[:, None] * sos[1] + tok[:, None] * sos[2] + d[None, :], mask=rows2,
                      other=0.0).to(tl.float32)  # fmt: skip
        l_sum = tl.where(m == ninf, 0.0, 1.0)
    else:
        m = tl.full((R,), ninf, tl.float32)
        acc = tl.zeros((R, DP), tl.float32)
        l_sum = tl.zeros((R,), tl.float32)

    span = L - depth_first  # visible slots a token
    for c0 in range(0, BLOCK_T * tl.maximum(span, 0), BLOCK_C):
        j, col_tok, slot, visible = _pair_columns(c0, span, depth_first, t0, Tq, BLOCK_T, BLOCK_C)
        tile = visible[:, None] & d_ok[None, :]
        kd, vd = _slot_tiles(DK_TAB, DV_TAB, slot, L, b, hk, col_tok, sdk, sdv, d, tile, ELEM=Q.dtype.element_ty,
                             SLOTS=SLOTS)  # fmt: skip
        sees = (rt[:, None] == j[None, :]) & visible[None, :]
        s = tl.where(sees, tl.dot(q, tl.trans(kd)) * qk_scale, ninf)
        # rescale the running max and denominator, as in a FlashAttention step
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == ninf, 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vd.dtype), vd)
        m = m_new

    seen = l_sum > 0.0
    lse = tl.where(seen, (m + tl.math.log2(tl.where(seen, l_sum, 1.0))) * _LN2, ninf)
    out = acc / tl.where(seen, l_sum, 1.0)[:, None]
    tl.store(O + b * so[0] + h[:, None] * so[1] + tok[:, None] * so[2] + d[None, :], out.to(O.dtype.element_ty), mask=rows2)
    tl.store(LO + b * slo[0] + h * slo[1] + tok * slo[2], lse, mask=row_ok)


@triton.jit
def _depth_backward_kernel(
    Q, DK_TAB, DV_TAB, O, DO, LSE, GLSE, DQ, DDK, DDV,
    sq, sdk, sdv, so, sdo, sl, sgl, sdq, sgk, sgv,
    Hk, Tq, L, depth_first, scale, qk_scale,
    G: tl.constexpr,
    GP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HAS_GLSE: tl.constexpr,
    SLOTS: tl.constexpr,
):  # fmt: skip
    """The depth part's gradients from the merged out and lse.

    ``P = exp(scale q . kd - lse)``, ``delta = rowsum(dO * O) - dLSE``,
    ``dS = P (dO . vd - delta)``: writes dK_d, dV_d of every slot (zero for
    slots before ``depth_first``) and the depth part's dQ into ``DQ``. dK_d, dV_d go to ``DDK``, ``DDV``
    (strides ``sgk``, ``sgv``).
    """
    R: tl.constexpr = BLOCK_T * GP
    b, hk, bhk, t0, rt, tok, h, row_ok, d, d_ok = _program_rows(Hk, Tq, G, GP, BLOCK_T, D, DP)
    rows2 = row_ok[:, None] & d_ok[None, :]

    q = tl.load(Q + b * sq[0] + h[:, None] * sq[1] + tok[:, None] * sq[2] + d[None, :], mask=rows2, other=0.0)
    do = tl.load(DO + b * sdo[0] + h[:, None] * sdo[1] + tok[:, None] * sdo[2] + d[None, :], mask=rows2, other=0.0)
    o = tl.load(O + b * so[0] + h[:, None] * so[1] + tok[:, None] * so[2] + d[None, :], mask=rows2, other=0.0)
    lse = tl.load(LSE + b * sl[0] + h * sl[1] + tok * sl[2], mask=row_ok, other=float("inf"))
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if HAS_GLSE:  # d lse / d s = p: the lse's gradient enters as delta does, with the opposite sign
        delta -= tl.load(GLSE + b * sgl[0] + h * sgl[1] + tok * sgl[2], mask=row_ok, other=0.0)
    lse = lse * _LOG2E
    dq = tl.zeros((R, DP), tl.float32)

    b64, hk64 = b.to(tl.int64), hk.to(tl.int64)  # a slab's offsets may pass 2**31
    gkbase = DDK + b64 * sgk[0] + hk64 * sgk[1]
    gvbase = DDV + b64 * sgv[0] + hk64 * sgv[1]
    for c0 in range(0, BLOCK_T * L, BLOCK_C):  # every slot's pair: those before depth_first get zeros
        j, col_tok, slot, stored = _pair_columns(c0, L, 0, t0, Tq, BLOCK_T, BLOCK_C)
        visible = stored & (slot >= depth_first)
        tile = visible[:, None] & d_ok[None, :]
        kd, vd = _slot_tiles(DK_TAB, DV_TAB, slot, L, b, hk, col_tok, sdk, sdv, d, tile, ELEM=Q.dtype.element_ty,
                             SLOTS=SLOTS)  # fmt: skip
        s = tl.dot(q, tl.trans(kd)) * qk_scale
        sees = (rt[:, None] == j[None, :]) & row_ok[:, None] & visible[None, :]
        p = tl.where(sees, tl.math.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(vd))
        ds = (p * (dp - delta[:, None])).to(q.dtype)
        dq += tl.dot(ds, kd)
        ddv = tl.dot(tl.trans(p.to(do.dtype)), do)
        ddk = tl.dot(tl.trans(ds), q) * scale
        col_tok64 = col_tok.to(tl.int64)
        out = stored[:, None] & d_ok[None, :]
        gv = gvbase + (col_tok64 * sgv[2] + slot * sgv[3])[:, None] + d[None, :]
        gk = gkbase + (col_tok64 * sgk[2] + slot * sgk[3])[:, None] + d[None, :]
        tl.store(gv, ddv.to(gv.dtype.element_ty), mask=out)
        tl.store(gk, ddk.to(gk.dtype.element_ty), mask=out)

    dq = dq * scale
    tl.store(DQ + b * sdq[0] + h[:, None] * sdq[1] + tok[:, None] * sdq[2] + d[None, :], dq.to(DQ.dtype.element_ty),
             mask=rows2)  # fmt: skip


# ---- Per-token products: the depth part on the CUDA cores, for small G --------------------------------------
#
# A Tensor Core tile has at least 16 rows: at G=3 a token's rows fill 3 of them, and a tile meeting several
# tokens' slots keeps only each token's own (1 product in BLOCK_T). These kernels compute a token's G rows
# against its own slots alone, ``s[t, g] = sum_d q[t, g, d] * kd[t, d]``, as elementwise products on
# (BLOCK_T, GP, DP) tiles, slot by slot (the forward two a step): no product is wasted but the GP - G padding
# rows.
#


@triton.jit
def _token_rows(Hk, Tq, G: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
                DP: tl.constexpr):  # fmt: skip
    """A per-token program's batch b, KV head hk (and b * Hk + hk), tokens t (BLOCK_T,), heads h (GP,), lanes
    d (DP,), which (token, head) rows are real (BLOCK_T, GP), which (token, head, lane) entries (3D), and which
    (token, lane) entries of a slot's tile, (BLOCK_T, 1, DP).

    A slot's tiles carry the heads' axis, so their products with the rows need no change of layout: loaded
    (BLOCK_T, DP), Triton 3.9 moved each through shared memory at every step (four barriers a slot) and spilled
    the backward's registers; Triton 3.6 compiles both forms alike (``benchmarks/kernel_registers.py``)."""
    bhk = tl.program_id(1)
    b = bhk // Hk
    hk = bhk % Hk
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    t_ok, d_ok = t < Tq, d < D
    rows = t_ok[:, None] & (g < G)[None, :]
    slot_live = (t_ok[:, None] & d_ok[None, :])[:, None, :]
    return b, hk, bhk, t, hk * G + g, d, rows, rows[:, :, None] & d_ok[None, None, :], slot_live


@triton.jit
def _rows_at(X, sx, b, h, t, d):
    """Addresses of (token, head, lane) entries of a (B, H, T, D) tensor with strides ``sx``: (BLOCK_T, GP, DP)."""
    return X + b * sx[0] + h[None, :, None] * sx[1] + t[:, None, None] * sx[2] + d[None, None, :]


@triton.jit
def _token_slot(DK_TAB, DV_TAB, slot, L, b, hk, t, d, sdk, sdv, live, ELEM: tl.constexpr, SLOTS: tl.constexpr):
    """Slot ``slot`` of each token ``t``: the depth keys and values, (BLOCK_T, 1, DP), zero off ``live`` and for a
    slot past the last (a prefetch past the loop's end reads nothing)."""
    slots = t * 0 + slot
    k_row, v_row = _slot_rows(DK_TAB, DV_TAB, slots, L, b, hk, t, sdk, sdv, ELEM=ELEM, SLOTS=SLOTS)
    tile = live & (slots < L)[:, None, None]
    kd = tl.load(k_row[:, None, None] + d[None, None, :] * sdk[3], mask=tile, other=0.0)
    vd = tl.load(v_row[:, None, None] + d[None, None, :] * sdv[3], mask=tile, other=0.0)
    return kd, vd


@triton.jit
def _depth_forward_token_kernel(
    Q, DK_TAB, DV_TAB, OS, LS, O, LO,
    sq, sdk, sdv, sos, sls, so, slo,
    Hk, Tq, L, depth_first, qk_scale,
    G: tl.constexpr,
    GP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    CAUSAL: tl.constexpr,
    SLOTS: tl.constexpr,
):  # fmt: skip
    """:func:`_depth_forward_kernel`'s results, a token's rows against its own slots on the CUDA cores, two
    slots a step: one rescale of the softmax state serves both, and four slots' loads are in flight."""
    b, hk, bhk, t, h, d, rows, rows3, slot_live = _token_rows(Hk, Tq, G, GP, BLOCK_T, D, DP)
    ninf = float("-inf")

    q = tl.load(_rows_at(Q, sq, b, h, t, d), mask=rows3, other=0.0).to(tl.float32) * qk_scale  # log2 units
    if HAS_SEQ:
        m = tl.load(LS + b * sls[0] + h[None, :] * sls[1] + t[:, None] * sls[2], mask=rows, other=ninf) * _LOG2E
        acc = tl.load(_rows_at(OS, sos, b, h, t, d), mask=rows3, other=0.0).to(tl.float32)
        l_sum = tl.where(m == ninf, 0.0, 1.0)
    else:
        m = tl.full((BLOCK_T, GP), ninf, tl.float32)
        acc = tl.zeros((BLOCK_T, GP, DP), tl.float32)
        l_sum = tl.zeros((BLOCK_T, GP), tl.float32)

    # each step loads the next step's two slots before its products: four slots' loads in flight a program
    elem = Q.dtype.element_ty
    kd_next, vd_next = _token_slot(DK_TAB, DV_TAB, depth_first, L, b, hk, t, d, sdk, sdv, slot_live, ELEM=elem,
                                   SLOTS=SLOTS)  # fmt: skip
    kd2_next, vd2_next = _token_slot(DK_TAB, DV_TAB, depth_first + 1, L, b, hk, t, d, sdk, sdv, slot_live,
                                     ELEM=elem, SLOTS=SLOTS)  # fmt: skip
    for slot in range(depth_first, L, 2):
        kd, vd = kd_next.to(tl.float32), vd_next.to(tl.float32)
        kd2, vd2 = kd2_next.to(tl.float32), vd2_next.to(tl.float32)
        kd_next, vd_next = _token_slot(DK_TAB, DV_TAB, slot + 2, L, b, hk, t, d, sdk, sdv, slot_live, ELEM=elem,
                                       SLOTS=SLOTS)  # fmt: skip
        kd2_next, vd2_next = _token_slot(DK_TAB, DV_TAB, slot + 3, L, b, hk, t, d, sdk, sdv, slot_live,
                                         ELEM=elem, SLOTS=SLOTS)  # fmt: skip
        s = tl.sum(q * kd, 2)
        s2 = tl.sum(q * kd2, 2)
        second = slot + 1 < L  # an odd count's last step has one slot: its second weighs nothing
        s2 = tl.where(second, s2, ninf)
        m_new = tl.maximum(m, tl.maximum(s, s2))
        m_safe = tl.where(m_new == ninf, 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        p = tl.math.exp2(s - m_safe)
        p2 = tl.math.exp2(s2 - m_safe)
        l_sum = l_sum * alpha + p + p2
        acc = acc * alpha[:, :, None] + p[:, :, None] * vd + p2[:, :, None] * vd2
        m = m_new

    seen = l_sum > 0.0
    lse = tl.where(seen, (m + tl.math.log2(tl.where(seen, l_sum, 1.0))) * _LN2, ninf)
    out = acc / tl.where(seen, l_sum, 1.0)[:, :, None]
    tl.store(_rows_at(O, so, b, h, t, d), out.to(O.dtype.element_ty), mask=rows3)
    tl.store(LO + b * slo[0] + h[None, :] * slo[1] + t[:, None] * slo[2], lse, mask=rows)


@triton.jit
def _depth_backward_token_kernel(
    Q, DK_TAB, DV_TAB, O, DO, LSE, GLSE, DQ, DDK, DDV,
    sq, sdk, sdv, so, sdo, sl, sgl, sdq, sgk, sgv,
    Hk, Tq, L, depth_first, scale, qk_scale,
    G: tl.constexpr,
    GP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HAS_GLSE: tl.constexpr,
    SLOTS: tl.constexpr,
):  # fmt: skip
    """:func:`_depth_backward_kernel`'s gradients, a token's rows against its own slots on the CUDA cores."""
    b, hk, bhk, t, h, d, rows, rows3, slot_live = _token_rows(Hk, Tq, G, GP, BLOCK_T, D, DP)

    q = tl.load(_rows_at(Q, sq, b, h, t, d), mask=rows3, other=0.0)
    do = tl.load(_rows_at(DO, sdo, b, h, t, d), mask=rows3, other=0.0)
    o = tl.load(_rows_at(O, so, b, h, t, d), mask=rows3, other=0.0)
    lse = tl.load(LSE + b * sl[0] + h[None, :] * sl[1] + t[:, None] * sl[2], mask=rows, other=float("inf"))
    q, do = q.to(tl.float32), do.to(tl.float32)
    delta = tl.sum(do * o.to(tl.float32), 2)
    if HAS_GLSE:  # d lse / d s = p: the lse's gradient enters as delta does, with the opposite sign
        delta -= tl.load(GLSE + b * sgl[0] + h[None, :] * sgl[1] + t[:, None] * sgl[2], mask=rows, other=0.0)
    lse = lse * _LOG2E
    live = lse < float("inf")
    dq = tl.zeros((BLOCK_T, GP, DP), tl.float32)

    b64, hk64, t64 = b.to(tl.int64), hk.to(tl.int64), t.to(tl.int64)  # a slab's offsets may pass 2**31
    gk = DDK + b64 * sgk[0] + hk64 * sgk[1] + t64[:, None, None] * sgk[2] + d[None, None, :]
    gv = DDV + b64 * sgv[0] + hk64 * sgv[1] + t64[:, None, None] * sgv[2] + d[None, None, :]
    for slot in range(0, depth_first):  # slots no row sees: a zero gradient
        none_seen = tl.zeros((BLOCK_T, 1, DP), gk.dtype.element_ty)
        tl.store(gk + slot * sgk[3], none_seen, mask=slot_live)
        tl.store(gv + slot * sgv[3], none_seen, mask=slot_live)
    # the next slot's entries loaded before this one's products, as in the forward
    kd_next, vd_next = _token_slot(DK_TAB, DV_TAB, depth_first, L, b, hk, t, d, sdk, sdv, slot_live,
                                   ELEM=Q.dtype.element_ty, SLOTS=SLOTS)  # fmt: skip
    for slot in range(depth_first, L):
        kd, vd = kd_next.to(tl.float32), vd_next.to(tl.float32)
        kd_next, vd_next = _token_slot(DK_TAB, DV_TAB, slot + 1, L, b, hk, t, d, sdk, sdv, slot_live,
                                       ELEM=Q.dtype.element_ty, SLOTS=SLOTS)  # fmt: skip
        s = tl.sum(q * kd, 2) * qk_scale
        p = tl.where(live, tl.math.exp2(s - lse), 0.0)
        dp = tl.sum(do * vd, 2)
        ds = tl.where(live, p * (dp - delta), 0.0)
        dq += ds[:, :, None] * kd
        ddk = tl.sum(ds[:, :, None] * q, 1, keep_dims=True) * scale
        ddv = tl.sum(p[:, :, None] * do, 1, keep_dims=True)
        tl.store(gk + slot * sgk[3], ddk.to(gk.dtype.element_ty), mask=slot_live)
        tl.store(gv + slot * sgv[3], ddv.to(gv.dtype.element_ty), mask=slot_live)

    dq = dq * scale
    tl.store(_rows_at(DQ, sdq, b, h, t, d), dq.to(DQ.dtype.element_ty), mask=rows3)


# The depth kernels of each design, by the name ``ops._layout`` gives it.
FORWARD = {"tiles": _depth_forward_kernel, "tokens": _depth_forward_token_kernel}
BACKWARD = {"tiles": _depth_backward_kernel, "tokens": _depth_backward_token_kernel}
