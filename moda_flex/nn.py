"""Layers for MoDA models: attention that reads and writes the depth stream.

A MoDA transformer threads one :class:`~moda_flex.depth.DepthStream` through
its blocks. Per block (``depth_kv="attn+ffn"``, the paper's default variant)::

    attention  reads  the stream: its own sequence K/V | every depth entry so far
               writes its K/V (the very tensors its sequence attention used)
    FFN        writes one K/V projected from its input (DepthKVProjection)

so the attention of block ``l`` sees ``2 l`` depth entries per token. The
stream is a value: a layer returns the stream with its entry appended
(``x, depth = block(x, depth)``). Entries are never copied: the attention
reads them in place, so a forward pass moves only the depth bytes it reads.

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

from .attention import moda_attention
from .backends.reference import attention_probabilities
from .depth import DepthStream, as_tensor
from .scores import Score
from .variants import Variant, resolve

__all__ = ["DepthStream", "KVCache", "MoDAAttention", "DepthKVProjection", "SwiGLU", "Block", "BlockConfig",
           "RotaryEmbedding", "apply_rope"]

DEPTH_KV = ("none", "attn", "attn+ffn")
NORMS = ("pre", "post")


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
    """Rotate (B, T, H, D) queries or keys to absolute positions ``start .. start + T - 1``.

    GPT-NeoX layout: dimension ``i`` pairs with ``i + D/2``. A query and a key
    rotated to the same position keep their dot product, so depth keys of a
    token (rotated to its position) are read at relative distance zero.

    Heads come after tokens, as a projection lays them out: the attention's
    (B, H, T, D) is then a view of the result (``.transpose(1, 2)``), and
    compiled, a norm before the rotation runs in the rotation's kernel, with
    no transpose between them. This computes the angles' cos and sin on every
    call; :class:`RotaryEmbedding` holds them once.
    """
    cos, sin = _rope_tables(start, x.shape[1], x.shape[3], base, x.device)
    return _rotate(x, cos, sin)


def _rope_tables(start: int, T: int, D: int, base: float, device) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles of positions ``start .. start + T - 1``, (T, 1, D) float32 each."""
    inv_freq = base ** (-torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)  # (D/2,)
    pos = torch.arange(start, start + T, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq).repeat(1, 2)[:, None]  # (T, 1, D): dimension i and i + D/2 turn alike
    return angles.cos(), angles.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """(B, T, H, D) ``x`` rotated by (T, 1, D) float32 ``cos`` and ``sin`` (:func:`_rope_tables`), in x's dtype."""
    wide = x.float()
    x1, x2 = wide.chunk(2, dim=-1)  # (B, T, H, D/2) each
    # one expression over all D (not two halves, then joined): compiled, it is one kernel with the norm that
    # x comes from, where halves of D/2 are a kernel, and their concatenation another
    return (wide * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """:func:`apply_rope` with the cos and sin of positions ``0 .. positions - 1`` computed once, as buffers.

    Compiled, :func:`apply_rope` computes its angles' power, cos and sin for
    every element it rotates, in the rotation's kernel; from the buffers a
    rotation reads them instead. One table serves every layer of a head size
    and base: a :class:`Block` shares one between its attention and its FFN
    projection, and a model may pass one to all its blocks (``rotary=``).
    Positions past the table are rotated as :func:`apply_rope` rotates them.

    The buffers are not saved in a ``state_dict``, and like any buffer they
    take the dtype a whole-module ``.to(dtype)`` gives.

    Args:
        head_dim: D, even.
        base: the rotation base.
        positions: positions the table holds.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, positions: int = 4096):
        super().__init__()
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be even and positive, got {head_dim}")
        if positions < 0:
            raise ValueError(f"positions must be >= 0, got {positions}")
        self.head_dim, self.base = head_dim, base
        cos, sin = _rope_tables(0, positions, head_dim, base, None)
        self.register_buffer("cos", cos, persistent=False)  # (positions, 1, D)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """(B, T, H, D) ``x`` rotated to positions ``start .. start + T - 1`` (:func:`apply_rope`)."""
        T = x.shape[1]
        if start + T > self.cos.shape[0]:
            return apply_rope(x, start, self.base)
        return _rotate(x, self.cos[start : start + T], self.sin[start : start + T])


def _rotation(rope: bool, rope_base: float, rotary: Optional[RotaryEmbedding], head_dim: int
              ) -> Optional[RotaryEmbedding]:  # fmt: skip
    """A layer's rotation: ``rotary`` (shared with other layers) or a table of its own; None without rope."""
    if not rope:
        if rotary is not None:
            raise ValueError("rotary was given to a layer with rope=False")
        return None
    if rotary is None:
        return RotaryEmbedding(head_dim, rope_base)
    if (rotary.head_dim, rotary.base) != (head_dim, rope_base):
        raise ValueError(
            f"rotary has head_dim={rotary.head_dim}, base={rotary.base}; the layer has head_dim={head_dim}, "
            f"rope_base={rope_base}"
        )
    return rotary


def _keys_and_values(
    kv: Tensor, k_norm: nn.Module, n_kv_head: int, head_dim: int, rotary: Optional[RotaryEmbedding], start: int
) -> tuple[Tensor, Tensor]:
    """Split a (B, T, 2 * Hk * D) projection into k, v (B, Hk, T, D); normalize and rotate k.

    Both are views of (B, T, Hk, D) tensors: v of the projection, k of the
    rotated keys (:func:`apply_rope`'s layout).

    Attention layers and FFN depth projections share this, so both kinds of
    depth key are treated alike.
    """
    B, T, _ = kv.shape
    k, v = kv.view(B, T, 2, n_kv_head, head_dim).unbind(2)  # (B, T, Hk, D) each
    k = _normalized_and_rotated(k, k_norm, v.dtype, rotary, start)
    return k.transpose(1, 2), v.transpose(1, 2)


def _normalized_and_rotated(x: Tensor, norm: nn.Module, dtype: torch.dtype, rotary: Optional[RotaryEmbedding],
                            start: int) -> Tensor:  # fmt: skip
    """(B, T, H, D) queries or keys through ``norm``, in ``dtype``, then rotated (unless ``rotary`` is None)."""
    # Normalize in float32 at least (the norms' weights are float32 under autocast), then back to ``dtype``.
    x = norm(_upcast(x)).to(dtype)
    return x if rotary is None else rotary(x, start)


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
        if self.rope and self.head_dim % 2:
            raise ValueError(f"rope needs an even head size, got n_embd // n_head = {self.head_dim}")

    @property
    def head_dim(self) -> int:
        """Head size D, ``n_embd // n_head``."""
        return self.n_embd // self.n_head

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
        rotary: the rotation's table (:class:`RotaryEmbedding`, of this head
            size and ``rope_base``), shared with other layers; by default the
            layer makes its own.
        qk_norm: RMSNorm on every query and key head (before the rotation).
        bias: biases in the projections.
        variant: the ``moda_attention`` mask variant.
        backend: the ``moda_attention`` backend; ``"auto"`` is its policy
            (:mod:`moda_flex.backends`), under which a causal or full call
            without depth runs on PyTorch's SDPA.
        score: the ``moda_attention`` score function, e.g.
            ``depth_bias(nn.Parameter(torch.zeros(L)))``; its ``nn.Parameter``
            tensors become parameters of the layer (``score_params``).
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        n_kv_head: int,
        *,
        rope: bool = True,
        rope_base: float = 10000.0,
        rotary: Optional[RotaryEmbedding] = None,
        qk_norm: bool = True,
        bias: bool = False,
        variant: Union[str, Variant] = "causal",
        backend: str = "auto",
        score: Optional[Score] = None,
    ):
        super().__init__()
        _check_heads(n_embd, n_head, n_kv_head)
        if score is not None and not isinstance(score, Score):
            raise TypeError(f"score must be a moda_flex Score or None, got {type(score).__name__}")
        self.score = score
        # Registered, so that optimizers, .to() and state_dict see a learned bias.
        self.score_params = nn.ParameterList([p for p in getattr(score, "params", ()) if isinstance(p, nn.Parameter)])
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.head_dim = n_embd // n_head
        self.rotary = _rotation(rope, rope_base, rotary, self.head_dim)
        self.variant, self.backend = variant, backend
        # Joined once here, not per call: a compiled forward then builds no Variant.
        self._scored = resolve(variant) if score is None else resolve(variant) & score
        self.q_proj = nn.Linear(n_embd, n_head * self.head_dim, bias=bias)
        self.kv_proj = nn.Linear(n_embd, 2 * n_kv_head * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_head * self.head_dim, n_embd, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()

    def forward(
        self, x: Tensor, depth: Optional[DepthStream] = None, cache: Optional[KVCache] = None
    ) -> tuple[Tensor, Optional[DepthStream]]:
        """Attend over ``[sequence | depth]``, then append this layer's keys/values to the stream.

        Args:
            x: (B, T, C) input; its tokens sit at positions ``cache.length ..``
                (0 .. without a cache).
            depth: the stream to read, or None (no depth).
            cache: this layer's sequence K/V of earlier tokens, updated in place.

        Returns:
            (B, T, C), and ``depth`` with this layer's k, v (B, Hk, T, D)
            appended (None if ``depth`` is None).
        """
        B, T, C = x.shape
        q, k, v = self._project(x, cache.length if cache is not None else 0)
        k_all, v_all = cache.update(k, v) if cache is not None else (k, v)
        if depth is None:
            y = moda_attention(q, k_all, v_all, variant=self._scored, backend=self.backend)
        else:
            y = moda_attention(q, k_all, v_all, *depth.read(), variant=self._scored, backend=self.backend)
            depth = depth.append(k, v)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, Hq*D)
        return self.o_proj(y), depth

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
        depth_k, depth_v = as_tensor(depth_k or [], k), as_tensor(depth_v or [], v)  # (B, Hk, T, L, D)
        return attention_probabilities(q, k, v, depth_k, depth_v, self._scored, 1.0 / math.sqrt(self.head_dim))

    def _project(self, x: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, Hq, T, D) and k, v (B, Hk, T, D), normalized and rotated."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)  # (B, T, Hq, D), as the projection lays it out
        k, v = _keys_and_values(self.kv_proj(x), self.k_norm, self.n_kv_head, self.head_dim, self.rotary, start)
        q = _normalized_and_rotated(q, self.q_norm, v.dtype, self.rotary, start)
        return q.transpose(1, 2), k, v


class DepthKVProjection(nn.Module):
    """The FFN side's depth write ("Extra FFN KV Proj."): one K/V per token from the FFN input.

    Keys get the same treatment as the attention's (RMSNorm, rotation to the
    token's position), so a query weighs both kinds of depth entry alike.

    Args:
        n_embd: width C of the FFN input.
        n_kv_head: key/value heads Hk of the attention layers that read it.
        head_dim: their head size D.
        rope, rope_base, rotary, qk_norm, bias: as in :class:`MoDAAttention`.
    """

    def __init__(
        self,
        n_embd: int,
        n_kv_head: int,
        head_dim: int,
        *,
        rope: bool = True,
        rope_base: float = 10000.0,
        rotary: Optional[RotaryEmbedding] = None,
        qk_norm: bool = True,
        bias: bool = False,
    ):
        super().__init__()
        self.n_kv_head, self.head_dim = n_kv_head, head_dim
        self.rotary = _rotation(rope, rope_base, rotary, head_dim)
        self.kv_proj = nn.Linear(n_embd, 2 * n_kv_head * head_dim, bias=bias)
        self.k_norm = nn.RMSNorm(head_dim) if qk_norm else nn.Identity()

    def forward(self, x: Tensor, depth: DepthStream, start: int = 0) -> DepthStream:
        """``depth`` with the K/V of (B, T, C) ``x`` appended, its tokens at positions ``start ..``.

        The entries are laid out as :class:`MoDAAttention`'s (a projection of
        their own, keys normalized and rotated into a fresh tensor), so a
        stream's entries share their strides and the kernels read each where
        it lies (:func:`moda_flex.backends.launch.pointer_depth`).
        """
        k, v = _keys_and_values(self.kv_proj(x), self.k_norm, self.n_kv_head, self.head_dim, self.rotary, start)
        return depth.append(k, v)


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

    Args:
        config: the block's sizes and options.
        ffn_depth: write the FFN's depth entry (with ``depth_kv="attn+ffn"``).
            Pass False for a model's last block: no later layer would read the
            entry, and its projection would never get a gradient.
        rotary: the rotation's table (:class:`RotaryEmbedding`), to share one
            between blocks; by default the block makes one for its layers.
    """

    def __init__(self, config: BlockConfig, ffn_depth: bool = True, rotary: Optional[RotaryEmbedding] = None):
        super().__init__()
        self.config = config
        C = config.n_embd
        rotary = _rotation(config.rope, config.rope_base, rotary, config.head_dim)
        self.attn = MoDAAttention(
            C,
            config.n_head,
            config.n_kv_head,
            rope=config.rope,
            rope_base=config.rope_base,
            rotary=rotary,
            qk_norm=config.qk_norm,
            bias=config.bias,
            backend=config.backend,
        )
        self.ffn_kv = (
            DepthKVProjection(
                C,
                config.n_kv_head,
                config.head_dim,
                rope=config.rope,
                rope_base=config.rope_base,
                rotary=rotary,
                qk_norm=config.qk_norm,
                bias=config.bias,
            )
            if config.depth_kv == "attn+ffn" and ffn_depth
            else None
        )
        hidden = config.mlp_hidden or 64 * math.ceil(8 * C / 3 / 64)
        self.mlp = SwiGLU(C, hidden, bias=config.bias)
        self.norm_1 = nn.RMSNorm(C)
        self.norm_2 = nn.RMSNorm(C)

    def forward(
        self, x: Tensor, depth: Optional[DepthStream] = None, cache: Optional[KVCache] = None
    ) -> tuple[Tensor, Optional[DepthStream]]:
        """(B, T, C) -> (B, T, C), and the stream with this block's entries appended.

        ``depth`` is read and extended unless ``depth_kv == "none"``, in which
        case it is returned as given.
        """
        start = cache.length if cache is not None else 0
        if self.config.depth_kv == "none":
            stream = None
        elif depth is None:
            raise ValueError(f"a block with depth_kv={self.config.depth_kv!r} needs a DepthStream")
        else:
            stream = depth
        if self.config.norm == "pre":
            y, stream = self.attn(self.norm_1(x), stream, cache)
            x = x + y
            h = self.norm_2(x)
        else:
            y, stream = self.attn(x, stream, cache)
            x = h = self.norm_1(x + y)
        if self.ffn_kv is not None:
            # its own product, not one with the FFN's: an entry sliced from a wider product would have strides of
            # its own, and the kernels would stack every entry a layer reads; with the strides made alike, one
            # product measured no faster (docs/design-notes.md, "Depth in a model", "Entries must share their strides")
            stream = self.ffn_kv(h, stream, start)
        x = x + self.mlp(h)
        x = x if self.config.norm == "pre" else self.norm_2(x)
        return x, (depth if stream is None else stream)
