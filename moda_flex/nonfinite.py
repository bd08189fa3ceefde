"""NaN and Inf in the inputs reach exactly the rows that may see them.

The contract: a row's output, lse and gradients depend only on the entries
that row may see. Attention kernels give a masked entry a zero weight, but
``0 * NaN = NaN``: a NaN value in a masked key's block still reaches the
row through ``P @ V`` (and a masked key through ``dS @ K`` in the backward).
So every backend computes on copies of the inputs whose non-finite entries
are zeroed, which changes no finite entry, and then marks the rows that see
one. The rule, the same on every backend:

- a row whose query, or one of whose *visible* keys, values or depth slots,
  holds a NaN or Inf returns NaN (output and lse) and sends no gradient;
- every other row is computed exactly as if the non-finite entries were not
  there: its output, lse and gradients are those of the clean inputs.

Which rows see what comes from the variant: densely from its predicates
(:func:`rows_seeing_dense`, the reference) or from its structure's spans
(:func:`rows_seeing`, block-sparse backends), in time linear in the lengths.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .variants import Structure


class _ZeroNonFinite(torch.autograd.Function):
    """``x`` with NaN and Inf zeroed, and which vectors held one; the gradient passes through."""

    @staticmethod
    def forward(x: Tensor):
        finite = torch.isfinite(x)
        return torch.where(finite, x, 0), ~finite.all(dim=-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # Nothing is saved: a zeroed entry is seen only by rows marked NaN,
        # and those send no gradient, so passing the gradient through is exact.
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad, _):
        return grad


def zero_nonfinite(x: Tensor) -> tuple[Tensor, Tensor]:
    """Split off the non-finite entries of ``x``.

    Args:
        x: (..., D).

    Returns:
        x with every NaN and Inf replaced by 0, (..., D), differentiable; and
        which vectors held one, (...) bool.
    """
    return _ZeroNonFinite.apply(x)


def rows_seeing(structure: Structure, q_bad: Tensor, key_bad: Tensor, slot_bad: Tensor) -> Tensor:
    """Which rows see a non-finite entry, read off the structure's spans.

    Args:
        structure: exact spans (``structure.keys_contiguous``).
        q_bad: (B, Hq, Tq) the query holds one.
        key_bad: (B, Hk, Tk) key or value ``j`` holds one.
        slot_bad: (B, Hk, Tq, L) depth key or value ``(t, l)`` holds one.

    Returns:
        (B, Hq, Tq) bool.
    """
    B, Hq, Tq = q_bad.shape
    Hk, Tk, L = key_bad.shape[1], key_bad.shape[2], slot_bad.shape[3]
    lo, hi = structure.key_spans(Tq, Tk, q_bad.device)  # (Bd, Tq)
    seen = _any_in_spans(key_bad, lo.unsqueeze(1), hi.unsqueeze(1))  # (B, Hk, Tq)
    d_lo, d_hi, slot_lo = structure.depth_spans(Tq, Tk, L, q_bad.device)  # (Tq,), (Tq,), int
    token_bad = slot_bad[..., slot_lo:].any(dim=-1)  # (B, Hk, Tq): a visible slot of token t
    seen = seen | _any_in_spans(token_bad, d_lo, d_hi)
    return q_bad | seen.repeat_interleave(Hq // Hk, dim=1)


def _any_in_spans(bad: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """Whether ``bad[..., lo:hi + 1]`` holds a True, per span.

    Args:
        bad: (B, H, N) bool.
        lo, hi: spans broadcastable to (B, H, T), ``0 <= lo <= N``, ``-1 <= hi < N``.

    Returns:
        (B, H, T) bool.
    """
    B, H, _ = bad.shape
    T = lo.shape[-1]
    before = F.pad(bad.long().cumsum(dim=-1), (1, 0))  # (B, H, N + 1): True entries before each index
    lo, hi = lo.expand(B, H, T), hi.expand(B, H, T)
    return before.gather(-1, hi + 1) > before.gather(-1, lo)


def rows_seeing_dense(
    seq_visible: Tensor, depth_visible: Tensor, q_bad: Tensor, key_bad: Tensor, slot_bad: Tensor, own_depth: bool
) -> Tensor:
    """Which rows see a non-finite entry, from dense visibility masks.

    Args:
        seq_visible: (B, Hq, Tq, Tk) bool.
        depth_visible: (B, Hq, Tq, L) bool when ``own_depth`` (column ``l``
            is the row's own slot ``l``), else (B, Hq, Tq, Tq * L) over
            (token, slot).
        q_bad, key_bad, slot_bad: as for :func:`rows_seeing`.

    Returns:
        (B, Hq, Tq) bool.
    """
    B, Hq, Tq = q_bad.shape
    G = Hq // key_bad.shape[1]
    key_bad = key_bad.repeat_interleave(G, dim=1).unsqueeze(2)  # (B, Hq, 1, Tk)
    slot_bad = slot_bad.repeat_interleave(G, dim=1)  # (B, Hq, Tq, L)
    if not own_depth:
        slot_bad = slot_bad.reshape(B, Hq, 1, -1)  # (B, Hq, 1, Tq*L)
    return q_bad | (seq_visible & key_bad).any(dim=-1) | (depth_visible & slot_bad).any(dim=-1)


def mark_rows(out: Tensor, lse: Optional[Tensor], rows: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """NaN in the ``rows`` (B, Hq, Tq) of out (B, Hq, Tq, D) and lse (B, Hq, Tq, or None); no gradient flows there."""
    out = torch.where(rows.unsqueeze(-1), float("nan"), out)
    return out, None if lse is None else torch.where(rows, float("nan"), lse)
