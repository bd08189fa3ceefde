"""Layers for MoDA models: attention that reads and writes the depth stream.

A MoDA transformer threads one :class:`DepthStream` through its blocks. Per
block (``depth_kv="attn+ffn"``, the paper's default variant)::

    attention  reads  the stream: its own sequence K/V | every depth entry so far
               writes its K/V (the very tensors its sequence attention used)
    FFN        writes one K/V projected from its input (DepthKVProjection)

so the attention of block ``l`` sees ``2 l`` depth entries per token. The
stream holds preallocated buffers; each write copies one (B, Hk, T, D) entry
and each read is a strided slice, so a forward pass moves O(L) depth data
rather than re-stacking O(L^2).

Decoding keeps one :class:`KVCache` of sequence K/V per attention layer.
Depth entries need no cache: a token reads only its own depth, which the
earlier layers of the same forward pass wrote.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import variants as _variants
from .attention import moda_attention
from .reference import attention_probabilities
from .variants import Variant

DEPTH_KV = ("none", "attn", "attn+ffn")
NORMS = ("pre", "post")


class DepthStream:
    """The depth K/V that layers write for the tokens of one forward pass.

    Buffers of shape (B, Hk, T, capacity, D) are allocated at the first
    :meth:`append`, in that entry's dtype and device. :meth:`read` returns the
    strided views ``buf[:, :, :, :count]``, the layout ``moda_attention``
    takes as ``depth_k``/``depth_v`` without a copy.

    Autograd: entries are written in place, which would normally invalidate
    the earlier reads that a backward pass saved. Writes therefore go through
    an alias of the buffers with its own version counter: they only ever fill
    the slot just past every earlier read, so no saved read changes. Gradients
    take a separate route: each read's backward adds its gradient into an
    accumulator in the entries' dtype (as autograd would sum the gradients of
    re-stacked entries), and each append's backward, which autograd runs only
    after every later read's (the appends and reads are chained by a scalar
    token), hands its slot of the accumulator to the appended tensors.

    Args:
        capacity: the number of entries the pass will append (``Lmax``).
    """

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.count = 0
        self._buffers: Optional[_DepthBuffers] = None
        self._token: Optional[Tensor] = None

    def read(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The entries written so far: two (B, Hk, T, count, D) views, or (None, None) if none."""
        if self.count == 0:
            return None, None
        return _Read.apply(self._token, self._buffers, self.count)

    def append(self, k: Tensor, v: Tensor) -> None:
        """Write one entry per token: ``k``, ``v`` of shape (B, Hk, T, D)."""
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(
                f"k and v must both have shape (B, Hk, T, D), got k {tuple(k.shape)} and v {tuple(v.shape)}"
            )
        if self.count == self.capacity:
            raise ValueError(f"the depth stream is full: all {self.capacity} entries were appended")
        if self._buffers is None:
            self._buffers = _DepthBuffers(k, v, self.capacity)
            self._token = k.new_zeros(())
        k_buf = self._buffers.k
        expected = k_buf.shape[:3] + k_buf.shape[4:]
        if k.shape != expected or k.dtype != k_buf.dtype or k.device != k_buf.device:
            raise ValueError(
                f"k must have shape {tuple(expected)}, dtype {k_buf.dtype} and device {k_buf.device} like "
                f"the entries already in the stream, got {tuple(k.shape)}, {k.dtype}, {k.device}"
            )
        self._token = _Append.apply(k, v, self._token, self._buffers, self.count)
        self.count += 1


class _DepthBuffers:
    """The memory behind a DepthStream. Autograd nodes hold this, never the stream or its
    token, so that no reference cycle keeps the buffers alive after backward."""

    def __init__(self, k: Tensor, v: Tensor, capacity: int):
        B, Hk, T, D = k.shape
        self.k = k.new_empty(B, Hk, T, capacity, D)  # (B, Hk, T, Lmax, D)
        self.v = v.new_empty(B, Hk, T, capacity, D)
        self.k_write, self.v_write = self.k.data, self.v.data  # the same memory, another version counter
        self.grad_k: Optional[Tensor] = None  # (B, Hk, T, Lmax, D), filled in backward
        self.grad_v: Optional[Tensor] = None

    def add_grad(self, n: int, grad_k: Optional[Tensor], grad_v: Optional[Tensor]) -> None:
        if self.grad_k is None:
            self.grad_k = torch.zeros_like(self.k)
            self.grad_v = torch.zeros_like(self.v)
        if grad_k is not None:
            self.grad_k[:, :, :, :n] += grad_k
        if grad_v is not None:
            self.grad_v[:, :, :, :n] += grad_v

    @staticmethod
    def take_grad(grad: Optional[Tensor], slot: int) -> Optional[Tensor]:
        """Slot ``slot`` of an accumulator as a fresh tensor, leaving zeros behind for a repeated backward."""
        if grad is None:
            return None
        out = grad[:, :, :, slot].clone()  # (B, Hk, T, D)
        grad[:, :, :, slot].zero_()
        return out


class _Append(torch.autograd.Function):
    """Write (k, v) into slot ``slot``; the returned token orders the backward passes."""

    @staticmethod
    def forward(ctx, k, v, token, buffers: _DepthBuffers, slot: int):
        buffers.k_write[:, :, :, slot].copy_(k)
        buffers.v_write[:, :, :, slot].copy_(v)
        ctx.buffers, ctx.slot = buffers, slot
        return token.new_zeros(())

    @staticmethod
    def backward(ctx, grad_token):
        buffers = ctx.buffers
        grad_k = buffers.take_grad(buffers.grad_k, ctx.slot) if ctx.needs_input_grad[0] else None
        grad_v = buffers.take_grad(buffers.grad_v, ctx.slot) if ctx.needs_input_grad[1] else None
        return grad_k, grad_v, grad_token, None, None


class _Read(torch.autograd.Function):
    """The first ``count`` slots as views; backward accumulates into the gradient buffers."""

    @staticmethod
    def forward(ctx, token, buffers: _DepthBuffers, count: int):
        ctx.set_materialize_grads(False)
        ctx.buffers, ctx.count = buffers, count
        ctx.token_shape = token.shape
        return buffers.k[:, :, :, :count], buffers.v[:, :, :, :count]

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        ctx.buffers.add_grad(ctx.count, grad_k, grad_v)
        return ctx.buffers.k.new_zeros(ctx.token_shape), None, None


class KVCache:
    """Sequence keys and values of one attention layer, for decoding.

    Args:
        max_len: the most tokens the cache will hold (prompt plus generated).
    """

    def __init__(self, max_len: int):
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.max_len = max_len
        self.length = 0
        self._k: Optional[Tensor] = None  # (B, Hk, max_len, D)
        self._v: Optional[Tensor] = None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append (B, Hk, T, D) keys/values; return every cached one, (B, Hk, length, D)."""
        T = k.shape[2]
        if self.length + T > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} tokens; {self.length} cached + {T} new do not fit")
        if self._k is None:
            B, Hk, _, D = k.shape
            self._k = k.new_empty(B, Hk, self.max_len, D)
            self._v = v.new_empty(B, Hk, self.max_len, D)
        self._k[:, :, self.length : self.length + T] = k
        self._v[:, :, self.length : self.length + T] = v
        self.length += T
        return self._k[:, :, : self.length], self._v[:, :, : self.length]


def apply_rope(x: Tensor, start: int, base: float = 10000.0) -> Tensor:
    """Rotate (B, H, T, D) queries or keys to absolute positions ``start .. start + T - 1``.

    GPT-NeoX layout: dimension ``i`` pairs with ``i + D/2``. A query and a key
    rotated to the same position keep their dot product, so depth keys of a
    token (rotated to its position) are read at relative distance zero.
    """
    T, D = x.shape[2], x.shape[3]
    inv_freq = base ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)  # (D/2,)
    pos = torch.arange(start, start + T, device=x.device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)  # (T, D/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, H, T, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _keys_and_values(
    kv: Tensor, k_norm: nn.Module, n_kv_head: int, head_dim: int, rope_base: Optional[float], start: int
) -> tuple[Tensor, Tensor]:
    """Split a (B, T, 2 * Hk * D) projection into k, v (B, Hk, T, D); normalize and rotate k.

    Attention layers and FFN depth projections share this, so both kinds of
    depth key are treated alike.
    """
    B, T, _ = kv.shape
    k, v = kv.view(B, T, 2, n_kv_head, head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # (B, Hk, T, D) each
    # Normalize in float32 at least (the norms' weights are float32 under autocast), then back to v's dtype.
    k = k_norm(_upcast(k)).to(v.dtype)
    if rope_base is not None:
        k = apply_rope(k, start, rope_base)
    return k, v


def _upcast(x: Tensor) -> Tensor:
    """``x`` in float32 if its dtype is narrower, else unchanged."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@dataclasses.dataclass
class BlockConfig:
    """Everything a :class:`Block` needs.

    Attributes:
        n_embd: model width C.
        n_head: query heads Hq; head size ``D = n_embd // n_head``.
        n_kv_head: key/value heads Hk (GQA); ``n_head % n_kv_head == 0``.
        depth_kv: ``"none"`` (a plain transformer), ``"attn"`` (attention
            layers write their K/V to the depth stream) or ``"attn+ffn"``
            (FFN layers also write a projected K/V: the paper's default).
        norm: ``"pre"`` (``x + f(norm(x))``) or ``"post"`` (``norm(x + f(x))``).
        rope: rotary position embedding on queries and keys.
        rope_base: its base.
        qk_norm: RMSNorm on each query and key head.
        mlp_hidden: SwiGLU hidden width; default ``8/3 * n_embd`` rounded up to 64.
        bias: biases in the linear layers.
        backend: ``moda_attention`` backend.
    """

    n_embd: int = 384
    n_head: int = 6
    n_kv_head: int = 2
    depth_kv: str = "attn+ffn"
    norm: str = "post"
    rope: bool = True
    rope_base: float = 10000.0
    qk_norm: bool = True
    mlp_hidden: Optional[int] = None
    bias: bool = False
    backend: str = "auto"

    def __post_init__(self):
        if self.depth_kv not in DEPTH_KV:
            raise ValueError(f"depth_kv must be one of {DEPTH_KV}, got {self.depth_kv!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        _check_heads(self.n_embd, self.n_head, self.n_kv_head)
        if self.rope and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"rope needs an even head size, got n_embd // n_head = {self.n_embd // self.n_head}")

    @property
    def depth_writes(self) -> int:
        """Depth entries one block appends per token: 0, 1 or 2."""
        return DEPTH_KV.index(self.depth_kv)


def _check_heads(n_embd: int, n_head: int, n_kv_head: int) -> None:
    if n_head < 1 or n_kv_head < 1 or n_embd % n_head or n_head % n_kv_head:
        raise ValueError(
            f"need n_embd % n_head == 0 and n_head % n_kv_head == 0, got n_embd={n_embd}, "
            f"n_head={n_head}, n_kv_head={n_kv_head}"
        )


class MoDAAttention(nn.Module):
    """GQA attention over ``[own sequence K/V | depth K/V]`` that then writes its K/V as depth.

    Args:
        n_embd: width C of the input and output.
        n_head: query heads Hq.
        n_kv_head: key/value heads Hk, ``n_head % n_kv_head == 0``.
        rope: rotate queries and keys (:func:`apply_rope`).
        rope_base: the rotation base.
        qk_norm: RMSNorm on every query and key head (before the rotation).
        bias: biases in the projections.
        variant: the ``moda_attention`` mask variant.
        backend: the ``moda_attention`` backend. With ``"auto"``, a call that
            reads no depth and no cache uses PyTorch's SDPA.
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        n_kv_head: int,
        *,
        rope: bool = True,
        rope_base: float = 10000.0,
        qk_norm: bool = True,
        bias: bool = False,
        variant: Union[str, Variant] = "causal",
        backend: str = "auto",
    ):
        super().__init__()
        _check_heads(n_embd, n_head, n_kv_head)
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.head_dim = n_embd // n_head
        self.rope, self.rope_base = rope, rope_base
        self.variant, self.backend = variant, backend
        self.q_proj = nn.Linear(n_embd, n_head * self.head_dim, bias=bias)
        self.kv_proj = nn.Linear(n_embd, 2 * n_kv_head * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_head * self.head_dim, n_embd, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()

    def forward(self, x: Tensor, depth: Optional[DepthStream] = None, cache: Optional[KVCache] = None) -> Tensor:
        """Attend, then append this layer's keys/values to ``depth``.

        Args:
            x: (B, T, C) input; its tokens sit at positions ``cache.length ..``
                (0 .. without a cache).
            depth: the stream to read before attending and to write after, or None.
            cache: this layer's sequence K/V of earlier tokens, updated in place.

        Returns:
            (B, T, C).
        """
        B, T, C = x.shape
        q, k, v = self._project(x, cache.length if cache is not None else 0)
        depth_k, depth_v = depth.read() if depth is not None else (None, None)
        k_all, v_all = cache.update(k, v) if cache is not None else (k, v)
        if depth_k is None and self.backend == "auto" and self.variant in ("causal", "full") and cache is None:
            y = F.scaled_dot_product_attention(q, k_all, v_all, is_causal=self.variant == "causal", enable_gqa=True)
        else:
            y = moda_attention(q, k_all, v_all, depth_k, depth_v, variant=self.variant, backend=self.backend)
        if depth is not None:
            depth.append(k, v)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, Hq*D)
        return self.o_proj(y)

    @torch.no_grad()
    def probabilities(self, x: Tensor, depth: Optional[DepthStream] = None) -> Tensor:
        """Attention weights over ``[sequence | depth]``, without writing to ``depth``.

        Args:
            x: (B, T, C), tokens at positions 0 .. T-1.
            depth: the stream as this layer would read it, or None.

        Returns:
            (B, Hq, T, T + L) float32; column ``T + l`` is the token's depth slot ``l``.
        """
        q, k, v = self._project(x, 0)
        depth_k, depth_v = depth.read() if depth is not None else (None, None)
        if depth_k is None:
            depth_k = depth_v = k.new_empty(*k.shape[:3], 0, k.shape[3])  # (B, Hk, T, 0, D)
        variant = _variants.resolve(self.variant)
        return attention_probabilities(q, k, v, depth_k, depth_v, variant, 1.0 / math.sqrt(self.head_dim))

    def _project(self, x: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, Hq, T, D) and k, v (B, Hk, T, D), normalized and rotated."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        rope_base = self.rope_base if self.rope else None
        k, v = _keys_and_values(self.kv_proj(x), self.k_norm, self.n_kv_head, self.head_dim, rope_base, start)
        q = self.q_norm(_upcast(q)).to(v.dtype)
        if self.rope:
            q = apply_rope(q, start, self.rope_base)
        return q, k, v


class DepthKVProjection(nn.Module):
    """The FFN side's depth write ("Extra FFN KV Proj."): one K/V per token from the FFN input.

    Keys get the same treatment as the attention's (RMSNorm, rotation to the
    token's position), so a query weighs both kinds of depth entry alike.

    Args:
        n_embd: width C of the FFN input.
        n_kv_head: key/value heads Hk of the attention layers that read it.
        head_dim: their head size D.
        rope, rope_base, qk_norm, bias: as in :class:`MoDAAttention`.
    """

    def __init__(
        self,
        n_embd: int,
        n_kv_head: int,
        head_dim: int,
        *,
        rope: bool = True,
        rope_base: float = 10000.0,
        qk_norm: bool = True,
        bias: bool = False,
    ):
        super().__init__()
        self.n_kv_head, self.head_dim = n_kv_head, head_dim
        self.rope, self.rope_base = rope, rope_base
        self.kv_proj = nn.Linear(n_embd, 2 * n_kv_head * head_dim, bias=bias)
        self.k_norm = nn.RMSNorm(head_dim) if qk_norm else nn.Identity()

    def forward(self, x: Tensor, depth: DepthStream, start: int = 0) -> None:
        """Append the K/V of (B, T, C) ``x``, tokens at positions ``start ..``, to ``depth``."""
        rope_base = self.rope_base if self.rope else None
        depth.append(*_keys_and_values(self.kv_proj(x), self.k_norm, self.n_kv_head, self.head_dim, rope_base, start))


class SwiGLU(nn.Module):
    """The FFN: ``proj(silu(x W_a) * x W_b)``, (B, T, C) -> (B, T, C)."""

    def __init__(self, n_embd: int, hidden: int, bias: bool = False):
        super().__init__()
        self.fc = nn.Linear(n_embd, 2 * hidden, bias=bias)
        self.proj = nn.Linear(hidden, n_embd, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.fc(x).chunk(2, dim=-1)  # (B, T, hidden) each
        return self.proj(F.silu(a) * b)


class Block(nn.Module):
    """A transformer block that reads and writes the depth stream.

    ``norm="pre"``: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``;
    ``norm="post"``: ``norm(x + attn(x))``, then ``norm(x + ffn(x))``. With
    ``depth_kv="attn+ffn"`` the FFN's input (what ``ffn`` is applied to) is
    also projected to a depth K/V.
    """

    def __init__(self, config: BlockConfig):
        super().__init__()
        self.config = config
        C = config.n_embd
        self.attn = MoDAAttention(
            C,
            config.n_head,
            config.n_kv_head,
            rope=config.rope,
            rope_base=config.rope_base,
            qk_norm=config.qk_norm,
            bias=config.bias,
            backend=config.backend,
        )
        self.ffn_kv = (
            DepthKVProjection(
                C,
                config.n_kv_head,
                self.attn.head_dim,
                rope=config.rope,
                rope_base=config.rope_base,
                qk_norm=config.qk_norm,
                bias=config.bias,
            )
            if config.depth_kv == "attn+ffn"
            else None
        )
        hidden = config.mlp_hidden or 64 * math.ceil(8 * C / 3 / 64)
        self.mlp = SwiGLU(C, hidden, bias=config.bias)
        self.norm_1 = nn.RMSNorm(C)
        self.norm_2 = nn.RMSNorm(C)

    def forward(self, x: Tensor, depth: Optional[DepthStream] = None, cache: Optional[KVCache] = None) -> Tensor:
        """(B, T, C) -> (B, T, C); ``depth`` is read and written unless ``depth_kv == "none"``."""
        start = cache.length if cache is not None else 0
        if self.config.depth_kv == "none":
            depth = None
        elif depth is None:
            raise ValueError(f"a block with depth_kv={self.config.depth_kv!r} needs a DepthStream")
        if self.config.norm == "pre":
            x = x + self.attn(self.norm_1(x), depth, cache)
            h = self.norm_2(x)
        else:
            x = h = self.norm_1(x + self.attn(x, depth, cache))
        if self.ffn_kv is not None:
            self.ffn_kv(h, depth, start)
        x = x + self.mlp(h)
        return x if self.config.norm == "pre" else self.norm_2(x)
