"""MoDA in plain PyTorch: the specification every fast backend is checked against.

Read beside the paper's equations. For query head ``h`` (KV head ``h // G``)
and query token ``i`` at absolute position ``p = Tk - Tq + i``::

    s_j      = scale * q_i . k_j           for sequence keys j the variant allows
    s_(d,l)  = scale * q_i . K_depth[d, l] for depth slots (d, l) the variant allows
    o_i      = softmax([s_j | s_(d,l)]) @ [v_j | V_depth[d, l]]     (one softmax)

A variant's score function (:mod:`moda_flex.scores`) changes every logit
before the mask and the softmax.

Vectorized over every axis (no Python loop over tokens), float64-capable.
When a variant reads only each token's own depth (all built-ins but
``chunk_depth``), the depth logits are the compact (Tq, L) products; otherwise
the depth predicate is evaluated densely over every (token, slot) pair.

Non-finite inputs carry SDPA's promise, no more: a masked entry gets a zero
weight, and ``0 * NaN`` is NaN.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from ..variants import Variant, resolve


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, depth_k: Tensor, depth_v: Tensor, variant: Variant, scale: float
) -> tuple[Tensor, Tensor]:
    """MoDA by the definition.

    Args:
        q: (B, Hq, Tq, D).
        k, v: (B, Hk, Tk, D).
        depth_k, depth_v: (B, Hk, Tq, L, D), any strides; L may be 0.
        variant: the mask pair.
        scale: logit scale.

    Returns:
        out (B, Hq, Tq, D) in q's dtype, and lse (B, Hq, Tq) float32 (natural
        log; ``-inf`` and a zero output for a row that sees no key).
    """
    out, _, lse = _attention(q, k, v, depth_k, depth_v, variant, scale)
    return out.to(q.dtype), lse.float()


def attention_probabilities(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Optional[Tensor] = None,
    depth_v: Optional[Tensor] = None,
    variant: Union[str, Variant] = "causal",
    scale: Optional[float] = None,
) -> Tensor:
    """The attention weights over ``[sequence | depth]``, for pictures.

    Arguments as :func:`moda_flex.moda_attention`, with its defaults: no depth
    (L = 0), ``variant="causal"``, ``scale = 1 / sqrt(D)``; depth as one
    (B, Hk, Tq, L, D) tensor.

    Returns:
        (B, Hq, Tq, Tk + L) when the variant reads only each token's own depth
        (column ``Tk + l`` is the query's own slot ``l``), else
        (B, Hq, Tq, Tk + Tq * L) with depth columns ordered (token, slot).
        Computed in float32 (float64 for float64 inputs).
    """
    if depth_k is None or depth_v is None:
        depth_k = depth_v = k.new_empty(*k.shape[:2], q.shape[2], 0, k.shape[3])  # (B, Hk, Tq, 0, D)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    _, probs, _ = _attention(q, k, v, depth_k, depth_v, resolve(variant), scale)
    return probs


def visible_entries(
    variant: Variant, batch: int, q_heads: int, q_len: int, kv_len: int, slots: int, device
) -> tuple[Tensor, Tensor]:
    """Which sequence keys and depth slots each row sees, by the variant's predicates.

    Returns:
        (B, Hq, Tq, Tk) bool over sequence keys; over depth slots (B, Hq, Tq, L)
        when the variant reads only each token's own depth (column ``l`` is the
        row's own slot ``l``), else (B, Hq, Tq, Tq * L) over (token, slot).
    """
    B, Hq, Tq, Tk, L = batch, q_heads, q_len, kv_len, slots
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(Hq, device=device).view(1, Hq, 1, 1)
    q_pos = (Tk - Tq + torch.arange(Tq, device=device)).view(1, 1, Tq, 1)
    k_pos = torch.arange(Tk, device=device).view(1, 1, 1, Tk)
    slot = torch.arange(L, device=device)
    depth_allowed = variant.depth_predicate(L)
    seq_visible = variant.sequence(b, h, q_pos, k_pos).expand(B, Hq, Tq, Tk)
    if variant.own_depth_only:
        depth_visible = depth_allowed(b, h, q_pos, q_pos, slot.view(1, 1, 1, L)).expand(B, Hq, Tq, L)
    else:
        # Every token's depth slots, flattened (token, slot) -> token * L + slot.
        d_pos = (Tk - Tq + torch.arange(Tq, device=device)).repeat_interleave(L).view(1, 1, 1, Tq * L)
        depth_visible = depth_allowed(b, h, q_pos, d_pos, slot.repeat(Tq).view(1, 1, 1, Tq * L))
        depth_visible = depth_visible.expand(B, Hq, Tq, Tq * L)
    return seq_visible, depth_visible


def _apply_score(variant: Variant, logits: Tensor, kv_len: int, slots: int) -> Tensor:
    """The variant's score function on (B, Hq, Tq, N) logits, columns ``[sequence | depth]`` as built above."""
    B, Hq, Tq, N = logits.shape
    Tk, L, device = kv_len, slots, logits.device
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(Hq, device=device).view(1, Hq, 1, 1)
    q_pos = (Tk - Tq + torch.arange(Tq, device=device)).view(1, 1, Tq, 1)
    k_pos = torch.arange(Tk, device=device).view(1, 1, 1, Tk)
    if variant.own_depth_only:
        # Column Tk + l is the row's own slot l, written for its own token.
        d_pos = q_pos.expand(1, 1, Tq, L)
        d_slot = torch.arange(L, device=device).view(1, 1, 1, L)
    else:
        # Column Tk + t * L + l is token t's slot l.
        d_pos = (Tk - Tq + torch.arange(Tq, device=device)).repeat_interleave(L).view(1, 1, 1, Tq * L)
        d_slot = torch.arange(L, device=device).repeat(Tq).view(1, 1, 1, Tq * L)
    pos = torch.cat([k_pos.expand(1, 1, Tq, Tk), d_pos.expand(1, 1, Tq, -1)], dim=-1)  # (1, 1, Tq, N)
    slot = torch.cat([torch.zeros_like(k_pos), d_slot], dim=-1)  # (1, 1, 1, N); 0 for sequence keys
    is_depth = (torch.arange(N, device=device) >= Tk).view(1, 1, 1, N)
    score = variant.score.bind(Hq, L)
    return score(logits, b, h, q_pos, pos, slot, is_depth)


def _attention(q, k, v, depth_k, depth_v, variant: Variant, scale: float):
    """out (B, Hq, Tq, D), probabilities (B, Hq, Tq, N) and lse (B, Hq, Tq), in the compute dtype."""
    B, Hq, Tq, D = q.shape
    Hk, Tk, L = k.shape[1], k.shape[2], depth_k.shape[3]
    G = Hq // Hk
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, depth_k, depth_v = (t.to(compute_dtype) for t in (q, k, v, depth_k, depth_v))
    # Query head h reads KV head h // G: repeat each KV head G times.
    k = k.repeat_interleave(G, dim=1)  # (B, Hq, Tk, D)
    v = v.repeat_interleave(G, dim=1)  # (B, Hq, Tk, D)
    depth_k = depth_k.repeat_interleave(G, dim=1)  # (B, Hq, Tq, L, D)
    depth_v = depth_v.repeat_interleave(G, dim=1)  # (B, Hq, Tq, L, D)
    seq_visible, depth_visible = visible_entries(variant, B, Hq, Tq, Tk, L, q.device)

    seq_logits = scale * q @ k.transpose(-1, -2)  # (B, Hq, Tq, Tk)
    if variant.own_depth_only:
        # Token i's own depth slots: a (Tq, L) block of logits.
        depth_logits = scale * torch.einsum("bhtd,bhtld->bhtl", q, depth_k)  # (B, Hq, Tq, L)
    else:
        # Every token's depth slots, flattened (token, slot) -> token * L + slot.
        depth_k = depth_k.reshape(B, Hq, Tq * L, D)
        depth_v = depth_v.reshape(B, Hq, Tq * L, D)
        depth_logits = scale * q @ depth_k.transpose(-1, -2)  # (B, Hq, Tq, Tq*L)

    logits = torch.cat([seq_logits, depth_logits], dim=-1)  # (B, Hq, Tq, N)
    if variant.score is not None:
        logits = _apply_score(variant, logits, Tk, L)
    visible = torch.cat([seq_visible, depth_visible], dim=-1)
    logits = logits.masked_fill(~visible, float("-inf"))

    # Softmax that gives zeros (not NaN) for a row with no visible key, in
    # value and gradient: shift by a detached finite max, divide by a safe sum.
    if logits.shape[-1] > 0:
        row_max = logits.amax(dim=-1, keepdim=True).detach()
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    else:  # Tk = L = 0 (so Tq = 0): nothing to reduce
        row_max = logits.new_zeros(*logits.shape[:-1], 1)
    weights = torch.exp(logits - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(total > 0, total, torch.ones_like(total))
    lse = (row_max + torch.log(total)).squeeze(-1)  # log(0) = -inf for empty rows

    seq_probs, depth_probs = probs.split([Tk, probs.shape[-1] - Tk], dim=-1)
    out = seq_probs @ v  # (B, Hq, Tq, D)
    if variant.own_depth_only:
        out = out + torch.einsum("bhtl,bhtld->bhtd", depth_probs, depth_v)
    else:
        out = out + depth_probs @ depth_v
    return out, probs, lse
