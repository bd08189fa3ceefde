"""The flex backend's call: MoDA through FlexAttention, in one of two designs.

A call without depth (L = 0) is FlexAttention as it is called, the sequence
part below alone, in either design. With depth:

- ``"split"``: the sequence part through one ``flex_attention``
  over the plain (B, Hq, Tq, D) queries with the variant's sequence predicate
  and ``enable_gqa``, as FlexAttention itself is called; the depth part on
  its own, merged through the two log-sum-exps (:func:`_merge`). A variant
  whose queries read only their own token's depth (every built-in but
  ``chunk_depth``) gets its depth logits as batched (G, D) x (D, L) products
  per token; any other, a second ``flex_attention`` over folded rows and the
  chunk-packed depth columns with the depth predicate.
- ``"concat"`` (the default, :data:`DESIGN`): one ``flex_attention`` over folded rows and
  ``[sequence | chunk-packed depth]`` columns, the expression the paper draws
  (:mod:`moda_flex.backends.flex`).

Either way a variant is its two predicates (the masks are
:mod:`.block_mask`'s), a score applies to sequence and depth alike, and on
CUDA the whole call is one compiled graph whose lengths are inputs, so one
compiled kernel serves every length.

A variant's score function (:mod:`moda_flex.scores`) becomes FlexAttention's
``score_mod`` over each call's layout: a row is read back as (query head,
token) and a column as a key position or a (token, slot) depth entry, by the
mask's decoding (:func:`.block_mask.folded_query`,
:func:`.block_mask.depth_entry`); the tensors the score reads (learned
biases) go in as FlexAttention's score buffers, so their gradients come back
on the eager path too. The depth products apply it to their logits directly.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ...variants import Variant
from .block_mask import Layout, moda_block_mask
from .compiled import Kind
from .compiled import call as compiled_call
from .run import run_flex
from . import scoring
from .scoring import copies_of, probe_score, reads_by_index, score_mod, spread

DESIGNS = ("split", "concat")
# What backend="flex" runs with depth. At L=64 on an H100 (docs/flex-speed.md) "concat" took 0.80x the time of
# "split" at T=1024, "split" 0.92-0.94x from T=4096: close, and the fewer kernels decide.
DESIGN = "concat"


def flex_attention_backend(
    q: Tensor, k: Tensor, v: Tensor, depth_k: Tensor, depth_v: Tensor, variant: Variant, scale: float
) -> tuple[Tensor, Tensor]:
    """MoDA through FlexAttention: compiled (never eagerly, :mod:`.compiled`), but on CPU, where it runs eagerly.

    Args and returns as :func:`moda_flex.backends.reference.reference_attention`.
    Supports first derivatives only.
    """
    if q.device.type == "cpu":
        return _eager_flex_moda(q, k, v, depth_k, depth_v, variant, scale)
    return flex_moda(q, k, v, depth_k, depth_v, variant, scale, compiled=True)


# Inductor compiles FlexAttention on CPU for inference only and without the
# lse, so a compiled model runs this backend eagerly there, through a graph
# break; fullgraph=True stops here with this reason.
@torch.compiler.disable(
    reason="moda_flex backend 'flex' runs FlexAttention eagerly on CPU (inductor compiles it there for "
    "inference only, without the lse); under torch.compile(fullgraph=True) on CPU use backend='auto' or "
    "'reference', which compile, training included"
)
def _eager_flex_moda(q, k, v, depth_k, depth_v, variant, scale):
    return flex_moda(q, k, v, depth_k, depth_v, variant, scale, compiled=False)


class _Plan(NamedTuple):
    """What a call runs, settled before its tensors are touched (the compiled graph reads it as constants).

    ``parts``: the :data:`~.block_mask.PARTS` computed by FlexAttention, in
    the order of the call's block masks, and ``"products"`` for the depth by
    batched products; ``score_mods``: one per FlexAttention part (None
    without a score); ``copies``: how many stacked copies of each score
    tensor the FlexAttention parts read (:func:`.scoring.spread`).
    """

    parts: tuple
    score_mods: tuple
    copies: tuple
    return_lse: bool
    kernel_options: Optional[dict]


def flex_moda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Tensor,
    depth_v: Tensor,
    variant: Variant,
    scale: float,
    *,
    compiled: Union[bool, str],
    return_lse: bool = True,
    spread_grads: Optional[bool] = None,
    design: Optional[str] = None,
):
    """Like :func:`flex_attention_backend`, choosing the design and eager or compiled FlexAttention.

    ``compiled``: False runs eagerly; True compiles the call with inductor (a
    call inside a compiled model is traced into the model's graph instead);
    a string compiles with that ``torch.compile`` backend (``"aot_eager"``
    in tests). Compiled FlexAttention on CPU runs inference only, without
    the lse: there, call the ``"concat"`` design (or a call without depth)
    with ``return_lse=False``. ``spread_grads`` (default: whether compiled)
    reads a score's learning tensors through stacked copies (see
    :func:`.scoring.spread`). ``design``: one of :data:`DESIGNS`, default
    :data:`DESIGN`.

    Args:
        q: (B, Hq, Tq, D); k, v: (B, Hk, Tk, D); depth_k, depth_v: (B, Hk, Tq, L, D).

    Returns:
        out (B, Hq, Tq, D), and lse (B, Hq, Tq) float32 if ``return_lse``.
    """
    design = DESIGN if design is None else design
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    B, Hq, Tq, D = q.shape
    Hk, Tk, L = k.shape[1], k.shape[2], depth_k.shape[3]
    G = Hq // Hk
    if L == 0:  # nothing to concatenate or fold: FlexAttention as it is called without depth
        parts = ("sequence",)
    elif design == "concat":
        parts = ("concat",)
    else:
        parts = ("sequence", "products" if variant.own_depth_only else "depth")
    flex_parts = [part for part in parts if part != "products"]
    masks = tuple(
        moda_block_mask(variant, batch=B, kv_heads=Hq if part == "sequence" else Hk, q_len=Tq, kv_len=Tk,
                        groups=G, slots=L, device=q.device, part=part)
        for part in flex_parts
    )  # fmt: skip

    params, copies, score_mods = (), (), (None,) * len(flex_parts)
    if variant.score is not None:
        # Check the params against this call, and the function on a grid of logits,
        # here: inside FlexAttention's tracing an error would lose its message.
        probe_score(variant.score.bind(Hq, L), q.device)
        params = variant.score.params
        spread = bool(compiled) if spread_grads is None else spread_grads
        copies = tuple(copies_of(p) if spread else 1 for p in params)
        if max(copies, default=1) > 1 and not reads_by_index(variant, Hq, L):
            copies = (1,) * len(params)
        score_mods = tuple(
            score_mod(variant, Layout.of(part, Tq, Tk, G, L), q_heads=Hq, slots=L, copies=copies, device=q.device)
            for part in flex_parts
        )
    learns = any(p.requires_grad for p in params) and torch.is_grad_enabled()
    plan = _Plan(
        parts=parts,
        score_mods=score_mods,
        copies=copies,
        return_lse=return_lse,
        kernel_options=dict(scoring.LEARNED_SCORE_KERNEL_OPTIONS) if learns and q.is_cuda and compiled else None,
    )
    args = (q, k, v, depth_k, depth_v, tuple(params), masks, variant, scale, plan)
    if not compiled or torch.compiler.is_compiling():  # inside a compiled model the model's graph holds the call
        out, lse = _moda_core(*args)
    else:
        kind = Kind(q.dtype, D, G, variant.name, None if variant.score is None else variant.score.name, parts,
                    return_lse, learns)  # fmt: skip
        out, lse = compiled_call(_moda_core, kind, "inductor" if compiled is True else compiled, *args)
    return (out, lse) if return_lse else out


def _moda_core(q, k, v, depth_k, depth_v, params: tuple, masks: tuple, variant: Variant, scale: float, plan: _Plan):
    """The call on its tensors: run the plan's parts, merge them, unfold the rows.

    Args:
        q: (B, Hq, Tq, D); k, v: (B, Hk, Tk, D); depth_k, depth_v: (B, Hk, Tq, L, D).
        params: the score's tensors; masks: one BlockMask per FlexAttention part.

    Returns:
        out (B, Hq, Tq, D), and lse (B, Hq, Tq) float32, or None unless ``plan.return_lse``.
    """
    B, Hq, Tq, D = q.shape
    Hk = k.shape[1]
    q, k, v, depth_k, depth_v, *params = _FirstOrderOnly.apply(q, k, v, depth_k, depth_v, *params)
    # An empty tensor (a depth bias when L = 0) has no gradient to compute, and
    # the eager op fails on a buffer that requires grad yet is never read.
    params = [p.detach() if p.numel() == 0 else p for p in params]
    buffers = tuple(spread(p, n) for p, n in zip(params, plan.copies))

    def run(part, i, query, key, value, need_lse):
        return run_flex(query, key, value, masks[i], scale, plan.score_mods[i], buffers, need_lse=need_lse,
                         enable_gqa=part == "sequence", kernel_options=plan.kernel_options)  # fmt: skip

    if plan.parts == ("concat",):
        rows = _fold(q, Hk)  # (B, Hk, Tq*G, D)
        pad = masks[0].seq_lengths[1] - depth_k.shape[2] * depth_k.shape[3] - k.shape[2]
        keys = _concat(k, pad, depth_k)  # (B, Hk, seq_cols + Tq*L, D)
        values = _concat(v, pad, depth_v)
        out, lse = run("concat", 0, rows, keys, values, plan.return_lse)
        out, lse = _unfold(out, lse, Hq)
    else:
        need_lse = plan.return_lse or len(plan.parts) > 1
        out, lse = run("sequence", 0, q, k, v, need_lse)  # (B, Hq, Tq, D), (B, Hq, Tq)
        if "products" in plan.parts:
            score = None if variant.score is None else variant.score.bind(Hq, depth_k.shape[3], params)
            out_d, lse_d = _depth_by_products(q, depth_k, depth_v, variant, scale, k.shape[2], score)
            out, lse = _merge(out, lse, out_d, lse_d)
        elif "depth" in plan.parts:
            keys, values = (t.reshape(B, Hk, -1, D) for t in (depth_k, depth_v))  # (B, Hk, Tq*L, D)
            out_d, lse_d = _unfold(*run("depth", 1, _fold(q, Hk), keys, values, True), Hq)
            out, lse = _merge(out, lse, out_d, lse_d)
    return out, None if lse is None else lse.float()


def _fold(q: Tensor, kv_heads: int) -> Tensor:
    """(B, Hq, Tq, D) -> (B, Hk, Tq*G, D): the G query heads of each group folded into rows, row r = t * G + g."""
    B, Hq, Tq, D = q.shape
    G = Hq // kv_heads
    return q.view(B, kv_heads, G, Tq, D).transpose(2, 3).reshape(B, kv_heads, Tq * G, D)


def _unfold(out: Tensor, lse: Optional[Tensor], q_heads: int):
    """Folded (B, Hk, Tq*G, D) and (B, Hk, Tq*G) back to (B, Hq, Tq, D) and (B, Hq, Tq); lse may be None."""
    B, Hk, rows, D = out.shape
    G = q_heads // Hk
    Tq = rows // G
    out = out.view(B, Hk, Tq, G, D).transpose(2, 3).reshape(B, q_heads, Tq, D)
    if lse is not None:
        lse = lse.view(B, Hk, Tq, G).transpose(2, 3).reshape(B, q_heads, Tq)
    return out, lse


def _concat(seq: Tensor, pad: int, depth: Tensor) -> Tensor:
    """``[seq | pad zeros | depth]`` columns: (B, Hk, Tk, D), ``pad``, (B, Hk, Tq, L, D) -> (B, Hk, Tk + pad + Tq*L, D)."""
    B, Hk, Tq, L, D = depth.shape
    # Padded, not concatenated with a zeros tensor: near a block boundary that tensor
    # would hold 1 or 0 rows, sizes dynamo specializes, so each would compile a graph.
    return torch.cat([F.pad(seq, (0, 0, 0, pad)), depth.reshape(B, Hk, Tq * L, D)], dim=2)


def _depth_by_products(
    q: Tensor, depth_k: Tensor, depth_v: Tensor, variant: Variant, scale: float, kv_len: int, score
) -> tuple[Tensor, Tensor]:
    """Each query over its own token's L depth slots: batched (G, D) x (D, L) products per (batch, KV head, token).

    For variants whose queries read only their own token's depth. Computed in
    float32 (float64 for float64 inputs), the logits of a depth slot as
    FlexAttention computes them; the score sees them as the reference does,
    with (B, Hk, Tq, G, L)-broadcastable indices.

    Args:
        q: (B, Hq, Tq, D); depth_k, depth_v: (B, Hk, Tq, L, D), L >= 1.
        kv_len: Tk, which places query token 0 at position ``Tk - Tq``.
        score: the variant's score function bound to this call, or None.

    Returns:
        out (B, Hq, Tq, D) and lse (B, Hq, Tq), in the compute dtype; a row
        that sees no slot gives zeros and ``lse = -inf``.
    """
    B, Hq, Tq, D = q.shape
    Hk, L = depth_k.shape[1], depth_k.shape[3]
    G = Hq // Hk
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = q.view(B, Hk, G, Tq, D).transpose(2, 3).to(dtype)  # (B, Hk, Tq, G, D)
    logits = scale * (rows @ depth_k.to(dtype).transpose(-1, -2))  # (B, Hk, Tq, G, L)
    device = q.device
    b = torch.arange(B, device=device).view(B, 1, 1, 1, 1)
    h = (torch.arange(Hk, device=device).view(1, Hk, 1, 1, 1) * G + torch.arange(G, device=device).view(1, 1, 1, G, 1))
    q_pos = (kv_len - Tq + torch.arange(Tq, device=device)).view(1, 1, Tq, 1, 1)
    slot = torch.arange(L, device=device).view(1, 1, 1, 1, L)
    if score is not None:
        logits = score(logits, b, h, q_pos, q_pos, slot, torch.ones_like(slot, dtype=torch.bool))
    visible = variant.depth_predicate(L)(b, h, q_pos, q_pos, slot)
    logits = logits.masked_fill(~visible, float("-inf"))
    # Softmax that gives zeros (not NaN) for a row with no visible slot, in
    # value and gradient: shift by a detached finite max, divide by a safe sum.
    row_max = logits.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(logits - row_max)  # (B, Hk, Tq, G, L)
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(total > 0, total, torch.ones_like(total))
    out = probs @ depth_v.to(dtype)  # (B, Hk, Tq, G, D)
    lse = (row_max + torch.log(total)).squeeze(-1)  # (B, Hk, Tq, G); log(0) = -inf
    return out.transpose(2, 3).reshape(B, Hq, Tq, D), lse.transpose(2, 3).reshape(B, Hq, Tq)


def _merge(out_s: Tensor, lse_s: Tensor, out_d: Tensor, lse_d: Tensor) -> tuple[Tensor, Tensor]:
    """One softmax over both parts from each part's own: ``lse = logaddexp(lse_s, lse_d)``, outputs weighted.

    ``out = out_s * exp(lse_s - lse) + out_d * exp(lse_d - lse)``, computed
    in the depth part's dtype; gradients flow through both lse's. A row that
    sees nothing in either part gives zeros and ``-inf`` (no NaN, in value or
    gradient).

    Args:
        out_s, out_d: (B, Hq, Tq, D); lse_s, lse_d: (B, Hq, Tq).

    Returns:
        out (B, Hq, Tq, D) in ``out_s``'s dtype and lse (B, Hq, Tq) in ``out_d``'s.
    """
    dtype = out_d.dtype
    lse_s = lse_s.to(dtype)
    shift = torch.maximum(lse_s, lse_d).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    w_s, w_d = torch.exp(lse_s - shift), torch.exp(lse_d - shift)  # (B, Hq, Tq)
    total = w_s + w_d
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_s.to(dtype) * w_s.unsqueeze(-1) + out_d * w_d.unsqueeze(-1)) / safe.unsqueeze(-1)
    lse = torch.where(total > 0, shift + torch.log(safe), torch.full_like(safe, float("-inf")))
    return out.to(out_s.dtype), lse


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on FlexAttention's inputs that refuses a backward pass building a graph.

    FlexAttention's gradients are not differentiable: under ``create_graph=True``
    they would come back without a graph and second derivatives would be
    silently missing.
    """

    @staticmethod
    def forward(ctx, *tensors: Tensor) -> tuple:
        # ctx in forward, not a setup_context: Dynamo mistakes a ctx-less
        # forward(*tensors) for one whose first argument is the context.
        outs = tuple(t.view_as(t) for t in tensors)
        # A Function's outputs all require grad when one input does; a fixed score
        # tensor must not, or FlexAttention computes (and the copies spread) its gradient.
        ctx.mark_non_differentiable(*(o for o, needed in zip(outs, ctx.needs_input_grad) if not needed))
        return outs

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        # Grad mode is on in a backward pass exactly under create_graph=True.
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "backend 'flex' has no second derivative (backward with create_graph=True, e.g. a gradient "
                "penalty): use backend='reference', which has one"
            )
        return grads

