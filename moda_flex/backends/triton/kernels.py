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
The paper multiplies a whole block of ``C`` query rows by whole depth blocks
and masks all but ``G / C`` of the products away (12.5% at ``G = 8``, ``C = 64``). Here the
block's rows are cut into tiles of ``R = max(GP, 16)`` rows (16 is the least
M of a Tensor Core dot), i.e. the rows of ``P = R / GP`` consecutive tokens,
and each tile is multiplied only by the depth keys of its own ``P`` tokens:
batched 3D dots ``[BLOCK_M / R, R, D] x [BLOCK_M / R, D, P * BLOCK_S]`` over
``BLOCK_S`` slots per token per step. A row keeps the ``BLOCK_S`` columns of
its own token, so depth utilization is ``G / R`` (times ``L / (BLOCK_S *
ceil(L / BLOCK_S))``): 50% at ``G = 8``, 100% at ``G >= 16``. The tiles are
a reshape of the block's rows, so the online-softmax state carries over from
the sequence phase in place.

Depth slots are read through address tables: slot ``l`` of the depth keys
starts at ``DK_TAB[l]`` (values ``DV_TAB[l]``), so the L slots may be L
separate tensors (the entries of a model's layers) or the slots of one 5-D
tensor, both read in place with shared (b, h, t, d) strides. The head dim is
padded to a power of two inside the kernels (``_head_lanes``). The backward
runs the dQ kernel first: it also writes ``delta = rowsum(dO * O) - dLSE``,
which the dK/dV kernel reads.

NaN and Inf (the rule of ``moda_flex.nonfinite``), inside the kernels with no
extra pass and no host sync: a masked entry still enters the dots with
``p = 0``, and ``0 * NaN = NaN``, so every tile with masked entries (edge
blocks, depth tiles) reads its non-finite values as zero, and a row that
*sees* a non-finite query, key or value adds NaN to its softmax denominator
(``x * 0`` is NaN exactly for a non-finite logit ``x``), which makes its out
and lse NaN. Unmasked interior blocks are read as they are: a non-finite value
there reaches every row through ``acc`` (folded into the denominator at the
end), a non-finite key through ``x * 0``. The backward treats a row with
``lse = NaN`` as dead: its p, delta and dq are zero and its q and dO are read
as zero, so it sends no gradient, and every other row's gradients are those of
the inputs with the non-finite entries zeroed, bit for bit.

The Hopper path (launch flag ``TMA``): the tiles of the unmasked blocks,
the part of the work that grows as T^2, come through tensor descriptors
(the TMA copy engine, pipelined ``LOOP_STAGES`` deep): K and V in the
forward and dQ kernels, q and dO in the dK/dV kernel, where a descriptor
over Q (or dO) seen as (B, Hk, T, G, D) gives a block's rows in the order
above. A copy cannot leave a dead row's q and dO out, so the dQ kernel flags
the blocks of rows that have one and the dK/dV kernel reads the heads with a
flag through masked loads. Masked blocks and the depth phase read as on the
generic path. ``DQ_ATOMIC`` (either path) lets the dK/dV kernel add
``dS K`` to float32 dQ sums instead of the dQ kernel recomputing ``QK^T``
and ``dO V^T``: five matrix products instead of seven, and a dQ whose last
bits depend on the order of the atomic adds.

Fused scores (:data:`moda_flex.backends.triton.support.FUSED_SCORES`, in
:func:`_score`): applied in the order the score joins them; the backward
multiplies dS by the cap's derivative. The bias's gradient sums the depth dS
over the batch and the tokens: each dQ program writes the sum over its own
tokens and the launcher adds them up (deterministic, no atomics).

Logits are kept in base 2: ``qk_scale = scale * log2(e)``; LSE is stored in
natural log. Batch/head base offsets and depth token offsets are int64: one
depth tensor may hold more than 2**31 elements (T=16384, L=256, Hk=8, D=64).
"""

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


# ---- shared by the three kernels: programs, rows, key ranges, masks -------------------------------


@triton.jit
def _program(Hk):
    """This program's batch element and KV head (grid axis 1 is B * Hk), int64: base offsets may pass 2**31."""
    pid_bh = tl.program_id(1).to(tl.int64)
    return pid_bh // Hk, pid_bh % Hk


@triton.jit
def _query_block():
    """This program's block of query tokens (grid axis 0): the last first, as causal blocks at the end are longest."""
    return tl.num_programs(0) - 1 - tl.program_id(0)


@triton.jit
def _rows(t0, Tq, G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows of the block of tokens from ``t0`` (Alg. 1 lines 3-4, 8): token, head in the group, real or padding."""
    offs_m = tl.arange(0, BLOCK_M)
    tok = t0 + offs_m // GP
    grp = offs_m % GP
    return tok, grp, (tok < Tq) & (grp < G)


@triton.jit
def _load_rows(ptr, sh, st, sd, tok, grp, rows, offs_d, d_ok, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr):
    """Per-row vectors (q, dO, O), (BLOCK_M, HEAD_DIM), of head ``grp`` at token ``tok``; zero off ``rows`` and padded lanes.

    The rows are chosen by the load's mask, not by a select after it: a
    select on a loaded tile keeps the compiler from pipelining the load
    straight into shared memory.
    """
    x = tl.load(ptr + grp[:, None] * sh + tok[:, None] * st + offs_d[None, :] * sd, mask=rows[:, None], other=0.0)
    if D_REAL != HEAD_DIM:
        x = tl.where(d_ok[None, :], x, 0.0)
    return x


@triton.jit
def _head_lanes(HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr):
    """Head-dim lanes: offsets for addressing and the mask of real lanes.

    ``HEAD_DIM`` is D rounded up to a power of two (at least 16, the least K of
    a Tensor Core dot). Padded lanes address the last real one, so every load
    stays in bounds; q and dO are zeroed there, which keeps every dot product
    over D exact, and stores skip them.
    """
    lanes = tl.arange(0, HEAD_DIM)
    if D_REAL == HEAD_DIM:
        return lanes, lanes < HEAD_DIM
    return tl.minimum(lanes, D_REAL - 1), lanes < D_REAL


@triton.jit
def _documents(DOC_IDS, DOC_LO, DOC_HI, b, sdoc):
    """Batch row ``b`` of the document ids and of the starts and ends of their runs."""
    return DOC_IDS + b * sdoc, DOC_LO + b * sdoc, DOC_HI + b * sdoc


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
def _query_keys(
    t0, tok, Tq, Tk, window, DOC_IDS, DOC_LO, DOC_HI,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The rows' absolute positions and document ids, and the key ranges of their block (:func:`_key_ranges`)."""
    shift = Tk - Tq  # query token t sits at absolute position t + shift
    q_pos = tok + shift
    if DOC:
        q_doc = tl.load(DOC_IDS + q_pos, mask=tok < Tq, other=0)
    else:
        q_doc = q_pos
    p_last = tl.minimum(t0 + BLOCK_T, Tq) - 1 + shift
    lo, a, b, hi = _key_ranges(t0 + shift, p_last, Tk, window, DOC_LO, DOC_HI, CAUSAL, WINDOW, DOC, BLOCK_N)
    return q_pos, q_doc, lo, a, b, hi


@triton.jit
def _query_ranges(
    n0, Tq, Tk, window, DOC_LO, DOC_HI,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Query token blocks for the keys [n0, n0 + BLOCK_N): :func:`_key_ranges` seen from the keys.

    Returns ``lo <= a <= b <= hi`` in query tokens: tokens in ``[lo, hi)`` may
    see some key of the block; blocks of ``BLOCK_T`` tokens in ``[a, b)`` see
    all of them and need no mask.
    """
    shift = Tk - Tq
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
    b = tl.minimum(tl.maximum(((full_hi - shift) // BLOCK_T) * BLOCK_T, a), hi)
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
def _depth_tiles(t0, DEPTH_ROWS: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """Column bookkeeping of the depth tiles of one query block.

    Tile ``u`` holds rows ``u * DEPTH_ROWS ...`` of the block: the rows of
    tokens ``t0 + u * P + i`` (``i < P``). Its ``BLOCK_C`` depth columns are
    ``P`` tokens x ``BLOCK_S`` slots. Returns the token of every column
    (U, BLOCK_C), the slot offset of every column (BLOCK_C,) and the
    own-token mask (DEPTH_ROWS, BLOCK_C).
    """
    P: tl.constexpr = DEPTH_ROWS // GP
    BLOCK_S: tl.constexpr = BLOCK_C // P
    U: tl.constexpr = BLOCK_M // DEPTH_ROWS
    offs_c = tl.arange(0, BLOCK_C)
    col_tok = offs_c // BLOCK_S  # token of a column inside its tile
    col_token = t0 + tl.arange(0, U)[:, None] * P + col_tok[None, :]  # (U, BLOCK_C)
    own = (tl.arange(0, DEPTH_ROWS) // GP)[:, None] == col_tok[None, :]  # (DEPTH_ROWS, BLOCK_C)
    return col_token, offs_c % BLOCK_S, own


@triton.jit
def _slot_bases(DK_TAB, DV_TAB, slot, L, ELEM: tl.constexpr):
    """Base pointers of the depth key and value slots ``slot`` (BLOCK_C,), read from the address tables."""
    ok = slot < L
    dk_slot = tl.load(DK_TAB + slot, mask=ok, other=0).to(tl.pointer_type(ELEM))
    dv_slot = tl.load(DV_TAB + slot, mask=ok, other=0).to(tl.pointer_type(ELEM))
    return dk_slot, dv_slot


# ---- NaN and Inf ---------------------------------------------------------------------------------


@triton.jit
def _zero_nonfinite(v, D_AXIS: tl.constexpr):
    """``v`` with its NaN and Inf entries zeroed, and per vector (summed over ``D_AXIS``) NaN if it held one, else 0.

    A masked column still multiplies its value by ``p = 0``, and ``0 * NaN = NaN``:
    its non-finite entries must be zeroed before a dot; the rows that may see
    it add the returned NaN to their denominator instead.
    """
    v_nan = v * 0.0  # NaN exactly at the non-finite entries
    return tl.where(v_nan == 0.0, v, 0.0), tl.sum(v_nan.to(tl.float32), D_AXIS)


@triton.jit
def _finite(x):
    """``x`` with its NaN and Inf entries read as zero (for the products of masked entries in the backward)."""
    return tl.where(x * 0.0 == 0.0, x, 0.0)


@triton.jit
def _row_lse2(lse_ptrs, row_ok):
    """The rows' lse in base 2 for recomputing ``p = exp2(s - lse)``, and which rows are dead.

    A row that saw no key (lse = -inf) and a dead row, one that saw a NaN or
    Inf (lse = NaN) and sends no gradient, both get lse = +inf, so p = 0.
    """
    lse = tl.load(lse_ptrs, mask=row_ok, other=float("inf"))
    dead = lse != lse
    return tl.where((lse == float("-inf")) | dead, float("inf"), lse) * _LOG2E, dead


# ---- fused scores --------------------------------------------------------------------------------


@triton.jit
def _score(x, bias, softcap, HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr):
    """The fused score on base-2 logits ``x``: the scored logits, and the cap's derivative (for dS).

    ``softcap``: ``cap * tanh(s / cap)`` in natural units, which in base 2 is
    ``cap * log2(e) * tanh(y)`` with ``y = x ln2 / cap``, derivative
    ``1 - tanh(y)^2``; ``bias``: the depth bias in base 2, added before the cap
    (``BIAS_FIRST``) or after it. The derivative means nothing without
    ``HAS_SOFTCAP``.
    """
    s = x
    dcap = x
    if HAS_BIAS and BIAS_FIRST:
        s = s + bias
    if HAS_SOFTCAP:
        # tanh(|y|) = 1 - r, r = 2 / (e^(2|y|) + 1) through exp2 (e^(2|y|) = 2^(2|x| / cap)): it saturates at 1
        # and keeps NaN, and 1 - tanh^2 = r (2 - r) has no cancellation where tanh is near +-1
        r = 2.0 / (tl.math.exp2(tl.abs(s) * (2.0 / softcap)) + 1.0)
        s = tl.where(s < 0, r - 1.0, 1.0 - r) * (softcap * _LOG2E)
        dcap = r * (2.0 - r)
    if HAS_BIAS and not BIAS_FIRST:
        s = s + bias
    return s, dcap


@triton.jit
def _bias_tile(BIAS, sbh, sbl, slot, L, G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr):
    """The depth bias of a tile in base 2, (DEPTH_ROWS, BLOCK_C): ``bias[head of the row, slot of the column]``."""
    head = tl.arange(0, DEPTH_ROWS) % GP  # rows of a tile are heads of consecutive tokens
    ok = (head < G)[:, None] & (slot < L)[None, :]
    return tl.load(BIAS + head[:, None] * sbh + slot[None, :] * sbl, mask=ok, other=0.0) * _LOG2E


@triton.jit
def _store_bias_grad(GBIAS, ds, l0, L, G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr,
                     BLOCK_C: tl.constexpr):
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


# ---- forward -------------------------------------------------------------------------------------


@triton.jit
def _key_columns(ptrs, k_pos, stride_t, Tk, MASKED: tl.constexpr):
    """The (D, BLOCK_N) tile of keys (or values) at positions ``k_pos``, one per column; ``MASKED``: 0 past ``Tk``."""
    if MASKED:
        tile = tl.load(ptrs + k_pos[None, :] * stride_t, mask=k_pos[None, :] < Tk, other=0.0)
    else:
        tile = tl.load(ptrs + k_pos[None, :] * stride_t)
    return tile


@triton.jit
def _fwd_seq_blocks(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kt, stride_vt, q_pos, q_doc, doc_ptr,
    start, end, Tk, window, qk_scale, softcap,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Online-softmax update of ``(acc, m, l)`` over key blocks ``[start, end)`` (Alg. 1 lines 11-22)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + offs_n
        kT = _key_columns(k_ptrs, k_pos, stride_kt, Tk, MASKED)
        x = tl.dot(q, kT) * qk_scale  # (BLOCK_M, BLOCK_N), base-2 logits
        s, _ = _score(x, 0.0, softcap, HAS_SOFTCAP, False, False)
        if MASKED:
            vis = _visible(q_pos[:, None], q_doc[:, None], k_pos[None, :], Tk, window, doc_ptr, CAUSAL, WINDOW, DOC)
            s = tl.where(vis, s, float("-inf"))
        # rescale the running max and denominator; a row that has seen nothing keeps m = -inf
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        if MASKED:
            v = tl.load(v_ptrs + k_pos[:, None] * stride_vt, mask=k_pos[:, None] < Tk, other=0.0)
            v, v_nan = _zero_nonfinite(v, 1)
            # a row that sees a non-finite key (x * 0 is NaN) or value gets NaN in its denominator
            poison = tl.where(vis, x * 0.0 + v_nan[None, :], 0.0)
        else:
            v = tl.load(v_ptrs + k_pos[:, None] * stride_vt)
            # every row sees every column: a bad value reaches acc by itself; a bad key may give
            # x = -inf (p = 0, hidden) or be capped, so add the raw x * 0, which is NaN there
            poison = x * 0.0
        l_i = l_i * alpha + tl.sum(p + poison, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_interior_tma(
    acc, m_i, l_i, q, KD, VD, b, hk, start, end, qk_scale, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    LOOP_STAGES: tl.constexpr, WS: tl.constexpr,
):
    """The unmasked blocks of :func:`_fwd_seq_blocks` with K and V tiles (BLOCK_N, D) copied by the TMA engine.

    ``KD``, ``VD``: tensor descriptors over (B, Hk, Tk, D) with (1, 1,
    BLOCK_N, D) boxes; ``b``, ``hk`` int32. ``WS`` asks Triton to split the
    loop into a producer warp group (the copies) and consumer ones; Triton
    3.6 does not compile that for this kernel on sm_90 (benchmarks/NOTES.md).
    """
    for start_n in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES, warp_specialize=WS):
        k = KD.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        x = tl.dot(q, k.T) * qk_scale  # (BLOCK_M, BLOCK_N), base-2 logits
        s, _ = _score(x, 0.0, softcap, HAS_SOFTCAP, False, False)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        # the poison of the unmasked generic blocks: x * 0 is NaN exactly at a non-finite key's logits
        l_i = l_i * alpha + tl.sum(p + x * 0.0, 1)
        v = VD.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_sequence(
    acc, m_i, l_i, q, K, V, KD, VD, b, hk, skt, skd, svt, svd, offs_d, q_pos, q_doc, DOC_IDS, lo, a, b_, hi,
    Tk, window, qk_scale, softcap,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, WS: tl.constexpr,
):
    """The sequence phase over the key ranges of :func:`_key_ranges`: masked, unmasked, masked.

    With ``TMA`` the unmasked blocks read K and V through the descriptors
    ``KD``, ``VD`` (:func:`_fwd_interior_tma`).
    """
    k_ptrs = K + offs_d[:, None] * skd
    v_ptrs = V + offs_d[None, :] * svd
    # edge blocks before the interior (window / document start), masked
    acc, m_i, l_i = _fwd_seq_blocks(acc, m_i, l_i, q, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                                    lo, a, Tk, window, qk_scale, softcap, True, CAUSAL, WINDOW, DOC,
                                    HAS_SOFTCAP, BLOCK_N)
    # interior blocks every row sees in full (Alg. 1 lines 11-17): no mask
    if TMA:
        acc, m_i, l_i = _fwd_interior_tma(acc, m_i, l_i, q, KD, VD, b, hk, a, b_, qk_scale, softcap,
                                          HAS_SOFTCAP, BLOCK_N, HEAD_DIM, LOOP_STAGES, WS)
    else:
        acc, m_i, l_i = _fwd_seq_blocks(acc, m_i, l_i, q, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                                        a, b_, Tk, window, qk_scale, softcap, False, CAUSAL, WINDOW, DOC,
                                        HAS_SOFTCAP, BLOCK_N)
    # boundary blocks with the grouped causal mask (Alg. 1 lines 18-23)
    return _fwd_seq_blocks(acc, m_i, l_i, q, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                           b_, hi, Tk, window, qk_scale, softcap, True, CAUSAL, WINDOW, DOC,
                           HAS_SOFTCAP, BLOCK_N)


@triton.jit
def _fwd_depth(
    acc, m_i, l_i, q, DK_TAB, DV_TAB, BIAS, b, hk, t0, offs_d,
    sdkb, sdkh, sdkt, sdkd, sdvb, sdvh, sdvt, sdvd, sbh, sbl,
    Tq, L, depth_first, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr,
):
    """The depth phase (Alg. 1 lines 24-29): each tile of DEPTH_ROWS rows against its own tokens' slots.

    The tiles are a reshape of the block's rows: the online-softmax state
    ``(acc, m, l)`` carries over from the sequence phase in place.
    """
    U: tl.constexpr = BLOCK_M // DEPTH_ROWS
    BLOCK_S: tl.constexpr = BLOCK_C // (DEPTH_ROWS // GP)
    col_token, col_slot, own = _depth_tiles(t0, DEPTH_ROWS, GP, BLOCK_M, BLOCK_C)
    col_token64 = col_token.to(tl.int64)
    # element offsets inside one slot: (U, D, BLOCK_C) for keys, (U, BLOCK_C, D) for values
    dk_offs = b * sdkb + hk * sdkh + col_token64[:, None, :] * sdkt + offs_d[None, :, None] * sdkd
    dv_offs = b * sdvb + hk * sdvh + col_token64[:, :, None] * sdvt + offs_d[None, None, :] * sdvd
    q3 = tl.reshape(q, (U, DEPTH_ROWS, HEAD_DIM))
    acc3 = tl.reshape(acc, (U, DEPTH_ROWS, HEAD_DIM))
    m3 = tl.reshape(m_i, (U, DEPTH_ROWS))
    l3 = tl.reshape(l_i, (U, DEPTH_ROWS))
    for l0 in range(depth_first, L, BLOCK_S):
        slot = l0 + col_slot  # (BLOCK_C,)
        col_ok = (col_token < Tq) & (slot < L)[None, :]  # (U, BLOCK_C)
        dk_slot, dv_slot = _slot_bases(DK_TAB, DV_TAB, slot, L, q.dtype)
        dkT = tl.load(dk_slot[None, None, :] + dk_offs, mask=col_ok[:, None, :], other=0.0)
        x = tl.dot(q3, dkT) * qk_scale  # (U, DEPTH_ROWS, BLOCK_C)
        bias = 0.0
        if HAS_BIAS:
            bias = _bias_tile(BIAS, sbh, sbl, slot, L, G, GP, DEPTH_ROWS)
        s, _ = _score(x, bias, softcap, HAS_SOFTCAP, HAS_BIAS, BIAS_FIRST)
        vis = own[None, :, :] & (slot < L)[None, None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m3, tl.max(s, 2))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, :, None])
        alpha = tl.math.exp2(m3 - m_use)
        dv = tl.load(dv_slot[None, :, None] + dv_offs, mask=col_ok[:, :, None], other=0.0)
        dv, dv_nan = _zero_nonfinite(dv, 2)
        # as in the masked sequence blocks: only a row that sees a non-finite entry gets NaN
        l3 = l3 * alpha + tl.sum(p + tl.where(vis, x * 0.0 + dv_nan[:, None, :], 0.0), 2)
        acc3 = acc3 * alpha[:, :, None] + tl.dot(p.to(dv.dtype), dv)
        m3 = m_new
    return tl.reshape(acc3, (BLOCK_M, HEAD_DIM)), tl.reshape(m3, (BLOCK_M,)), tl.reshape(l3, (BLOCK_M,))


@triton.jit
def _fwd_kernel(
    Q, K, V, QD, KD, VD, DK_TAB, DV_TAB, DOC_IDS, DOC_LO, DOC_HI, BIAS, O, LSE,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdkb, sdkh, sdkt, sdkd,
    sdvb, sdvh, sdvt, sdvd,
    sdoc,
    sbh, sbl,
    sob, soh, sot, sod,
    slb, slh, slt,
    Hk, Tq, Tk, L, depth_first, window, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_DEPTH: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, WS: tl.constexpr,
):
    """Fused MoDA forward: writes O (B, Hq, Tq, D) and LSE (B, Hq, Tq).

    Depth slot ``l`` of every token lives at address ``DK_TAB[l]`` (``DV_TAB[l]``)
    plus the (b, h, t, d) strides: the slots may be separate tensors. ``BIAS``:
    the depth bias (Hq, L) float32 (strides ``sbh``, ``sbl``) with ``HAS_BIAS``;
    ``softcap`` the cap with ``HAS_SOFTCAP`` (:func:`_score`).

    ``TMA`` (Hopper): the query block comes through ``QD``, a descriptor over
    Q seen as (B, Hk, Tq, G, D) with (1, 1, BLOCK_T, GP, D) boxes, which
    gives the block's rows in their order, and the unmasked key blocks
    through ``KD``, ``VD`` (:func:`_fwd_interior_tma`); ``LOOP_STAGES`` and
    ``WS`` pipeline that loop. Without ``TMA`` the descriptors are None.
    """
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    b, hk = _program(Hk)
    t0 = _query_block() * BLOCK_T
    DOC_IDS, DOC_LO, DOC_HI = _documents(DOC_IDS, DOC_LO, DOC_HI, b, sdoc)
    offs_d, d_ok = _head_lanes(HEAD_DIM, D_REAL)
    tok, grp, row_ok = _rows(t0, Tq, G, GP, BLOCK_M)
    if TMA:  # rows past Tq and heads past G are out of the descriptor's bounds: read as zeros
        q = QD.load([b.to(tl.int32), hk.to(tl.int32), t0, 0, 0]).reshape(BLOCK_M, HEAD_DIM)
    else:
        q = _load_rows(Q + b * sqb + hk * G * sqh, sqh, sqt, sqd, tok, grp, row_ok, offs_d, d_ok, HEAD_DIM, D_REAL)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    # a non-finite query makes its row NaN, even when the row sees no key
    l_i = tl.sum((q * 0.0).to(tl.float32), 1)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    if HAS_SEQ:
        q_pos, q_doc, lo, a, b_, hi = _query_keys(t0, tok, Tq, Tk, window, DOC_IDS, DOC_LO, DOC_HI,
                                                  CAUSAL, WINDOW, DOC, BLOCK_T, BLOCK_N)
        acc, m_i, l_i = _fwd_sequence(acc, m_i, l_i, q, K + b * skb + hk * skh, V + b * svb + hk * svh,
                                      KD, VD, b.to(tl.int32), hk.to(tl.int32),
                                      skt, skd, svt, svd, offs_d, q_pos, q_doc, DOC_IDS, lo, a, b_, hi,
                                      Tk, window, qk_scale, softcap, CAUSAL, WINDOW, DOC, HAS_SOFTCAP, BLOCK_N,
                                      HEAD_DIM, TMA, LOOP_STAGES, WS)
    if HAS_DEPTH:
        acc, m_i, l_i = _fwd_depth(acc, m_i, l_i, q, DK_TAB, DV_TAB, BIAS + hk * G * sbh, b, hk, t0, offs_d,
                                   sdkb, sdkh, sdkt, sdkd, sdvb, sdvh, sdvt, sdvd, sbh, sbl,
                                   Tq, L, depth_first, qk_scale, softcap, G, GP, DEPTH_ROWS, HEAD_DIM,
                                   BLOCK_M, BLOCK_C, HAS_SOFTCAP, HAS_BIAS, BIAS_FIRST)

    # A non-finite value in an unmasked block reached acc unsanitized (p * NaN, 0 * Inf):
    # fold it into l too, so that such a row stores NaN in out and lse.
    l_i += tl.sum(acc * 0.0, 1)
    # normalize once and store O and LSE (Alg. 1 lines 30-31); an empty row gives 0 and -inf
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_i)) * _LN2)
    O += b * sob + hk * G * soh
    LSE += b * slb + hk * G * slh
    tl.store(O + grp[:, None] * soh + tok[:, None] * sot + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + grp * slh + tok * slt, lse, mask=row_ok)


# ---- backward: dK, dV of the sequence keys -------------------------------------------------------


@triton.jit
def _bwd_dkdv_blocks(
    dk, dv, k, v, Q, DO, LSE, DELTA, DQA,
    sqh, sqt, sqd, sdoh, sdot, sdod, slh, slt, sah, sat,
    k_pos, Tq, Tk, window, doc_ptr, k_doc, scale, qk_scale, softcap, start, end,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query token blocks [start, end) (and dQ, :func:`_add_dq`)."""
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    offs_d, d_ok = _head_lanes(HEAD_DIM, D_REAL)
    for t0 in range(start, end, BLOCK_T):
        tok, grp, row_ok = _rows(t0, Tq, G, GP, BLOCK_M)
        lse, dead = _row_lse2(LSE + grp * slh + tok * slt, row_ok)
        # a dead row's q and dO may hold NaN: zero them, so that its p = 0 and it adds exact zeros
        live = row_ok & ~dead
        q = _load_rows(Q, sqh, sqt, sqd, tok, grp, live, offs_d, d_ok, HEAD_DIM, D_REAL)
        sT, dcapT = _score(tl.dot(k, tl.trans(q)) * qk_scale, 0.0, softcap, HAS_SOFTCAP, False, False)
        pT = tl.math.exp2(sT - lse[None, :])  # (BLOCK_N, BLOCK_M)
        if MASKED:
            q_pos = tok + (Tk - Tq)
            if DOC:
                q_doc = tl.load(doc_ptr + q_pos, mask=tok < Tq, other=0)
            else:
                q_doc = q_pos
            vis = _visible(q_pos[None, :], q_doc[None, :], k_pos[:, None], Tk, window, doc_ptr, CAUSAL, WINDOW, False)
            if DOC:
                vis = vis & (k_doc[:, None] == q_doc[None, :])
            pT = tl.where(vis, pT, 0.0)
        do = _load_rows(DO, sdoh, sdot, sdod, tok, grp, live, offs_d, d_ok, HEAD_DIM, D_REAL)
        dv += tl.dot(pT.to(do.dtype), do)
        delta = tl.load(DELTA + grp * slh + tok * slt, mask=row_ok, other=0.0)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        if HAS_SOFTCAP:
            dsT *= dcapT
        dsT = dsT.to(q.dtype)
        dk += tl.dot(dsT, q)
        if DQ_ATOMIC:
            _add_dq(DQA, sah, sat, dsT, k, scale, tok, grp, row_ok, offs_d, d_ok)
    return dk, dv


@triton.jit
def _add_dq(DQA, sah, sat, dsT, k, scale, tok, grp, row_ok, offs_d, d_ok):
    """Add one key block's part of dQ, ``dS K * scale`` (BLOCK_M, D), to the rows' float32 sums in ``DQA``.

    Atomic adds: the dQ kernel need not recompute ``QK^T`` and ``dO V^T``, but
    the order of the additions, and so the last bits of dQ, vary between runs.
    """
    dq = tl.dot(tl.trans(dsT), k) * scale
    tl.atomic_add(DQA + grp[:, None] * sah + tok[:, None] * sat + offs_d[None, :], dq,
                  mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")


@triton.jit
def _bwd_dkdv_interior_tma(
    dk, dv, k, v, QD, DOD, LSE, DELTA, DQA, DQD, b, hk, slh, slt, sah, sat, Tq, scale, qk_scale, softcap, start, end,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, LOOP_STAGES: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):
    """The unmasked query blocks of :func:`_bwd_dkdv_blocks` with q and dO tiles copied by the TMA engine.

    ``QD``, ``DOD``: descriptors with (1, 1, BLOCK_T, GP, D) boxes over Q and
    dO seen as (B, Hk, Tq, G, D); a box is the block's rows in their order,
    rows past Tq or G read as zeros. No row may be dead: a copy cannot leave
    its q and dO out, and zeroing them after the copy spills registers.
    ``DQ_ATOMIC == 2`` adds the block's part of dQ with one bulk reduction of
    the TMA engine per tile, through ``DQD`` (a descriptor like ``QD`` over
    the float32 sums ``DQA``), instead of one atomic per element (the
    interpreter runs only the latter).
    """
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    for t0 in tl.range(start, end, BLOCK_T, num_stages=LOOP_STAGES):
        tok, grp, row_ok = _rows(t0, Tq, G, GP, BLOCK_M)
        lse, _ = _row_lse2(LSE + grp * slh + tok * slt, row_ok)
        q = QD.load([b, hk, t0, 0, 0]).reshape(BLOCK_M, HEAD_DIM)
        do = DOD.load([b, hk, t0, 0, 0]).reshape(BLOCK_M, HEAD_DIM)
        sT, dcapT = _score(tl.dot(k, q.T) * qk_scale, 0.0, softcap, HAS_SOFTCAP, False, False)
        pT = tl.math.exp2(sT - lse[None, :])  # (BLOCK_N, BLOCK_M)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        delta = tl.load(DELTA + grp * slh + tok * slt, mask=row_ok, other=0.0)
        dsT = pT * (tl.dot(v, do.T) - delta[None, :])
        if HAS_SOFTCAP:
            dsT *= dcapT
        dsT = dsT.to(q.dtype)
        dk = tl.dot(dsT, q, dk)
        if DQ_ATOMIC == 2:
            dq = tl.dot(tl.trans(dsT), k) * scale
            DQD.atomic_add([b, hk, t0, 0, 0], dq.reshape(1, 1, BLOCK_T, GP, HEAD_DIM))
        elif DQ_ATOMIC:
            offs_d, d_ok = _head_lanes(HEAD_DIM, HEAD_DIM)
            _add_dq(DQA, sah, sat, dsT, k, scale, tok, grp, row_ok, offs_d, d_ok)
    return dk, dv


@triton.jit
def _any_flag(FLAGS, n):
    """Whether any of the ``n`` int8 flags at ``FLAGS`` is set."""
    seen = tl.zeros((1024,), tl.int8)
    for i in range(0, n, 1024):
        offs = i + tl.arange(0, 1024)
        seen = tl.maximum(seen, tl.load(FLAGS + offs, mask=offs < n, other=0))
    return tl.max(seen, 0) > 0


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, QD, DOD, DEAD, DOC_IDS, DOC_LO, DOC_HI, DKO, DVO, DQA, DQD,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdob, sdoh, sdot, sdod,
    slb, slh, slt,
    sdoc,
    sgb, sgh, sgt, sgd,
    sab, sah, sat,
    Hk, Tq, Tk, window, scale, qk_scale, softcap, dead_blocks,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):
    """dK, dV (B, Hk, Tk, D) of one block of BLOCK_N sequence keys, summed over the G heads that read it.

    ``TMA`` (Hopper): the unmasked query blocks come through the descriptors
    ``QD``, ``DOD`` (:func:`_bwd_dkdv_interior_tma`), and ``DEAD`` holds the
    dQ kernel's ``dead_blocks`` flags per (batch, KV head): whether a block
    of rows has a dead one. Else the three are None. ``DQ_ATOMIC``: also add
    the block's part of dQ to ``DQA``, (B, Hq, Tq, D) float32 sums with unit
    last stride, which the dQ kernel began with the depth part (:func:`_add_dq`);
    2: in the unmasked blocks by bulk reductions through ``DQD`` (``TMA`` only).
    """
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    b, hk = _program(Hk)
    n0 = tl.program_id(0) * BLOCK_N
    DOC_IDS, DOC_LO, DOC_HI = _documents(DOC_IDS, DOC_LO, DOC_HI, b, sdoc)
    Q += b * sqb + hk * G * sqh
    DO += b * sdob + hk * G * sdoh
    LSE += b * slb + hk * G * slh
    DELTA += b * slb + hk * G * slh

    offs_d, d_ok = _head_lanes(HEAD_DIM, D_REAL)
    k_pos = n0 + tl.arange(0, BLOCK_N)
    k_ok = k_pos < Tk
    K += b * skb + hk * skh
    V += b * svb + hk * svh
    # A live row never sees a non-finite key or value, but masked ones still enter its products (0 * NaN):
    # read the block as if they were zero, once.
    k = _finite(tl.load(K + k_pos[:, None] * skt + offs_d[None, :] * skd, mask=k_ok[:, None], other=0.0))
    v = _finite(tl.load(V + k_pos[:, None] * svt + offs_d[None, :] * svd, mask=k_ok[:, None], other=0.0))
    if DOC:
        k_doc = tl.load(DOC_IDS + k_pos, mask=k_ok, other=0)
    else:
        k_doc = k_pos
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)

    DQA += b * sab + hk * G * sah
    lo, a, b_, hi = _query_ranges(n0, Tq, Tk, window, DOC_LO, DOC_HI, CAUSAL, WINDOW, DOC, BLOCK_N, BLOCK_T)
    dk, dv = _bwd_dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, DQA, sqh, sqt, sqd, sdoh, sdot, sdod, slh, slt,
                              sah, sat, k_pos, Tq, Tk, window, DOC_IDS, k_doc, scale, qk_scale, softcap, lo, a,
                              True, CAUSAL, WINDOW, DOC, G, GP, HEAD_DIM, D_REAL, BLOCK_M, HAS_SOFTCAP, DQ_ATOMIC)
    # A copy cannot leave a dead row out (its q and dO may hold NaN): heads that have one take the masked loads.
    if TMA and not _any_flag(DEAD + (b * Hk + hk) * dead_blocks, dead_blocks):
        dk, dv = _bwd_dkdv_interior_tma(dk, dv, k, v, QD, DOD, LSE, DELTA, DQA, DQD, b.to(tl.int32), hk.to(tl.int32),
                                        slh, slt, sah, sat, Tq, scale, qk_scale, softcap, a, b_, G, GP,
                                        HEAD_DIM, BLOCK_M, HAS_SOFTCAP, LOOP_STAGES, DQ_ATOMIC)
    else:
        dk, dv = _bwd_dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, DQA, sqh, sqt, sqd, sdoh, sdot, sdod, slh, slt,
                                  sah, sat, k_pos, Tq, Tk, window, DOC_IDS, k_doc, scale, qk_scale, softcap, a, b_,
                                  False, CAUSAL, WINDOW, DOC, G, GP, HEAD_DIM, D_REAL, BLOCK_M, HAS_SOFTCAP, DQ_ATOMIC)
    dk, dv = _bwd_dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, DQA, sqh, sqt, sqd, sdoh, sdot, sdod, slh, slt,
                              sah, sat, k_pos, Tq, Tk, window, DOC_IDS, k_doc, scale, qk_scale, softcap, b_, hi,
                              True, CAUSAL, WINDOW, DOC, G, GP, HEAD_DIM, D_REAL, BLOCK_M, HAS_SOFTCAP, DQ_ATOMIC)
    DKO += b * sgb + hk * sgh
    DVO += b * sgb + hk * sgh
    store_ok = k_ok[:, None] & d_ok[None, :]
    tl.store(DKO + k_pos[:, None] * sgt + offs_d[None, :] * sgd, (dk * scale).to(DKO.dtype.element_ty), mask=store_ok)
    tl.store(DVO + k_pos[:, None] * sgt + offs_d[None, :] * sgd, dv.to(DVO.dtype.element_ty), mask=store_ok)


# ---- backward: dQ, delta, and the depth gradients ------------------------------------------------


@triton.jit
def _bwd_dq_seq_blocks(
    dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kt, stride_vt, q_pos, q_doc, doc_ptr,
    start, end, Tk, window, qk_scale, softcap,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Accumulate dQ (unscaled) over key blocks [start, end)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + offs_n
        kT = _key_columns(k_ptrs, k_pos, stride_kt, Tk, MASKED)
        vT = _key_columns(v_ptrs, k_pos, stride_vt, Tk, MASKED)
        if MASKED:
            # a masked non-finite key or value would reach a live row through 0 * NaN: read it as zero.
            # (Unmasked, every row sees these keys: a non-finite one only reaches dead rows, whose dq is zeroed.)
            kT, vT = _finite(kT), _finite(vT)
        s, dcap = _score(tl.dot(q, kT) * qk_scale, 0.0, softcap, HAS_SOFTCAP, False, False)
        p = tl.math.exp2(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
        if MASKED:
            vis = _visible(q_pos[:, None], q_doc[:, None], k_pos[None, :], Tk, window, doc_ptr, CAUSAL, WINDOW, DOC)
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, vT)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds *= dcap
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    return dq


@triton.jit
def _bwd_dq_interior_tma(
    dq, q, do, lse, delta, KD, VD, b, hk, start, end, qk_scale, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """The unmasked blocks of :func:`_bwd_dq_seq_blocks` with K and V tiles (BLOCK_N, D) copied by the TMA engine."""
    for start_n in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
        k = KD.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = VD.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        s, dcap = _score(tl.dot(q, k.T) * qk_scale, 0.0, softcap, HAS_SOFTCAP, False, False)
        p = tl.math.exp2(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
        ds = p * (tl.dot(do, v.T) - delta[:, None])
        if HAS_SOFTCAP:
            ds *= dcap
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _bwd_dq_sequence(
    dq, q, do, lse, delta, K, V, KD, VD, b, hk, skt, skd, svt, svd, offs_d, q_pos, q_doc, DOC_IDS, lo, a, b_, hi,
    Tk, window, qk_scale, softcap,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, TMA: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """dQ over the key ranges of :func:`_key_ranges`, as the forward visits them: masked, unmasked, masked.

    With ``TMA`` the unmasked blocks read K and V through the descriptors ``KD``, ``VD``.
    """
    k_ptrs = K + offs_d[:, None] * skd
    v_ptrs = V + offs_d[:, None] * svd
    dq = _bwd_dq_seq_blocks(dq, q, do, lse, delta, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                            lo, a, Tk, window, qk_scale, softcap, True, CAUSAL, WINDOW, DOC, HAS_SOFTCAP, BLOCK_N)
    if TMA:
        dq = _bwd_dq_interior_tma(dq, q, do, lse, delta, KD, VD, b, hk, a, b_, qk_scale, softcap,
                                  HAS_SOFTCAP, BLOCK_N, HEAD_DIM, LOOP_STAGES)
    else:
        dq = _bwd_dq_seq_blocks(dq, q, do, lse, delta, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                                a, b_, Tk, window, qk_scale, softcap, False, CAUSAL, WINDOW, DOC, HAS_SOFTCAP, BLOCK_N)
    return _bwd_dq_seq_blocks(dq, q, do, lse, delta, k_ptrs, v_ptrs, skt, svt, q_pos, q_doc, DOC_IDS,
                              b_, hi, Tk, window, qk_scale, softcap, True, CAUSAL, WINDOW, DOC, HAS_SOFTCAP, BLOCK_N)


@triton.jit
def _bwd_dq_depth(
    dq, q, do, lse, delta, DK_TAB, DV_TAB, DDKO, DDVO, BIAS, GBIAS, b, hk, t0, offs_d, d_ok,
    sdkb, sdkh, sdkt, sdkd, sdvb, sdvh, sdvt, sdvd, sgdt, sgdl, sgdd, sbh, sbl,
    Tq, L, depth_first, scale, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr, BIAS_GRAD: tl.constexpr,
):
    """The depth phase of the backward in the forward's tiles: dQ, and the depth (and bias) gradients written.

    A token's depth entries are read only by its own G rows, which all live
    in this block, so its depth gradients are written once, without atomics.
    """
    U: tl.constexpr = BLOCK_M // DEPTH_ROWS
    BLOCK_S: tl.constexpr = BLOCK_C // (DEPTH_ROWS // GP)
    col_token, col_slot, own = _depth_tiles(t0, DEPTH_ROWS, GP, BLOCK_M, BLOCK_C)
    rows = col_token.to(tl.int64)[:, :, None]
    dk_offs = b * sdkb + hk * sdkh + rows * sdkt + offs_d[None, None, :] * sdkd  # (U, BLOCK_C, D)
    dv_offs = b * sdvb + hk * sdvh + rows * sdvt + offs_d[None, None, :] * sdvd
    gk_ptrs = DDKO + rows * sgdt + offs_d[None, None, :] * sgdd
    gv_ptrs = DDVO + rows * sgdt + offs_d[None, None, :] * sgdd
    q3 = tl.reshape(q, (U, DEPTH_ROWS, HEAD_DIM))
    do3 = tl.reshape(do, (U, DEPTH_ROWS, HEAD_DIM))
    lse3 = tl.reshape(lse, (U, DEPTH_ROWS))
    delta3 = tl.reshape(delta, (U, DEPTH_ROWS))
    dq3 = tl.reshape(dq, (U, DEPTH_ROWS, HEAD_DIM))
    for l0 in range(depth_first, L, BLOCK_S):
        slot = l0 + col_slot  # (BLOCK_C,)
        col_ok = ((col_token < Tq) & (slot < L)[None, :])[:, :, None]  # (U, BLOCK_C, 1)
        store_ok = col_ok & d_ok[None, None, :]
        dk_slot, dv_slot = _slot_bases(DK_TAB, DV_TAB, slot, L, q.dtype)
        # every depth column is masked for most rows of a tile: read non-finite entries as zero
        kd = _finite(tl.load(dk_slot[None, :, None] + dk_offs, mask=col_ok, other=0.0))  # (U, BLOCK_C, D)
        vd = _finite(tl.load(dv_slot[None, :, None] + dv_offs, mask=col_ok, other=0.0))
        bias = 0.0
        if HAS_BIAS:
            bias = _bias_tile(BIAS, sbh, sbl, slot, L, G, GP, DEPTH_ROWS)
        s, dcap = _score(tl.dot(q3, tl.permute(kd, (0, 2, 1))) * qk_scale, bias, softcap,
                         HAS_SOFTCAP, HAS_BIAS, BIAS_FIRST)
        p = tl.math.exp2(s - lse3[:, :, None])
        p = tl.where(own[None, :, :] & (slot < L)[None, None, :], p, 0.0)  # (U, DEPTH_ROWS, BLOCK_C)
        dp = tl.dot(do3, tl.permute(vd, (0, 2, 1)))
        ds = p * (dp - delta3[:, :, None])  # gradient of the scored logit
        if BIAS_GRAD and not BIAS_FIRST:  # bias added last: its gradient is dS itself
            _store_bias_grad(GBIAS, ds, l0, L, G, GP, DEPTH_ROWS, BLOCK_C)
        if HAS_SOFTCAP:
            ds *= dcap
        if BIAS_GRAD and BIAS_FIRST:  # bias added before the cap: its gradient is the raw logit's
            _store_bias_grad(GBIAS, ds, l0, L, G, GP, DEPTH_ROWS, BLOCK_C)
        dq3 += tl.dot(ds.to(kd.dtype), kd)
        # a column's gradient sums over its own token's G rows (p and ds are zero elsewhere)
        gv = tl.dot(tl.permute(p, (0, 2, 1)).to(do3.dtype), do3)  # (U, BLOCK_C, D)
        gk = tl.dot(tl.permute(ds, (0, 2, 1)).to(q3.dtype), q3) * scale
        tl.store(gk_ptrs + slot[None, :, None] * sgdl, gk.to(DDKO.dtype.element_ty), mask=store_ok)
        tl.store(gv_ptrs + slot[None, :, None] * sgdl, gv.to(DDVO.dtype.element_ty), mask=store_ok)
    return tl.reshape(dq3, (BLOCK_M, HEAD_DIM))


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, KD, VD, DK_TAB, DV_TAB, O, DO, LSE, GLSE, DELTA, DEAD, DOC_IDS, DOC_LO, DOC_HI, BIAS, DQO, DDKO, DDVO,
    GBIAS,
    sqb, sqh, sqt, sqd,
    sob, soh, sot, sod,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdkb, sdkh, sdkt, sdkd,
    sdvb, sdvh, sdvt, sdvd,
    sdob, sdoh, sdot, sdod,
    slb, slh, slt,
    sdoc,
    sbh, sbl,
    sgqb, sgqh, sgqt, sgqd,
    sgdb, sgdh, sgdt, sgdl, sgdd,
    Hk, Tq, Tk, L, depth_first, window, scale, qk_scale, softcap,
    G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_DEPTH: tl.constexpr, HAS_GLSE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr, BIAS_GRAD: tl.constexpr,
    TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, DEAD_FLAGS: tl.constexpr,
):
    """dQ of one query block, the depth gradients of its tokens, and DELTA of its rows for the dK/dV kernel.

    ``DELTA = rowsum(dO * O) - dLSE`` (so that ``dS = P * (dP - DELTA)`` also
    carries the lse gradient; LSE, GLSE and DELTA share strides). With
    ``BIAS_GRAD``, the program also writes its part of the depth bias's
    gradient, summed over its tokens: row ``(b, hk, block)`` of GBIAS
    (B * Hk, blocks, GP, L) float32, which the launcher reduces. ``TMA``
    (Hopper): the unmasked key blocks come through the descriptors ``KD``,
    ``VD`` (:func:`_bwd_dq_interior_tma`), else they are None. With
    ``DEAD_FLAGS``, the program also writes whether its block has a dead row
    to ``DEAD`` (B * Hk, blocks) int8, for the dK/dV kernel's descriptors.
    """
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    b, hk = _program(Hk)
    block = _query_block()
    t0 = block * BLOCK_T
    DOC_IDS, DOC_LO, DOC_HI = _documents(DOC_IDS, DOC_LO, DOC_HI, b, sdoc)
    LSE += b * slb + hk * G * slh
    GLSE += b * slb + hk * G * slh
    DELTA += b * slb + hk * G * slh

    offs_d, d_ok = _head_lanes(HEAD_DIM, D_REAL)
    tok, grp, row_ok = _rows(t0, Tq, G, GP, BLOCK_M)
    lse, dead = _row_lse2(LSE + grp * slh + tok * slt, row_ok)
    # A dead row (it saw a NaN or Inf) sends no gradient: zero q and dO, so that its p = 0 and its
    # terms in the depth gradients are exact zeros, and give it delta = 0.
    live = row_ok & ~dead
    q = _load_rows(Q + b * sqb + hk * G * sqh, sqh, sqt, sqd, tok, grp, live, offs_d, d_ok, HEAD_DIM, D_REAL)
    do = _load_rows(DO + b * sdob + hk * G * sdoh, sdoh, sdot, sdod, tok, grp, live, offs_d, d_ok, HEAD_DIM, D_REAL)
    o = _load_rows(O + b * sob + hk * G * soh, soh, sot, sod, tok, grp, live, offs_d, d_ok, HEAD_DIM, D_REAL)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_GLSE:
        delta -= tl.load(GLSE + grp * slh + tok * slt, mask=row_ok, other=0.0)
    delta = tl.where(dead, 0.0, delta)
    tl.store(DELTA + grp * slh + tok * slt, delta, mask=row_ok)
    if DEAD_FLAGS:
        tl.store(DEAD + (b * Hk + hk) * tl.num_programs(0) + block, tl.max(dead.to(tl.int8), 0))

    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    if HAS_SEQ:
        q_pos, q_doc, lo, a, b_, hi = _query_keys(t0, tok, Tq, Tk, window, DOC_IDS, DOC_LO, DOC_HI,
                                                  CAUSAL, WINDOW, DOC, BLOCK_T, BLOCK_N)
        dq = _bwd_dq_sequence(dq, q, do, lse, delta, K + b * skb + hk * skh, V + b * svb + hk * svh,
                              KD, VD, b.to(tl.int32), hk.to(tl.int32),
                              skt, skd, svt, svd, offs_d, q_pos, q_doc, DOC_IDS, lo, a, b_, hi,
                              Tk, window, qk_scale, softcap, CAUSAL, WINDOW, DOC, HAS_SOFTCAP, BLOCK_N,
                              HEAD_DIM, TMA, LOOP_STAGES)
    if HAS_DEPTH:
        dq = _bwd_dq_depth(dq, q, do, lse, delta, DK_TAB, DV_TAB, DDKO + b * sgdb + hk * sgdh,
                           DDVO + b * sgdb + hk * sgdh, BIAS + hk * G * sbh,
                           GBIAS + ((b * Hk + hk) * tl.num_programs(0) + block) * GP * L, b, hk, t0, offs_d, d_ok,
                           sdkb, sdkh, sdkt, sdkd, sdvb, sdvh, sdvt, sdvd, sgdt, sgdl, sgdd, sbh, sbl,
                           Tq, L, depth_first, scale, qk_scale, softcap, G, GP, DEPTH_ROWS, HEAD_DIM,
                           BLOCK_M, BLOCK_C, HAS_SOFTCAP, HAS_BIAS, BIAS_FIRST, BIAS_GRAD)

    # a dead row's dq took NaN from the unmasked blocks (unsanitized keys): it sends no gradient
    dq = tl.where(dead[:, None], 0.0, dq)
    DQO += b * sgqb + hk * G * sgqh
    tl.store(DQO + grp[:, None] * sgqh + tok[:, None] * sgqt + offs_d[None, :] * sgqd,
             (dq * scale).to(DQO.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
