"""A variant's score as FlexAttention's ``score_mod``, and the copies that spread a learned tensor's gradient.

A row is read back as (query head, token) and a column as a key position or
a (token, slot) depth entry, by the mask's decoding
(:func:`.block_mask.folded_query`, :func:`.block_mask.depth_entry`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...variants import Variant
from .block_mask import Layout, depth_entry, folded_query, layout_lengths


# Inductor's default FlexAttention tiles for a score whose tensors learn ask
# an H100 for more shared memory than it has ("No valid triton configs" at
# bf16, D=64); these options are the ones that compile there (see
# benchmarks/bench_score.py).
LEARNED_SCORE_KERNEL_OPTIONS = {"num_stages": 2}


# FlexAttention sums a learning tensor's gradient by atomic adds from every
# score entry it visits; into a small bias they collide (with a (6, 24) depth
# bias a call on an H100 took 36x the time of one without; through the copies
# 6x: docs/design-notes.md, "The flex backend"). Stacked copies, each entry adding into the one its
# (row, column) hashes to, spread them; their sum is the gradient.
SPREAD_ELEMENTS = 2**20  # at most this many elements of copies per tensor
MAX_COPIES = 1024


def copies_of(param: Tensor) -> int:
    """How many stacked copies of ``param`` the score reads: 1 unless its gradient is computed."""
    if not (param.requires_grad and torch.is_grad_enabled()):
        return 1
    return max(1, min(MAX_COPIES, SPREAD_ELEMENTS // max(param.numel(), 1)))


def spread(param: Tensor, copies: int) -> Tensor:
    """``param`` as (copies, *param.shape), materialized, or ``param`` itself for one copy."""
    if copies == 1:
        return param
    return param.unsqueeze(0).expand(copies, *param.shape).contiguous()


class _Copy:
    """A score's view of one copy of a stacked tensor: ``t[i]`` reads ``stacked[copy, i]``, in one index.

    FlexAttention takes a score's tensor reads one scalar at a time, so the
    copy is chosen inside the same index; the tensor's shape is readable.
    """

    def __init__(self, stacked: Tensor, copy):
        self._stacked, self._copy = stacked, copy
        self.shape, self.dtype, self.device = stacked.shape[1:], stacked.dtype, stacked.device
        self.ndim = len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def __getitem__(self, index):
        return self._stacked[(self._copy, *(index if isinstance(index, tuple) else (index,)))]


def reads_by_index(variant: Variant, q_heads: int, slots: int) -> bool:
    """Whether the score reads its tensors only by indexing them (so through :class:`_Copy` too)."""
    params = variant.score.params
    copies = [_Copy(p.detach()[None], torch.zeros(1, dtype=torch.long, device=p.device)) for p in params]
    try:
        probe_score(variant.score.bind(q_heads, slots, copies), params[0].device)
    except (TypeError, AttributeError):  # an operation a _Copy does not offer
        return False
    return True


# A grid of logits laid out like the reference's (B, Hq, Tq, N), every size
# distinct and above 1, sequence and depth columns alternating.
_PROBE_SHAPE = (2, 3, 4, 5)


def probe_score(fn, device) -> Tensor:
    """The score function on the :data:`_PROBE_SHAPE` grid (logits 0, every index 0), as the reference calls it.

    Inside FlexAttention every logit is a scalar, so a function that does not
    keep the logit's shape (a reduction or a reshape over some axis) would run
    there; on this grid it fails as on the reference, naming the shapes.
    Index tensors have no 0-d one: Dynamo reads a 0-d integer tensor used as
    an index as a Python int, a data-dependent value it cannot trace.
    """
    B, H, T, N = _PROBE_SHAPE

    def zeros(*shape):
        return torch.zeros(shape, dtype=torch.long, device=device)

    is_depth = (torch.arange(N, device=device) % 2 == 1).view(1, 1, 1, N)
    return fn(torch.zeros(_PROBE_SHAPE, device=device), zeros(B, 1, 1, 1), zeros(1, H, 1, 1), zeros(1, 1, T, 1),
              zeros(1, 1, T, N), zeros(1, 1, 1, N), is_depth)  # fmt: skip


def no_score_mod(score, b, h, q_idx, kv_idx):
    return score


def score_mod(variant: Variant, layout: Layout, *, q_heads: int, slots: int, copies, device):
    """The variant's score over ``layout``'s rows and columns, as FlexAttention's score_mod.

    Returns ``moda_score(score, b, h, row, col, *params)``, ``h`` the call's
    head (a KV head for folded rows); ``params`` are the score's tensors (or
    a backend's copies of them), each stacked ``copies[i]`` times by
    :func:`spread` where that is above 1. ``slots`` is the call's L, which
    the score is bound to whatever columns the layout holds.
    """
    score = variant.score
    groups, has_keys, has_depth = layout.groups, layout.seq_cols > 0, layout.slots > 0
    dims = layout_lengths(layout, device)  # a compiled kernel reads the lengths as inputs

    def moda_score(s, b, h, row, col, *params):
        offset, _, last_key, seq_cols, slots_t = dims.unbind()
        # 131 is odd and near a tile's width: a tile's entries hash to many copies.
        params = [p if n == 1 else _Copy(p, (row * 131 + col) % n) for p, n in zip(params, copies)]
        fn = score.bind(q_heads, slots, params)
        _, q_pos, q_head = folded_query(h, row, groups, offset)
        if not has_depth:  # sequence columns (and pad) only: the key's position
            no_slot = torch.zeros_like(col)
            return fn(s, b, q_head, q_pos, torch.minimum(col, last_key), no_slot, no_slot != 0)
        # Depth columns: the entry's token and slot.
        d_pos, d_slot = depth_entry(col, seq_cols, slots_t, offset)
        if not has_keys:
            return fn(s, b, q_head, q_pos, d_pos, d_slot, d_slot >= 0)
        is_depth = col >= seq_cols
        pos = torch.where(is_depth, d_pos, torch.minimum(col, last_key))
        slot = torch.where(is_depth, d_slot, torch.zeros_like(d_slot))
        return fn(s, b, q_head, q_pos, pos, slot, is_depth)

    moda_score.__name__ = f"moda_{score.name}"
    return moda_score
