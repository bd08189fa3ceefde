"""What the three kernels share: programs and rows, key ranges and masks, depth tiles, fused scores.

Strides arrive as one tuple per tensor, in the tensor's axis order: ``sq`` is
``q.stride()``, (b, h, t, d).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# ---- programs, rows, key ranges, masks -----------------------------------------------------------


@triton.jit
def batch_head(Hk):
    """This program's batch element and KV head (grid axis 1 is B * Hk), int64: base offsets may pass 2**31."""
    pid_bh = tl.program_id(1).to(tl.int64)
    return pid_bh // Hk, pid_bh % Hk


@triton.jit
def query_block():
    """This program's block of query tokens (grid axis 0): the last first, as causal blocks at the end are longest."""
    return tl.num_programs(0) - 1 - tl.program_id(0)


@triton.jit
def block_rows(t0, Tq, G: tl.constexpr, ROW_G: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows of the block of tokens from ``t0`` (Alg. 1 lines 3-4, 8): token, head in the group, real or padding.

    Each token takes ``ROW_G`` consecutive rows, its G heads first: ``GP``
    (G rounded up to a power of two) where the rows must fall into tiles of
    whole tokens, else G itself (no padding between tokens). The block's
    ``BLOCK_M // ROW_G`` tokens; its rows past them are padding.
    """
    offs_m = tl.arange(0, BLOCK_M)
    tok = t0 + offs_m // ROW_G
    grp = offs_m % ROW_G
    return tok, grp, (tok < Tq) & (grp < G) & (offs_m < (BLOCK_M // ROW_G) * ROW_G)


@triton.jit
def load_rows(ptr, strides, tok, grp, row_ok, offs_d, d_ok, HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr):
    """Per-row vectors (q, dO, O), (BLOCK_M, HEAD_DIM), of head ``grp`` at token ``tok``; zero off ``row_ok`` and padded lanes.

    ``ptr`` points at the group's first head; ``strides`` are the tensor's
    (b, h, t, d). The rows are chosen by the load's mask, not by a select
    after it: a select on a loaded tile keeps the compiler from pipelining
    the load straight into shared memory.
    """
    offs = grp[:, None] * strides[1] + tok[:, None] * strides[2] + offs_d[None, :] * strides[3]
    x = tl.load(ptr + offs, mask=row_ok[:, None], other=0.0)
    if D_REAL != HEAD_DIM:
        x = tl.where(d_ok[None, :], x, 0.0)
    return x


@triton.jit
def store_rows(ptr, strides, x, tok, grp, row_ok, offs_d, d_ok):
    """Store per-row vectors ``x`` (BLOCK_M, HEAD_DIM) as :func:`load_rows` reads them, real rows and lanes only."""
    offs = grp[:, None] * strides[1] + tok[:, None] * strides[2] + offs_d[None, :] * strides[3]
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def head_lanes(HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr):
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
def documents(DOC_IDS, DOC_LO, DOC_HI, b, sdoc):
    """Batch row ``b`` of the document ids and of the starts and ends of their runs."""
    return DOC_IDS + b * sdoc, DOC_LO + b * sdoc, DOC_HI + b * sdoc


@triton.jit
def key_ranges(
    p_first, p_last, Tk, window, DOC_LO, DOC_HI,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
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
        lo = tl.maximum(lo, tl.load(DOC_LO + p_first))
        hi = tl.minimum(hi, tl.load(DOC_HI + p_last))
        full_lo = tl.maximum(full_lo, tl.load(DOC_LO + p_last))
        full_hi = tl.minimum(full_hi, tl.load(DOC_HI + p_first))
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    a = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi)
    b = tl.minimum(tl.maximum((full_hi // BLOCK_N) * BLOCK_N, a), hi)
    return lo, a, b, hi


@triton.jit
def query_keys(
    t0, tok, Tq, Tk, window, DOC_IDS, DOC_LO, DOC_HI,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The rows' absolute positions and document ids, and the key ranges of their block (:func:`key_ranges`)."""
    shift = Tk - Tq  # query token t sits at absolute position t + shift
    q_pos = tok + shift
    if DOC:
        q_doc = tl.load(DOC_IDS + q_pos, mask=tok < Tq, other=0)
    else:
        q_doc = q_pos
    p_last = tl.minimum(t0 + BLOCK_T, Tq) - 1 + shift
    lo, a, b, hi = key_ranges(p_first=t0 + shift, p_last=p_last, Tk=Tk, window=window, DOC_LO=DOC_LO, DOC_HI=DOC_HI,
                              CAUSAL=CAUSAL, WINDOW=WINDOW, DOC=DOC, BLOCK_N=BLOCK_N)  # fmt: skip
    return q_pos, q_doc, lo, a, b, hi


@triton.jit
def query_ranges(
    n0, Tq, Tk, window, DOC_LO, DOC_HI,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Query token blocks for the keys [n0, n0 + BLOCK_N): :func:`key_ranges` seen from the keys.

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
def visible(
    q_pos, q_doc, k_pos, Tk, window, DOC_IDS,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOC: tl.constexpr,
):  # fmt: skip
    """Sequence mask for broadcastable query/key positions."""
    vis = k_pos < Tk
    if CAUSAL:
        vis = vis & (k_pos <= q_pos)
    if WINDOW:
        vis = vis & (k_pos > q_pos - window)
    if DOC:
        k_doc = tl.load(DOC_IDS + k_pos, mask=k_pos < Tk, other=0)
        vis = vis & (k_doc == q_doc)
    return vis


@triton.jit
def key_columns(ptrs, k_pos, stride_t, Tk, MASKED: tl.constexpr):
    """The (D, BLOCK_N) tile of keys (or values) at positions ``k_pos``, one per column; ``MASKED``: 0 past ``Tk``."""
    if MASKED:
        tile = tl.load(ptrs + k_pos[None, :] * stride_t, mask=k_pos[None, :] < Tk, other=0.0)
    else:
        tile = tl.load(ptrs + k_pos[None, :] * stride_t)
    return tile


@triton.jit
def depth_tiles(t0, DEPTH_ROWS: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
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
def depth_offsets(b, hk, col_token, offs_d, strides, KEYS_T: tl.constexpr):
    """Element offsets of the depth columns inside one slot, from the slots' (b, h, t, d) strides.

    (U, BLOCK_C, D), or (U, D, BLOCK_C) with ``KEYS_T`` (keys to multiply as their transpose).
    """
    tok = col_token.to(tl.int64)
    base = b * strides[0] + hk * strides[1]
    # One return: Triton's compiler checks every return's type, those past a taken constexpr branch too.
    if KEYS_T:
        offs = base + tok[:, None, :] * strides[2] + offs_d[None, :, None] * strides[3]
    else:
        offs = base + tok[:, :, None] * strides[2] + offs_d[None, None, :] * strides[3]
    return offs


# ---- the backward's rows --------------------------------------------------------------------------


@triton.jit
def row_lse2(lse_ptrs, row_ok):
    """The rows' lse in base 2 for recomputing ``p = exp2(s - lse)``; a row that saw no key (lse = -inf) gets
    +inf, so that its p = 0."""
    lse = tl.load(lse_ptrs, mask=row_ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E


# ---- fused scores --------------------------------------------------------------------------------


@triton.jit
def score(x, bias, softcap, HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr):
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
        s = tl.where(s < 0, r - 1.0, 1.0 - r) * (softcap * LOG2E)
        dcap = r * (2.0 - r)
    if HAS_BIAS and not BIAS_FIRST:
        s = s + bias
    return s, dcap


@triton.jit
def sequence_score(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """:func:`score` for sequence keys, which no depth bias reaches."""
    return score(x, 0.0, softcap, HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=False, BIAS_FIRST=False)


@triton.jit
def bias_tile(BIAS, sbias, slot, L, G: tl.constexpr, GP: tl.constexpr, DEPTH_ROWS: tl.constexpr):
    """The depth bias of a tile in base 2, (DEPTH_ROWS, BLOCK_C): ``bias[head of the row, slot of the column]``.

    ``sbias``: the bias's (head, slot) strides.
    """
    head = tl.arange(0, DEPTH_ROWS) % GP  # rows of a tile are heads of consecutive tokens
    ok = (head < G)[:, None] & (slot < L)[None, :]
    return tl.load(BIAS + head[:, None] * sbias[0] + slot[None, :] * sbias[1], mask=ok, other=0.0) * LOG2E
