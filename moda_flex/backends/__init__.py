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

import torch.nn.functional as F
from torch import Tensor

from ..variants import Variant
from .first_order import explain_sdpa
from .reference import reference_attention

NAMES = ("auto", "reference", "flex", "triton", "split")
# From this many logits the split path is the faster however the step runs (H100, BENCHMARKS.md "The split path":
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
