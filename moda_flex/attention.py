"""The public entry point: check the contract, then hand over to a backend."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Sequence
from typing import Optional, Union

import torch
from torch import Tensor

from . import backends
from .depth import DepthKV, as_tensor, is_entries, slot_count
from .scores import Score
from .variants import Variant, resolve


def moda_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Optional[DepthKV] = None,
    depth_v: Optional[DepthKV] = None,
    *,
    variant: Union[str, Variant] = "causal",
    score: Optional[Score] = None,
    scale: Optional[float] = None,
    backend: str = "auto",
    return_lse: bool = False,
):
    """Mixture-of-depths attention: one softmax over sequence keys and the token's depth keys.

    ``o_i = softmax(scale * q_i [K_seq | K_depth(i)]^T) [V_seq | V_depth(i)]``

    What query token ``t`` (head ``h``, KV head ``h // G``) sees, causal::

        sequence keys  0 1 2 ... t  t+1 ... Tk-1 | depth slots of token t: 0 1 ... L-1
                       x x x ... x   .  ...  .   |                          x x ... x

    Args:
        q: (B, Hq, Tq, D) queries.
        k, v: (B, Hk, Tk, D) sequence keys and values, ``Hq % Hk == 0``,
            ``G = Hq // Hk``, ``Tq <= Tk``; query ``i`` sits at absolute
            position ``Tk - Tq + i`` (bottom-right aligned), so prefill,
            chunked prefill and one-token decode are the same call.
        depth_k, depth_v: (B, Hk, Tq, L, D), or a sequence of L entries
            (B, Hk, Tq, D) (slot ``l`` is entry ``l``), or None (L = 0): the
            depth keys/values that earlier layers wrote for each query token.
            Any strides; the kernel backends (triton, split:
            :func:`moda_flex.backends.reads_depth_entries`) read both forms in
            place, and give each entry of a sequence its own gradient.
        variant: ``"causal"``, ``"full"`` or a :class:`moda_flex.Variant`.
        score: a :class:`moda_flex.Score` (``softcap``, ``alibi``,
            ``depth_bias``, ``depth_alibi`` or your own) changing each logit
            before the softmax; the same as ``variant & score``. Runs on
            ``reference`` and ``flex``; ``triton`` fuses those of
            :data:`moda_flex.backends.triton.support.FUSED_SCORES` and refuses
            the rest.
        scale: logit scale, any finite nonzero real number (negative too, as
            SDPA accepts); default ``1 / sqrt(D)``.
        backend: ``"auto"`` | ``"reference"`` | ``"flex"`` | ``"triton"``;
            ``"auto"`` follows the policy of :mod:`moda_flex.backends`.
            Second derivatives (through gradients taken with
            ``create_graph=True``) need ``"reference"``: the others compute
            first derivatives only, as does PyTorch's SDPA, which ``"auto"``
            runs a plain call without depth on.
        return_lse: also return the log-sum-exp.

    Returns:
        out (B, Hq, Tq, D) in q's dtype (under ``torch.autocast``, the dtype
        SDPA would return: the autocast dtype, unless q is float64); with
        ``return_lse`` also lse (B, Hq, Tq) float32, natural log. A row that
        sees no key gives zeros and ``lse = -inf``; a row whose query or a
        visible entry holds NaN or Inf gives NaN, and a masked one never
        reaches it (except where ``"auto"`` hands a call without depth to
        PyTorch's SDPA). Its strides are the backend's, as SDPA's are: the
        kernel backends lay out out as (B, Tq, Hq, D), as SDPA's flash path
        does, so ``out.transpose(1, 2).reshape(B, Tq, Hq * D)`` is a view.

    Raises:
        ValueError: for shapes, dtypes, devices or a scale that break the contract.
        TypeError: for an argument of the wrong type (a tensor argument that is
            not a tensor, a scale that is not a real number), as SDPA raises.
        NotImplementedError: when the named backend cannot run the call; in a
            backward with ``create_graph=True`` through ``"flex"``, ``"triton"``
            or ``"split"``.
    """
    run, tensors, variant, scale, autocast_off = _prepared_call(
        q, k, v, depth_k, depth_v, variant, score, scale, backend, return_lse
    )
    with autocast_off:
        out, lse = run(*tensors, variant, scale)
    return (out, lse) if return_lse else out


def _prepared_call(q, k, v, depth_k, depth_v, variant, score, scale, backend: str, return_lse: bool):
    """A call checked and made ready for its backend: the backend, the tensors (q, k, v, depth_k, depth_v) it
    takes, the variant (its score joined), the scale, and the context to run it in."""
    variant = resolve(variant)
    if score is not None:
        if not isinstance(score, Score):
            raise TypeError(f"score must be a moda_flex Score or None, got {type(score).__name__} {score!r}")
        variant = variant & score
    depth_k, depth_v = check_inputs(q, k, v, depth_k, depth_v)
    variant.check_fits(q.shape[0], k.shape[2])
    scale = _check_scale(scale, q.shape[-1])
    if scale < 0:  # as -q at -scale: SDPA's fused kernels mask before they scale, and give NaN for a negative one
        q, scale = -q, -scale
    run = backends.choose(backend, q, k, slot_count(depth_k), variant, return_lse=return_lse)
    if is_entries(depth_k) and not backends.reads_depth_entries(run):
        empty = k.new_empty(q.shape[0], k.shape[1], q.shape[2], q.shape[3])  # (B, Hk, Tq, D)
        depth_k, depth_v = as_tensor(depth_k, empty), as_tensor(depth_v, empty)
    tensors, autocast_off = _leave_autocast((q, k, v, depth_k, depth_v))
    return run, tensors, variant, scale, autocast_off


def _check_scale(scale, head_dim: int) -> float:
    """The logit scale as a float: ``1 / sqrt(D)`` for None, else any finite nonzero real number (as SDPA)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, Tensor):
        raise TypeError(
            f"scale must be a real number, got a tensor {tuple(scale.shape)} of {scale.dtype}: pass float(scale); "
            f"to learn a scale, multiply q by it (scale is not differentiated)"
        )
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number (float or int), got {type(scale).__name__} {scale!r}")
    if not (math.isfinite(scale) and scale != 0):
        raise ValueError(f"scale must be a finite nonzero real number, got {scale!r}")
    return float(scale)


def _leave_autocast(tensors: tuple):
    """The inputs in the dtype the call computes in, and a context for the backend.

    SDPA's rule under ``torch.autocast``, on CPU and CUDA alike: inputs are cast
    to the region's dtype, except float64, which stays; outside autocast
    nothing changes. The backend then runs with autocast off, so that every
    backend computes in that one dtype and returns it.
    """
    device_type = tensors[0].device.type
    # is_autocast_available is not traceable by every torch.compile version; these two device types are.
    if not (device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type)):
        return tensors, contextlib.nullcontext()
    if tensors[0].dtype != torch.float64:
        dtype = torch.get_autocast_dtype(device_type)
        # Depth given as entries stays a sequence of entries.
        tensors = tuple(t.to(dtype) if isinstance(t, Tensor) else [e.to(dtype) for e in t] for t in tensors)
    return tensors, torch.autocast(device_type, enabled=False)


def check_inputs(q, k, v, depth_k, depth_v):
    """Validate the contract; return depth tensors with L = 0 filled in when absent."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, T, D), got {tuple(t.shape)}")
    if not q.is_floating_point():
        raise ValueError(f"q must be floating point, got dtype {q.dtype}")
    B, Hq, Tq, D = q.shape
    if D == 0:
        raise ValueError(f"q must have a head dim D >= 1, got q {tuple(q.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    Bk, Hk, Tk, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(
            f"k must have shape (B={B}, Hk, Tk, D={D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if Hk == 0 or Hq % Hk != 0:
        raise ValueError(
            f"q heads ({Hq}) must be a multiple of k heads ({Hk}); q {tuple(q.shape)}, k {tuple(k.shape)}"
            + _layout_hint(q, k)
        )
    if Tq > Tk:
        raise ValueError(
            f"q has more tokens than k (Tq={Tq} > Tk={Tk}); q {tuple(q.shape)}, k {tuple(k.shape)}"
            + _layout_hint(q, k)
        )

    for name, depth in (("depth_k", depth_k), ("depth_v", depth_v)):
        if not (depth is None or isinstance(depth, (Tensor, Sequence))):
            raise TypeError(
                f"{name} must be a (B, Hk, Tq, L, D) tensor, a sequence of L (B, Hk, Tq, D) tensors or None, "
                f"got {type(depth).__name__}"
            )
    if (depth_k is None) != (depth_v is None):
        raise ValueError("depth_k and depth_v must both be given or both be None")
    if depth_k is None:
        depth_k = depth_v = q.new_empty(B, Hk, Tq, 0, D)
    tensors = {"q": q, "k": k, "v": v}
    if is_entries(depth_k) != is_entries(depth_v):
        raise ValueError(
            "depth_k and depth_v must take the same form: both (B, Hk, Tq, L, D) tensors or both sequences of "
            f"(B, Hk, Tq, D) entries, got {type(depth_k).__name__} and {type(depth_v).__name__}"
        )
    if is_entries(depth_k):
        depth_k, depth_v = tuple(depth_k), tuple(depth_v)
        if len(depth_k) != len(depth_v):
            raise ValueError(f"depth_k and depth_v must hold as many entries, got {len(depth_k)} and {len(depth_v)}")
        entry_shape = (q.shape[0], k.shape[1], q.shape[2], q.shape[3])
        for side, entries in (("depth_k", depth_k), ("depth_v", depth_v)):
            for i, t in enumerate(entries):
                # The common case in one comparison: a model passes dozens of entries per call.
                if not (isinstance(t, Tensor) and t.shape == entry_shape and t.dtype == q.dtype and t.device == q.device):
                    _check_depth(f"{side}[{i}]", t, False, q, k)
                    tensors[f"{side}[{i}]"] = t
    else:
        for name, t in (("depth_k", depth_k), ("depth_v", depth_v)):
            _check_depth(name, t, True, q, k)
        if depth_k.shape != depth_v.shape:
            raise ValueError(
                f"depth_k and depth_v must have the same shape, got {tuple(depth_k.shape)} and {tuple(depth_v.shape)}"
            )
        tensors.update(depth_k=depth_k, depth_v=depth_v)

    for name, t in tensors.items():
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; all inputs must share one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share one device")
    return depth_k, depth_v


def _check_depth(name: str, t, slot_axis: bool, q: Tensor, k: Tensor) -> None:
    """One depth tensor: (B, Hk, Tq, L, D) with ``slot_axis``, else one entry (B, Hk, Tq, D), matching q and k."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    B, Tq, D = q.shape[0], q.shape[2], q.shape[3]
    Hk = k.shape[1]
    dims = 5 if slot_axis else 4
    if t.dim() != dims or (t.shape[0], t.shape[1], t.shape[2], t.shape[-1]) != (B, Hk, Tq, D):
        layout = f"(B={B}, Hk={Hk}, Tq={Tq}, {'L, ' if slot_axis else ''}D={D})"
        raise ValueError(
            f"{name} must have shape {layout} for q {tuple(q.shape)} and k {tuple(k.shape)}, got {tuple(t.shape)}"
        )


def _layout_hint(q: Tensor, k: Tensor) -> str:
    """A hint when q and k, read as (B, T, H, D), would fit the head and token rules."""
    tokens_fit = q.shape[1] <= k.shape[1]
    heads_fit = k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0
    if tokens_fit and heads_fit:
        return (
            "; the shapes look like (B, T, H, D), but moda_attention takes (B, H, T, D): "
            "pass q.transpose(1, 2) and the same for k and v"
        )
    return ""
