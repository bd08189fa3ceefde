"""The sequence part on the attention kernels PyTorch ships: SDPA's cuDNN and FlashAttention aten ops.

Each returns the output with its lse (natural log), and its backward takes
the output and lse it is given: called with the *merged* output and lse of
MoDA, it returns the sequence part's exact share of dq, dk, dv. Both take
GQA (``Hq = G * Hk``) without expanding k and v. On CPU (the tests, under
Triton's interpreter) the same role is played by SDPA's CPU flash op.

An op's lse comes in its own layout (cuDNN: (B, H, T, 1)); :func:`lse_view`
gives it as (B, H, T), :func:`lse_argument` as the depth kernels take it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

aten = torch.ops.aten

KERNELS = ("cudnn", "flash", "cpu")


@torch.compiler.assume_constant_result
def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability (a constant to ``torch.compile``)."""
    return _capability(device)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


# cuDNN's head dims where it was measured faster than FlashAttention and checked (H100, docs/design-notes.md "The split path"); its
# backward crashed the process on an H100 at a small head dim, so the others take FlashAttention.
CUDNN_HEAD_DIMS = (64, 128)


@torch.compiler.assume_constant_result
def kernel_for(device: torch.device, head_dim: int, square: bool) -> str:
    """The vendor kernel for a call on ``device`` with head dim ``head_dim`` (16-bit floats, ``D % 8 == 0``).

    cuDNN on compute capability 9.x at the head dims of :data:`CUDNN_HEAD_DIMS`
    and ``square`` calls (``Tq == Tk``, the ones measured),
    FlashAttention elsewhere; the CPU op on CPU. SDPA's switches
    (``torch.nn.attention.sdpa_kernel``) are honoured: a disabled cuDNN falls
    back to FlashAttention.
    """
    if device.type == "cpu":
        return "cpu"
    cudnn = torch.backends.cuda.cudnn_sdp_enabled() and _capability(device)[0] == 9 and head_dim in CUDNN_HEAD_DIMS and square
    return "cudnn" if cudnn else "flash"


def padded_kernel(kernel: str, head_dim: int) -> str:
    """The op for a backward whose head dim was padded to ``head_dim``: the forward's, except that cuDNN
    takes only the head dims of :data:`CUDNN_HEAD_DIMS` (FlashAttention the others)."""
    return "flash" if kernel == "cudnn" and head_dim not in CUDNN_HEAD_DIMS else kernel


def lse_view(lse: Tensor) -> Tensor:
    """An op's lse as a (B, H, T) view."""
    return lse[..., 0] if lse.dim() == 4 else lse


def lse_argument(lse: Tensor) -> tuple[Tensor, tuple[int, int, int]]:
    """An op's lse as the depth kernels take it: the tensor itself, whose address is its (B, H, T) view's, and
    that view's strides (not the view, which a traced kernel must not write: :mod:`..traced`)."""
    return lse, lse.stride()[:3]


def lse_layout(kernel: str, lse: Tensor) -> Tensor:
    """A (B, H, T) lse, or one in another op's layout, in ``kernel``'s layout (cuDNN: (B, H, T, 1))."""
    lse = lse_view(lse)
    return lse.unsqueeze(-1) if kernel == "cudnn" else lse


def forward(kernel: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of attention over the sequence: out (B, Hq, Tq, D) in the op's layout, lse in the op's layout.

    Args:
        q: (B, Hq, Tq, D); k, v: (B, Hk, Tk, D). ``causal`` is top-left: the
            caller passes it only where ``Tq == Tk``.
    """
    if kernel == "cudnn":
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    elif kernel == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _unread_scalar(dtype: torch.dtype, device: torch.device) -> Tensor:
    """An unwritten 0-dim tensor: a view of a one-element one, as inductor fills a 0-dim ``empty`` with a kernel
    of its own."""
    return torch.empty(1, dtype=dtype, device=device)[0]


def backward(kernel: str, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dq (B, Hq, Tq, D), dk, dv (B, Hk, Tk, D) of the attention whose softmax gave ``out`` and ``lse``.

    ``grad_out`` and ``out`` share a layout, ``lse`` is in the op's layout.
    Without dropout the ops read no random state: empty seeds stand in for it.
    """
    Tq, Tk = q.shape[2], k.shape[2]
    if kernel == "cudnn":
        seed = _unread_scalar(torch.int64, q.device)
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse, seed, seed, None, None, None, Tq, Tk, 0.0, causal, scale=scale
        )
    if kernel == "flash":
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = _unread_scalar(torch.uint64, q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, Tq, Tk, 0.0, causal, seed, offset, scale=scale
        )
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
    )
