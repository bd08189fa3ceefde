"""The backends, and the one policy that picks among them for ``backend="auto"``.

A backend is a function ``(q, k, v, depth_k, depth_v, variant, scale) -> (out, lse)``
that runs a call :func:`moda_flex.moda_attention` has already checked:

    reference   backends/reference.py   the definition in plain PyTorch: any device, float64, second derivatives
    flex        backends/flex/          one FlexAttention call over [sequence | depth]: any variant
    triton      backends/triton/        the fused kernels: CUDA (CPU under TRITON_INTERPRET=1), structured variants
    split       backends/split/         the sequence part on SDPA's cuDNN / FlashAttention op, the depth part
                                        on our kernel, merged through the lse: causal or full, fp16 / bf16
    capture     backends/capture.py     auto's for a call both of those run: triton, or split while a CUDA
                                        graph is captured (chosen at launch; not a name to ask for)

The kernel backends in layers, each importing only those below it:

    kernels   triton/kernels/, split/kernels.py     ``@triton.jit`` only; slot_pointers.py decodes depth slots
    launch    launch.py, flat.py, triton/launch.py  one launcher, one way to hand depth to a kernel; the fused
                                                    kernels' grids and configurations (the split path's sit
                                                    in split/ops.py, beside its ops)
    ops       triton/ops.py, split/ops.py,          ``torch.library`` ops from records.py's records: schema,
              capture.py                            fake, autograd, eager and traced bodies
    policy    this module                           which backend runs a call

``auto``, the same for a direct call and for the layers of :mod:`moda_flex.nn`,
takes the first that applies:

1. no depth entry, no score, a causal mask with ``Tq == Tk`` or a full one,
   and no lse asked for: PyTorch's ``scaled_dot_product_attention``, which
   computes exactly that call (a baseline model, a MoDA model's first layer).
   It gives a masked key a zero weight, and ``0 * NaN = NaN``: a NaN or Inf
   in a later token's key or value reaches the earlier rows here;
2. on CUDA: ``split`` where the vendor's kernel computes the sequence part
   exactly (:func:`moda_flex.backends.split.unsupported_reason`) and the
   call has at least ``SPLIT_MIN_SCORES`` logits (``B * Hq * Tq * Tk``);
   below that, where both run it, ``capture``: the fused kernel, except while
   a CUDA graph is captured, where the split path is the faster
   (:mod:`moda_flex.backends.capture`; compiled with static shapes, chosen
   when inductor compiles the graph: the fused kernels launched by the graph
   itself, unless it runs as a CUDA graph); else ``triton`` where it supports
   the call, else ``split`` where it does, else ``flex``;
3. elsewhere: ``reference`` (on CPU it beats eager FlexAttention).

Whatever the name, a call with no output element (B, Hq or Tq is 0) runs on
``reference``, which gives the empty result with a backward.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..variants import Variant
from .first_order import explain_sdpa
from .reference import reference_attention

NAMES = ("auto", "reference", "flex", "triton", "split")
# From this many logits the split path is the faster however the step runs (H100, docs/speed.md "What `auto` runs":
# from T=4096, 1.07G logits, the fused kernel took 1.4-1.5x its time). Below, at a model's calls (the Table 6 call:
# 5e7), the fused kernel is the faster in a host-bound compiled step, the split path under CUDA graphs (capture.py).
SPLIT_MIN_SCORES = 1 << 28

Backend = Callable[..., tuple[Tensor, Optional[Tensor]]]
# The kernel backends, imported on first use (they need triton), and the function each runs a call with.
KERNELS = {"triton": "triton_attention", "split": "split_attention", "capture": "capture_attention"}


def choose(name: str, q: Tensor, k: Tensor, slots: int, variant: Variant, *, return_lse: bool) -> Backend:
    """The backend that runs a checked call; the triton support check runs here, once.

    Args:
        name: one of :data:`NAMES`.
        q: (B, Hq, Tq, D) queries; k: (B, Hk, Tk, D) keys (only shapes, dtype and device are read).
        slots: L, the depth entries per query token.
        variant: the call's variant, its score included.
        return_lse: whether the caller wants the lse (``scaled_dot_product_attention`` gives none).

    Raises:
        ValueError: for a name not in :data:`NAMES`.
        NotImplementedError: when the backend named cannot run the call, saying why.
    """
    if name not in NAMES:
        raise ValueError(f"backend must be one of {NAMES}, got {name!r}")
    run = _auto(q, k, slots, variant, return_lse) if name == "auto" else _named(name, q, k, variant)
    return reference_attention if q.numel() == 0 else run


def _named(name: str, q: Tensor, k: Tensor, variant: Variant) -> Backend:
    if name == "reference":
        return reference_attention
    if name == "flex":
        return _flex()
    if not _has_triton():
        raise NotImplementedError(
            f"backend {name!r} needs the triton package (pip install 'moda_flex[triton]' on Linux; CUDA builds of "
            "torch bring it); use backend='flex' or 'reference'"
        )
    if name == "split":
        from . import split

        reason = split.unsupported_reason(q, k, variant)
        run = split.split_attention
    else:
        from . import triton

        reason = triton.unsupported_reason(q, variant)
        run = triton.triton_attention
    if reason is not None:
        raise NotImplementedError(
            f"backend {name!r} cannot run this call ({q.dtype} on {q.device}, variant {variant.name!r}): {reason}"
        )
    return run


def _auto(q: Tensor, k: Tensor, slots: int, variant: Variant, return_lse: bool) -> Backend:
    if not return_lse and slots == 0 and _plain(variant, q.shape[2], k.shape[2]):
        return sdpa_attention
    if q.device.type != "cuda":
        return reference_attention
    if _has_triton():
        from . import split, triton

        splits = split.unsupported_reason(q, k, variant) is None
        if splits and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] >= SPLIT_MIN_SCORES:
            return split.split_attention
        if triton.unsupported_reason(q, variant) is None:
            if splits:
                from .capture import capture_attention

                return capture_attention
            return triton.triton_attention
        if splits:
            return split.split_attention
    return _flex()


def _plain(variant: Variant, q_len: int, kv_len: int) -> bool:
    """The variant's sequence mask is one ``scaled_dot_product_attention`` computes: full, or causal at ``Tq == Tk``.

    (SDPA aligns a causal mask top-left, MoDA bottom-right: the two agree only when ``Tq == Tk``.)
    """
    s = variant.structure
    if variant.score is not None or s is None or not s.sequence or s.window is not None or s.documents is not None:
        return False
    return not s.causal or q_len == kv_len


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, depth_k, depth_v, variant: Variant, scale: float):
    """A call :func:`_plain` accepts, with no depth entry, through PyTorch's SDPA.

    Returns:
        out (B, Hq, Tq, D), and None in place of the lse.
    """
    out = F.scaled_dot_product_attention(q, k, v, is_causal=variant.structure.causal, scale=scale, enable_gqa=True)
    explain_sdpa(out)
    return out, None


def kernel_name(run: Backend) -> Optional[str]:
    """Which of :data:`KERNELS` ``run`` is, or None, read from the function's own name and module.

    It neither imports a kernel's module nor asks which are imported: traced,
    such a question becomes one of dynamo's guards, and a kernel backend
    imported later in the same frame (the split path's stream reader imports
    the fused kernels) fails it there.
    """
    module, function = getattr(run, "__module__", None) or "", getattr(run, "__name__", None)
    for name, kernel_function in KERNELS.items():
        package = f"{__name__}.{name}"
        if function == kernel_function and (module == package or module.startswith(package + ".")):
            return name
    return None


def reads_depth_entries(run: Backend) -> bool:
    """Whether ``run`` takes depth given as a sequence of (B, Hk, Tq, D) entries as it is.

    The kernel backends do: they read each entry in place and give each its
    own gradient. For the others :func:`moda_flex.moda_attention` stacks the
    entries into one (B, Hk, Tq, L, D) tensor.
    """
    return kernel_name(run) is not None


def _flex() -> Backend:
    # Imported on first use: FlexAttention is not needed by every program.
    from .flex import flex_attention_backend

    return flex_attention_backend


def _has_triton() -> bool:
    """Whether the triton package is installed (no wheel exists off Linux): the kernel backends need it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# -- one block of longer rows (context parallelism) ----------------------------------------------------------------


def merged_backward(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Optional[Tensor],
    depth_v: Optional[Tensor],
    variant: Variant,
    scale: float,
    *,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    grad_lse: Tensor,
) -> Optional[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]:
    """The gradients of one call whose rows are part of longer rows, given the merged ``out`` and ``lse`` of those rows.

    A row's final weights over this call's entries are ``P = exp(s - lse)``
    with the row's merged ``lse``, so the call's share of the gradients needs
    its own logits ``s`` and nothing of the other calls; the shares sum to
    the gradients of the whole rows. Run by the backend ``choose`` picks for
    the call: the kernels' backwards take a given lse, the reference computes
    FlashAttention's backward in plain PyTorch.

    Args:
        name: the backend asked for, one of :data:`NAMES`.
        q: (B, Hq, Tq, D); k, v: (B, Hk, Tk, D); depth_k, depth_v: (B, Hk, Tq, L, D) or None (L = 0),
            in the dtype the forward computed in.
        variant: the call's variant, without a score; scale: its logit scale.
        out, grad_out: (B, Hq, Tq, D), the merged output of the rows and its gradient; lse, grad_lse:
            (B, Hq, Tq), the merged lse (``-inf``: a row that saw nothing) and its gradient. The
            reference computes in ``out``'s dtype, the kernels in q's with a float32 lse.

    Returns:
        dq (B, Hq, Tq, D), dk, dv (B, Hk, Tk, D), d depth_k, d depth_v (B, Hk, Tq, L, D); or None where
        the backend takes no given lse (flex): there, run the call again and differentiate it.

    Raises:
        NotImplementedError: a variant with a score, or with depth entries it reads for other tokens.
    """
    if depth_k is None or depth_v is None:
        depth_k = depth_v = k.new_empty(*k.shape[:2], q.shape[2], 0, k.shape[3])  # (B, Hk, Tq, 0, D)
    if variant.score is not None:
        raise NotImplementedError(f"merged_backward runs no score function (variant {variant.name!r})")
    run = choose(name, q, k, depth_k.shape[3], variant, return_lse=True)
    if run is reference_attention:
        return _reference_merged_backward(q, k, v, depth_k, depth_v, variant, scale, out, lse, grad_out, grad_lse)
    kernel = kernel_name(run)
    if kernel == "capture":  # the kernel capture_attention launches now: the split one while a graph is captured
        from .capture import kernel_now

        kernel = kernel_now(q.device)
    grad_out, out, grad_lse, lse = grad_out.to(q.dtype), out.to(q.dtype), grad_lse.float(), lse.float()
    if kernel == "split":
        from .split import split_backward

        return split_backward(grad_out=grad_out, grad_lse=grad_lse, q=q, k=k, v=v, depth_k=depth_k, depth_v=depth_v,
                              out=out, lse=lse, variant=variant, scale=scale)  # fmt: skip
    if kernel == "triton":
        from .triton import merged_backward as fused_merged_backward

        return fused_merged_backward(grad_out=grad_out, grad_lse=grad_lse, q=q, k=k, v=v, depth_k=depth_k,
                                     depth_v=depth_v, out=out, lse=lse, variant=variant, scale=scale)  # fmt: skip
    return None


def _reference_merged_backward(q, k, v, depth_k, depth_v, variant, scale, out, lse, grad_out, grad_lse):
    """:func:`merged_backward` in plain PyTorch, in ``out``'s dtype::

        delta = rowsum(dO * out) - dlse
        dV = P^T dO        dS = P * (dO V^T - delta)        dQ = scale dS K        dK = scale dS^T Q

    and the same over the depth slots, more columns of the same ``P``. Query
    head ``h`` reads KV head ``h // G``: the rows are grouped as
    (B, Hk, G * Tq, D) against (B, Hk, Tk, D), so no K/V is repeated.
    """
    from .reference import visible_entries

    dtype = out.dtype
    q, k, v, depth_k, depth_v = (t.to(dtype) for t in (q, k, v, depth_k, depth_v))
    B, Hq, R, D = q.shape
    Hk, Tk, L = k.shape[1], k.shape[2], depth_k.shape[3]
    G = Hq // Hk
    if L and not variant.own_depth_only:
        raise NotImplementedError(f"merged_backward reads each token's own depth only (variant {variant.name!r})")
    delta = (grad_out * out).sum(-1) - grad_lse  # (B, Hq, R)
    # A row that saw nothing (lse = -inf) sends no gradient.
    live = (lse > float("-inf")).unsqueeze(-1)  # (B, Hq, R, 1)
    seq_visible, depth_visible = visible_entries(variant, B, Hq, R, Tk, L, q.device)

    def grouped(x: Tensor) -> Tensor:  # (B, Hq, R, N) -> (B, Hk, G * R, N)
        return x.reshape(B, Hk, G * R, x.shape[-1])

    def weights(logits: Tensor, visible: Tensor) -> Tensor:  # P = exp(s - lse) where visible, (B, Hq, R, N)
        return torch.where(visible & live, torch.exp(logits - lse.unsqueeze(-1)), 0)

    s = scale * grouped(q) @ k.transpose(-1, -2)  # (B, Hk, G * R, Tk)
    p = weights(s.view(B, Hq, R, Tk), seq_visible)  # (B, Hq, R, Tk)
    dp = (grouped(grad_out) @ v.transpose(-1, -2)).view(B, Hq, R, Tk)
    ds = grouped(p * (dp - delta.unsqueeze(-1)))  # (B, Hk, G * R, Tk)
    dq = (scale * ds @ k).view(B, Hq, R, D)
    dk = scale * ds.transpose(-1, -2) @ grouped(q)  # (B, Hk, Tk, D)
    dv = grouped(p).transpose(-1, -2) @ grouped(grad_out)
    q5, grad_out5 = q.reshape(B, Hk, G, R, D), grad_out.reshape(B, Hk, G, R, D)
    sd = scale * torch.einsum("bkgrd,bkrld->bkgrl", q5, depth_k)  # (B, Hk, G, R, L)
    pd = weights(sd.reshape(B, Hq, R, L), depth_visible).view(B, Hk, G, R, L)
    dpd = torch.einsum("bkgrd,bkrld->bkgrl", grad_out5, depth_v)
    dsd = pd * (dpd - delta.reshape(B, Hk, G, R, 1))
    dq = dq + scale * torch.einsum("bkgrl,bkrld->bkgrd", dsd, depth_k).reshape(B, Hq, R, D)
    d_depth_k = scale * torch.einsum("bkgrl,bkgrd->bkrld", dsd, q5)
    d_depth_v = torch.einsum("bkgrl,bkgrd->bkrld", pd, grad_out5)
    return dq, dk, dv, d_depth_k, d_depth_v
