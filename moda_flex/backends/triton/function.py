"""Launchers, autograd and the ``torch.library`` ops of the Triton backend.

Layers: ``kernels.py`` (``@triton.jit``) -> the launchers here (grid, block
sizes) -> two custom ops ``moda_flex::triton_forward`` / ``triton_backward``
with registered autograd and fake implementations (so ``torch.compile(...,
fullgraph=True)`` traces through them) -> :func:`triton_attention`.

Depth K/V reach the ops as a list: either one (B, Hk, Tq, L, D) tensor, or L
per-slot (B, Hk, Tq, D) tensors (the entries earlier layers wrote). The
kernels read slot ``l`` through a table of slot addresses, so neither form is
copied, and autograd hands each entry its own gradient. A fused score reaches
the ops as the depth bias tensor (so that it gets its gradient) and the cap.

The launchers pass every kernel argument by name; block sizes come from
:func:`_config`, which a ``config=`` hook of :func:`triton_attention` may
change for one eager call (benchmarks/tune_moda.py, benchmarks/bench_hopper.py).

Two paths, chosen at launch (:func:`_hopper`): the generic one (any CUDA GPU,
and the interpreter) and the Hopper one (compute capability 9.x, calls large
enough not to be bound by the host), which streams the tiles of the unmasked
blocks through tensor descriptors (the TMA copy engine) and launches with
configurations chosen for sm90. Both run the same kernels; the Hopper parts
sit behind constexpr flags of the launch configuration (:func:`_config`).
On an H100 the Hopper path is a few percent faster without depth and slower
with it (BENCHMARKS.md), so it is opt-in: ``MODA_FLEX_TRITON_PATH=auto``
takes it on Hopper GPUs for large calls, ``=hopper`` wherever the tensors
allow descriptors (the interpreter included); ``generic``, the default, never.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from ...scores import Score
from ...variants import Variant
from ..first_order import refuse_create_graph

DepthKV = Union[Tensor, Sequence[Tensor]]

# Any head dim up to FlashAttention's 256: the kernels pad it to a power of two (at least 16) inside.
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The smallest M of a Tensor Core dot: the depth phase works on tiles of
# max(pow2(G), 16) rows, the rows of 16 / pow2(G) consecutive tokens when G < 16.
_MIN_DOT_ROWS = 16
_LOG2E = math.log2(math.e)  # the kernels keep logits in base 2


def unsupported_reason(q: Tensor, variant: Variant) -> Optional[str]:
    """Why the Triton kernel cannot run this call, or None when it can.

    Args:
        q: (B, Hq, Tq, D) queries (only dtype, device and D are read).
        variant: the mask pair; it needs a :class:`moda_flex.Structure` whose
            depth reads are the token's own (``depth_chunk is None``) and
            whose documents are each one contiguous run, and no score
            function but ``softcap``, ``depth_bias`` or the two joined with ``&``.
    """
    if variant.score is not None and not _fuses(variant.score):
        return (
            f"score {variant.score.name!r} is not fused into the kernels (they fuse softcap, depth_bias and "
            f"the two joined with &); use backend='flex' (or 'auto', which picks it on CUDA) or 'reference'"
        )
    structure = variant.structure
    if structure is None:
        return "the variant has no Structure (a custom predicate); use backend='flex'"
    if structure.depth_chunk is not None:
        return f"chunk-visible depth (depth_chunk={structure.depth_chunk}) is not fused; use backend='flex'"
    if not structure.keys_contiguous:
        return (
            "a document's positions are not one contiguous run (an id comes back after another document); "
            "the kernel reads each document as one run; use backend='flex' or 'reference'"
        )
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        return f"head dim D={q.shape[-1]} is outside 1..{MAX_HEAD_DIM}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not one of float16, bfloat16, float32"
    if q.device.type == "cuda":
        return None
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"device {q.device} needs CUDA (or CPU with TRITON_INTERPRET=1)"


def _fuses(score: Score) -> bool:
    """Whether the kernels run ``score``: at most one softcap and one depth_bias, in either order."""
    if score.terms is None:
        return False
    kinds = [kind for kind, _ in score.terms]
    return kinds.count("softcap") <= 1 and kinds.count("depth_bias") <= 1


def _score_args(score: Optional[Score], q_heads: int, slots: int) -> tuple[Optional[Tensor], float, bool]:
    """The fused score as the ops' arguments: the depth bias or None, the cap (0.0: none), bias before cap.

    The bias is (L,) or (Hq, L) as given (an input of the op, so that it gets
    its gradient); binding the score checks it against the call.
    """
    if score is None:
        return None, 0.0, False
    score.bind(q_heads, slots)
    bias, cap, bias_first = None, 0.0, False
    params = iter(score.params)
    for kind, value in score.terms:
        if kind == "softcap":
            cap = value
        else:  # depth_bias: reads the next tensor of params
            bias, bias_first = next(params), cap == 0.0
    return bias, cap, bias_first


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: DepthKV,
    depth_v: DepthKV,
    variant: Variant,
    scale: float,
    *,
    config: Optional[ConfigHook] = None,
) -> tuple[Tensor, Tensor]:
    """Fused MoDA through the Triton kernels, for a call the registry has checked (inputs and support).

    Args:
        q: (B, Hq, Tq, D), fp16 / bf16 / fp32 (fp32 matmuls run as TF32 on GPU).
        k, v: (B, Hk, Tk, D), ``Tq <= Tk``, query ``i`` at position ``Tk - Tq + i``.
        depth_k, depth_v: (B, Hk, Tq, L, D), or a list of L (B, Hk, Tq, D)
            entries; any strides (read in place); L may be 0.
        variant: a variant with a supported structure and score (see
            :func:`unsupported_reason`); a depth bias is (L,) or (Hq, L) and
            may require grad.
        scale: logit scale.
        config: a launch hook for tuning, ``config(kernel, default) -> config``
            (see :data:`ConfigHook`), applied to the forward and backward
            launches of this call; eager calls only.

    Returns:
        out (B, Hq, Tq, D) in q's dtype and lse (B, Hq, Tq) float32, natural
        log, ``-inf`` (and a zero output) for a row that sees no key, NaN
        (in both) for a row whose query or a visible entry holds a NaN or Inf
        (:mod:`moda_flex.nonfinite`). Both are differentiable with respect to
        q, k, v, depth_k, depth_v and the depth bias.
    """
    s = variant.structure
    # Document ids with their runs, (3, Bd, Tk) int32, computed once where the variant was made.
    documents = None if s.documents is None else s.documents.packed.to(q.device)
    depth_k, depth_v = _as_list(depth_k), _as_list(depth_v)
    L = _num_slots(depth_k)
    depth_first = 0 if s.depth_window is None else max(0, L - s.depth_window)
    window = 0 if s.window is None else int(s.window)
    bias, softcap, bias_first = _score_args(variant.score, q.shape[1], L)
    opts = Options(float(scale), bool(s.causal), window, depth_first, bool(s.sequence), float(softcap), bias_first)
    if torch.compiler.is_compiling():
        if config is not None:
            raise ValueError("config= tunes eager calls; torch.compile traces the op with the default launches")
        return torch.ops.moda_flex.triton_forward(q, k, v, depth_k, depth_v, documents, bias, *opts)
    # Eager: the same kernels behind a plain autograd.Function, without the
    # dispatcher round trips of a custom op (the call is host-bound at short lengths).
    return _EagerMoDA.apply(q, k, v, documents, bias, opts, config, len(depth_k), *depth_k, *depth_v)


# moda_attention hands this backend the per-slot form as it is, without stacking.
triton_attention.reads_depth_entries = True


PATH_ENV = "MODA_FLEX_TRITON_PATH"
_PATHS = ("auto", "generic", "hopper")
# The Hopper path loses to the generic one with depth (H100, BENCHMARKS.md): a call takes it only when asked.
_DEFAULT_PATH = "generic"
# Below this many scores (B * Hq * Tq * Tk) a call is bound by the host, where building the descriptors
# costs about 50 us per forward + backward: auto keeps the generic path.
_HOPPER_MIN_SCORES = 1 << 28


def _hopper(*tensors: Tensor) -> bool:
    """Whether a launch over ``tensors`` (q, k, ...) takes the Hopper path.

    ``auto``: on a GPU of compute capability 9.x, for calls of
    at least ``_HOPPER_MIN_SCORES`` scores. The tensors must suit tensor
    descriptors either way: 16-bit floats (or any float under the
    interpreter), a head dim the kernels need not pad (a power of two, 16 to
    128), unit last stride, 16-byte aligned base and strides.
    """
    path = os.environ.get(PATH_ENV, _DEFAULT_PATH)
    if path not in _PATHS:
        raise ValueError(f"{PATH_ENV}={path!r}: expected one of {', '.join(_PATHS)}")
    q = tensors[0]
    if path == "generic":
        return False
    if path == "auto":
        scores = q.shape[0] * q.shape[1] * q.shape[2] * tensors[1].shape[2]
        if not (q.is_cuda and _capability(q.device)[0] == 9 and scores >= _HOPPER_MIN_SCORES):
            return False
    if q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
        return False
    D = q.shape[-1]
    return _head_dim(D) == D <= 128 and all(_descriptor_ok(t) for t in tensors)


def _descriptor_ok(t: Tensor) -> bool:
    """Whether a tensor descriptor may cover ``t``: unit last stride, 16-byte aligned base and other strides."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1])


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _row_descriptor(t: Tensor, G: int, GP: int, block_t: int):
    """A descriptor over (B, Hq, T, D) queries (or dO) seen as (B, Hk, T, G, D), boxes (1, 1, block_t, GP, D).

    A box holds a block's rows in the kernels' order (token-major, the G heads
    of a token together); heads past G and tokens past T are out of bounds and
    read as zeros.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, Hq, T, D = t.shape
    sb, sh, st, sd = t.stride()
    return TensorDescriptor(t, [B, Hq // G, T, G, D], [sb, G * sh, st, sh, sd], [1, 1, block_t, GP, D])


def _tile_descriptor(t: Tensor, block_n: int):
    """A descriptor over (B, Hk, Tk, D) keys or values, boxes (1, 1, block_n, D)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_n, t.shape[-1]])


def _as_list(depth: DepthKV) -> list[Tensor]:
    """The op's form of depth K/V: ``[(B, Hk, Tq, L, D)]`` or L entries (B, Hk, Tq, D)."""
    return [depth] if isinstance(depth, Tensor) else list(depth)


def _is_slab(depth: list[Tensor]) -> bool:
    """True when the op's depth list holds one (B, Hk, Tq, L, D) tensor rather than L entries."""
    return len(depth) == 1 and depth[0].dim() == 5


def _num_slots(depth: list[Tensor]) -> int:
    return depth[0].shape[3] if _is_slab(depth) else len(depth)


def _slot_table(depth_k: list[Tensor], depth_v: list[Tensor], L: int, device: torch.device):
    """Addresses of the L key slots then the L value slots, (2L,) int64 on the device, and each side's strides.

    Returns:
        table, key strides (b, h, t, d), value strides (b, h, t, d), and the
        tensors the addresses point into. Entries of one side that disagree on
        strides are copied to contiguous ones first: the caller must hold the
        returned tensors until the kernel is launched.
    """
    addresses, strides, held = [], [], []
    for depth in (depth_k, depth_v):
        if _is_slab(depth):
            t = depth[0]  # (B, Hk, Tq, L, D): slot l sits l slot-strides after slot 0
            step = t.stride(3) * t.element_size()
            addresses += range(t.data_ptr(), t.data_ptr() + L * step, step) if step else [t.data_ptr()] * L
            strides.append((t.stride(0), t.stride(1), t.stride(2), t.stride(4)))
            continue
        strides_seen = {t.stride() for t in depth}
        if len(strides_seen) > 1:
            depth = [t.contiguous() for t in depth]
            strides_seen = {t.stride() for t in depth}
        addresses += [t.data_ptr() for t in depth]
        strides.append(strides_seen.pop() if strides_seen else (0, 0, 0, 0))
        held.append(depth)
    return _device_table(tuple(addresses or [0]), device), strides[0], strides[1], held


# Pinned host copies of the slot tables, by device and addresses. A CUDA graph captures a table's copy from
# its host buffer and replays it, with the addresses the graph's memory keeps: the buffer must outlive the graph
# and never change, so each set of addresses has one, kept (a model meets few: the allocator reuses addresses).
_HOST_TABLES: dict = {}


def _device_table(addresses: tuple, device: torch.device) -> Tensor:
    """(len(addresses),) int64 on ``device``, copied without a wait from a pinned buffer cached by its contents."""
    if device.type != "cuda":
        return torch.tensor(addresses, dtype=torch.int64)
    key = (device, addresses)
    host = _HOST_TABLES.get(key)
    if host is None:
        host = _HOST_TABLES[key] = torch.tensor(addresses, dtype=torch.int64).pin_memory()
    return host.to(device, non_blocking=True)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Options(NamedTuple):
    """A call's non-tensor arguments, in the order the ops take them."""

    scale: float
    causal: bool
    window: int  # 0: unbounded
    depth_first: int  # the first visible depth slot
    sequence: bool  # False: no sequence keys (depth-only)
    softcap: float  # 0.0: no cap
    bias_first: bool  # the depth bias is added before the cap


# A launch hook: ``config(kernel, default) -> config``, with ``kernel`` one of
# "fwd", "dq", "dkdv" and ``default`` the launch options the launcher would use
# (block sizes, num_warps, num_stages, and the flags TMA, LOOP_STAGES, WS,
# DQ_ATOMIC of :func:`_config`), a fresh dict. Turning TMA on is the hook's to
# check: the tensors must allow descriptors (:func:`_hopper`).
ConfigHook = Callable[[str, dict], dict]


def _config(q: Tensor, G: int, which: str, hook: Optional[ConfigHook], has_depth: bool = True,
            programs: int = 0, hopper: bool = False) -> dict:  # fmt: skip
    """Block sizes and launch options for ``which`` in {"fwd", "dkdv", "dq"}, through ``hook`` if given.

    ``programs``: for "dkdv", the number of (key block, batch x KV head)
    programs at the default BLOCK_N = 128; fewer than the GPU has SMs halves
    the key blocks. The generic configurations were chosen on an H200 at
    T=16384, G=8, D=64 (benchmarks/tune_moda.py, benchmarks/NOTES.md).

    ``hopper``: the Hopper path's configuration, the one with ``TMA`` on. The
    flags: ``TMA`` (tensor descriptors for the tiles of the unmasked blocks),
    ``LOOP_STAGES`` (the software pipeline's depth on that loop), for "fwd"
    ``WS`` (warp specialization of that loop, off; Triton 3.6 does not
    compile it for this kernel on sm_90), and for "dkdv" ``DQ_ATOMIC``: 0 (the
    default, deterministic), dQ from its own kernel; 1 or 2, the dK/dV kernel
    adds the sequence part of dQ to float32 sums with atomics (1: per
    element; 2: by the TMA engine's bulk reductions, with ``TMA``, on a GPU
    only), which saves two of the backward's seven matrix products but makes
    dQ's last bits vary between runs.
    """
    few = which == "dkdv" and q.device.type == "cuda" and programs < _sm_count(q.device)
    sm90 = q.is_cuda and _capability(q.device)[0] == 9
    cfg = _config_for(q.device.type, _head_dim(q.shape[-1]), G, which, has_depth, few, hopper, sm90)
    return cfg if hook is None else hook(which, dict(cfg))


def depth_utilization(q: Tensor, G: int, L: int) -> float:
    """Useful / computed MACs of the forward's depth phase, for queries like ``q`` (device, D) and G, L.

    A tile of ``R = max(pow2(G), 16)`` rows (``P = R / pow2(G)`` tokens)
    meets P tokens x BLOCK_S slots; each row keeps its own token's BLOCK_S
    columns.
    """
    block_c = _config(q, G, "fwd", None)["BLOCK_C"]
    rows = max(_next_pow2(G), _MIN_DOT_ROWS)
    block_s = block_c // (rows // _next_pow2(G))
    return G / rows * L / (block_s * math.ceil(L / block_s))


def _head_dim(D: int) -> int:
    """The kernels' padded head dim: D rounded up to a power of two, at least 16 (the least K of a dot)."""
    return max(_MIN_DOT_ROWS, _next_pow2(D))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _config_for(device_type: str, head_dim: int, G: int, which: str, has_depth: bool, few_programs: bool,
                hopper: bool, sm90: bool) -> dict:  # fmt: skip
    GP = _next_pow2(G)
    if device_type != "cuda":
        # The interpreter: few, small programs.
        cfg = dict(BLOCK_M=max(16, GP), BLOCK_N=16, BLOCK_C=16)
    elif hopper:
        cfg = _sm90_config(head_dim, which, has_depth, few_programs)
    else:
        cfg = _generic_config(head_dim, which, has_depth, few_programs, sm90)
    cfg["BLOCK_M"] = max(cfg["BLOCK_M"], GP, _MIN_DOT_ROWS)
    cfg.update(TMA=hopper, LOOP_STAGES=cfg.get("num_stages", 1))
    if which == "fwd":
        cfg["WS"] = False
    if which == "dkdv":
        cfg["DQ_ATOMIC"] = 0
    return cfg


def _generic_config(head_dim: int, which: str, has_depth: bool, few_programs: bool, sm90: bool) -> dict:
    """Block sizes, warps and stages of the generic path on a GPU (``sm90``: of compute capability 9.x)."""
    if which == "fwd" and has_depth:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_C=32, num_warps=4, num_stages=3)
    elif which == "fwd":
        cfg = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_C=32, num_warps=8, num_stages=3)
    elif which == "dkdv":
        cfg = dict(BLOCK_M=128, BLOCK_N=64 if few_programs else 128, num_warps=8, num_stages=2)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_C=32, num_warps=4, num_stages=3)
    if head_dim == 128 and which == "fwd" and sm90:
        # 128-row tiles over 8 warps: 0.50-0.81x the time of the 64-row ones on an H100 (BENCHMARKS.md);
        # two stages of them need an H100's shared memory.
        cfg.update(BLOCK_M=128, BLOCK_C=16, num_warps=8, num_stages=2)
    elif head_dim == 128:
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], 64)
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    elif head_dim > 128:  # 256: tiles that fit the registers and shared memory
        cfg.update(BLOCK_M=min(cfg["BLOCK_M"], 64), BLOCK_N=min(cfg["BLOCK_N"], 32), num_stages=1)
        if "BLOCK_C" in cfg:
            cfg["BLOCK_C"] = 16
    return cfg


# The Hopper path's launches by (head dim up to 64 / 128, kernel, with depth), before the dK/dV kernel's
# few-programs rule: the tiles that compile for sm_90 (Triton 3.6) without spilling registers, or with the
# fewest spills (D=128 with depth); benchmarks/NOTES.md ("Hopper path") has the compile table.
_SM90 = {
    (64, "fwd", False): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_C=32, num_warps=8, num_stages=3),
    (64, "fwd", True): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_C=16, num_warps=8, num_stages=2),
    (64, "dq", False): dict(BLOCK_M=128, BLOCK_N=64, BLOCK_C=32, num_warps=8, num_stages=3),
    (64, "dq", True): dict(BLOCK_M=128, BLOCK_N=64, BLOCK_C=16, num_warps=8, num_stages=3),
    (64, "dkdv", False): dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
    (128, "fwd", False): dict(BLOCK_M=128, BLOCK_N=64, BLOCK_C=16, num_warps=8, num_stages=3),
    (128, "fwd", True): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_C=16, num_warps=8, num_stages=2),
    (128, "dq", False): dict(BLOCK_M=128, BLOCK_N=64, BLOCK_C=16, num_warps=8, num_stages=2),
    (128, "dq", True): dict(BLOCK_M=128, BLOCK_N=64, BLOCK_C=16, num_warps=8, num_stages=2),
    (128, "dkdv", False): dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2),
}


def _sm90_config(head_dim: int, which: str, has_depth: bool, few_programs: bool) -> dict:
    """Block sizes, warps and stages of the Hopper path (head_dim a power of two, 16 to 128)."""
    cfg = dict(_SM90[64 if head_dim <= 64 else 128, which, has_depth and which != "dkdv"])
    if which == "dkdv" and few_programs:
        cfg["BLOCK_N"] = 64
    return cfg


def _placeholder(device: torch.device) -> Tensor:
    """A never-read int32 pointer argument for a launch without documents or bias.

    Made per launch, not cached: a tensor first made while a CUDA graph is
    recorded lives in the graph's memory pool, and one kept beyond the graph
    fails ``torch.compile(mode="reduce-overhead")``.
    """
    return torch.empty(1, dtype=torch.int32, device=device)


def _strides(prefix: str, strides: Sequence[int], axes: str) -> dict:
    """A tensor's stride arguments by name: ``_strides("sq", q.stride(), "bhtd")`` gives sqb, sqh, sqt, sqd."""
    return dict(zip(_stride_names(prefix, axes), strides))


@functools.lru_cache(maxsize=None)
def _stride_names(prefix: str, axes: str) -> tuple[str, ...]:
    return tuple(prefix + axis for axis in axes)


def _layout_args(q: Tensor, k: Tensor) -> dict:
    """The row layout's constants: G query heads per KV head, G rounded up to GP, the padded and real head dim."""
    G, D = q.shape[1] // k.shape[1], q.shape[-1]
    return dict(G=G, GP=_next_pow2(G), HEAD_DIM=_head_dim(D), D_REAL=D)


def _mask_args(opts: Options, documents: Optional[Tensor], like: Tensor) -> dict:
    """The sequence mask's arguments: window, flags, and the (3, Bd, Tk) packed documents with their batch stride."""
    if documents is None:
        ids = lo = hi = _placeholder(like.device)
        sdoc = 0
    else:
        ids, lo, hi = documents[0], documents[1], documents[2]
        sdoc = documents.stride(1) if documents.shape[1] > 1 else 0
    return dict(DOC_IDS=ids, DOC_LO=lo, DOC_HI=hi, sdoc=sdoc, window=opts.window,
                CAUSAL=opts.causal, WINDOW=opts.window > 0, DOC=documents is not None)  # fmt: skip


def _bias_args(bias: Optional[Tensor], like: Tensor) -> dict:
    """The depth bias's arguments: a float32 copy on the device and its (head, slot) strides.

    A (L,) bias gets head stride 0: every head reads it. The copy is in the
    returned dict, which the caller holds until the kernel is launched.
    """
    if bias is None:
        return dict(BIAS=_placeholder(like.device), sbh=0, sbl=0, HAS_BIAS=False)
    f32 = bias.detach().to(device=like.device, dtype=torch.float32)
    sbh, sbl = (0, f32.stride(0)) if f32.dim() == 1 else f32.stride()
    return dict(BIAS=f32, sbh=sbh, sbl=sbl, HAS_BIAS=True)


def _depth_args(depth_k: list[Tensor], depth_v: list[Tensor], L: int, like: Tensor):
    """The depth slots' arguments (address tables and strides), and the tensors to hold until the launch."""
    table, sdk, sdv, held = _slot_table(depth_k, depth_v, L, like.device)
    return dict(DK_TAB=table, DV_TAB=table[L:], **_strides("sdk", sdk, "bhtd"), **_strides("sdv", sdv, "bhtd")), held


def _forward(q, k, v, depth_k, depth_v, documents, bias, opts: Options, config: Optional[ConfigHook] = None):
    """Launch the forward kernel.

    Args:
        q: (B, Hq, Tq, D); k, v: (B, Hk, Tk, D).
        depth_k, depth_v: the op's depth lists (:func:`_as_list`).
        documents: (3, Bd, Tk) int32 packed documents, or None.
        bias: the (L,) or (Hq, L) depth bias, or None.
        opts: the call's options; config: the launch hook, or None.

    Returns:
        out (B, Hq, Tq, D) contiguous and lse (B, Hq, Tq) float32.
    """
    from . import kernels

    B, Hq, Tq, _ = q.shape
    Hk, Tk, L = k.shape[1], k.shape[2], _num_slots(depth_k)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, Hq, Tq), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    layout = _layout_args(q, k)
    has_depth = L > opts.depth_first
    cfg = _config(q, layout["G"], "fwd", config, has_depth=has_depth, hopper=_hopper(q, k, v))
    depth, _held = _depth_args(depth_k, depth_v, L, q)  # _held: alive until launched
    block_t = cfg["BLOCK_M"] // layout["GP"]
    grid = (_cdiv(Tq, block_t), B * Hk)
    tiles = dict(QD=None, KD=None, VD=None)
    if cfg["TMA"]:
        tiles = dict(QD=_row_descriptor(q, layout["G"], layout["GP"], block_t),
                     KD=_tile_descriptor(k, cfg["BLOCK_N"]), VD=_tile_descriptor(v, cfg["BLOCK_N"]))  # fmt: skip
    kernels._fwd_kernel[grid](
        Q=q, K=k, V=v, O=out, LSE=lse, **tiles, **depth, **_mask_args(opts, documents, q), **_bias_args(bias, q),
        **_strides("sq", q.stride(), "bhtd"), **_strides("sk", k.stride(), "bhtd"),
        **_strides("sv", v.stride(), "bhtd"), **_strides("so", out.stride(), "bhtd"),
        **_strides("sl", lse.stride(), "bht"),
        Hk=Hk, Tq=Tq, Tk=Tk, L=L, depth_first=opts.depth_first, qk_scale=opts.scale * _LOG2E, softcap=opts.softcap,
        **layout, DEPTH_ROWS=max(layout["GP"], _MIN_DOT_ROWS),
        HAS_SEQ=opts.sequence and Tk > 0, HAS_DEPTH=has_depth,
        HAS_SOFTCAP=opts.softcap > 0, BIAS_FIRST=opts.bias_first,
        **cfg,
    )
    return out, lse


def _backward(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad: bool,
              opts: Options, config: Optional[ConfigHook] = None):  # fmt: skip
    """Launch the backward: the dQ kernel, then the dK/dV kernel.

    Args:
        grad_out: (B, Hq, Tq, D) contiguous; grad_lse: (B, Hq, Tq) or None.
        q, k, v, depth_k, depth_v, documents, bias, opts, config: as for :func:`_forward`.
        out, lse: the forward's results.
        bias_grad: also compute the bias's gradient.

    Returns:
        dq (B, Hq, Tq, D), dk, dv (B, Hk, Tk, D), the depth gradients as two
        (B, Hk, Tq, L, D) tensors, and the bias's gradient in its shape and
        dtype with ``bias_grad`` (else an empty tensor).
    """
    B, Hq, Tq, D = q.shape
    Hk, Tk, L = k.shape[1], k.shape[2], _num_slots(depth_k)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    dbias = q.new_zeros(0) if not bias_grad else torch.zeros_like(bias)
    if q.numel() == 0 or k.numel() == 0:
        depth_shape = (B, Hk, Tq, L, D)
        return (torch.zeros_like(q, memory_format=torch.contiguous_format), dk.zero_(), dv.zero_(),
                q.new_zeros(depth_shape), q.new_zeros(depth_shape), dbias)  # fmt: skip
    hopper, G = _hopper(q, k, v, grad_out), Hq // Hk
    dq_cfg = _config(q, G, "dq", config, has_depth=L > opts.depth_first, hopper=hopper)
    dkdv_cfg = _config(q, G, "dkdv", config, programs=_cdiv(Tk, 128) * B * Hk, hopper=hopper)
    sequence = opts.sequence and Tk > 0
    atomic = sequence and dkdv_cfg["DQ_ATOMIC"]
    # The dQ kernel runs first: it also writes delta = rowsum(dO * O) - dLSE, which the dK/dV kernel reads,
    # and for its descriptors, which blocks of rows have a dead one. With DQ_ATOMIC it writes only the depth
    # part of dQ, as float32 sums to which the dK/dV kernel adds the sequence part.
    dq, ddk, ddv, delta, gbias, dead = _launch_dq(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse,
                                                  documents, bias, bias_grad, opts, dq_cfg,
                                                  dead_flags=dkdv_cfg["TMA"], sums=atomic)  # fmt: skip
    if sequence:
        _launch_dkdv(grad_out, q, k, v, lse, delta, dead, documents, dk, dv, dq if atomic else None, opts, dkdv_cfg)
    else:
        dk.zero_()
        dv.zero_()
    if atomic:
        dq = dq.to(q.dtype)
    if gbias is not None:
        dbias = _reduce_bias_grad(gbias, bias, B, Hk, Hq // Hk)
    return dq, dk, dv, ddk, ddv, dbias


def _launch_dq(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad, opts, cfg,
               dead_flags, sums):  # fmt: skip
    """The dQ kernel under launch configuration ``cfg``: dq, the depth gradients, delta for the dK/dV kernel, the
    bias's gradient in parts or None, and with ``dead_flags`` whether each block of rows has a dead one,
    (B * Hk, blocks) int8, else None. With ``sums``, dq is only the depth part, float32, for the dK/dV kernel
    to add the sequence part to."""
    from . import kernels

    B, Hq, Tq, D = q.shape
    Hk, Tk, L = k.shape[1], k.shape[2], _num_slots(depth_k)
    layout = _layout_args(q, k)
    has_depth = L > opts.depth_first
    dq = torch.empty_like(q, memory_format=torch.contiguous_format, dtype=torch.float32 if sums else q.dtype)
    alloc = torch.zeros if opts.depth_first > 0 else torch.empty  # masked slots get a zero gradient
    ddk = alloc((B, Hk, Tq, L, D), device=q.device, dtype=q.dtype)
    ddv = alloc((B, Hk, Tq, L, D), device=q.device, dtype=q.dtype)
    delta = torch.empty_like(lse)
    glse = delta if grad_lse is None else grad_lse.float().contiguous()
    depth, _held = _depth_args(depth_k, depth_v, L, q)  # _held: alive until launched
    grid = (_cdiv(Tq, cfg["BLOCK_M"] // layout["GP"]), B * Hk)
    tiles = dict(KD=None, VD=None)
    if cfg["TMA"]:
        tiles = dict(KD=_tile_descriptor(k, cfg["BLOCK_N"]), VD=_tile_descriptor(v, cfg["BLOCK_N"]))
    # Each program's part of the bias gradient, summed over its tokens, (B * Hk, blocks, GP, L).
    with_bias_grad = bias_grad and has_depth
    gbias = q.new_zeros((B * Hk, grid[0], layout["GP"], L) if with_bias_grad else (0,), dtype=torch.float32)
    dead = torch.empty((B * Hk, grid[0]), device=q.device, dtype=torch.int8) if dead_flags else None
    kernels._bwd_dq_kernel[grid](
        Q=q, K=k, V=v, O=out, DO=grad_out, LSE=lse, GLSE=glse, DELTA=delta, DEAD=dead, DEAD_FLAGS=dead_flags,
        DQO=dq, DDKO=ddk, DDVO=ddv, GBIAS=gbias,
        **tiles, **depth, **_mask_args(opts, documents, q), **_bias_args(bias, q),
        **_strides("sq", q.stride(), "bhtd"), **_strides("so", out.stride(), "bhtd"),
        **_strides("sk", k.stride(), "bhtd"), **_strides("sv", v.stride(), "bhtd"),
        **_strides("sdo", grad_out.stride(), "bhtd"), **_strides("sl", lse.stride(), "bht"),
        **_strides("sgq", dq.stride(), "bhtd"), **_strides("sgd", ddk.stride(), "bhtld"),
        Hk=Hk, Tq=Tq, Tk=Tk, L=L, depth_first=opts.depth_first, scale=opts.scale,
        qk_scale=opts.scale * _LOG2E, softcap=opts.softcap,
        **layout, DEPTH_ROWS=max(layout["GP"], _MIN_DOT_ROWS),
        HAS_SEQ=opts.sequence and Tk > 0 and not sums, HAS_DEPTH=has_depth, HAS_GLSE=grad_lse is not None,
        HAS_SOFTCAP=opts.softcap > 0, BIAS_FIRST=opts.bias_first, BIAS_GRAD=with_bias_grad,
        **cfg,
    )
    return dq, ddk, ddv, delta, gbias if with_bias_grad else None, dead


def _launch_dkdv(grad_out, q, k, v, lse, delta, dead, documents, dk, dv, dq_sums, opts, cfg) -> None:
    """The dK/dV kernel under launch configuration ``cfg``: writes dk, dv (B, Hk, Tk, D), contiguous, from delta
    and (with ``cfg["TMA"]``) the dead-row flags of the dQ kernel; with ``cfg["DQ_ATOMIC"]`` also adds the
    sequence part of dQ to ``dq_sums`` (B, Hq, Tq, D) float32."""
    from . import kernels

    B, Hk, Tk = k.shape[0], k.shape[1], k.shape[2]
    layout = _layout_args(q, k)
    grid = (_cdiv(Tk, cfg["BLOCK_N"]), B * Hk)
    tiles = dict(QD=None, DOD=None, DEAD=None, dead_blocks=0)
    if cfg["TMA"]:
        block_t = cfg["BLOCK_M"] // layout["GP"]
        tiles = dict(QD=_row_descriptor(q, layout["G"], layout["GP"], block_t),
                     DOD=_row_descriptor(grad_out, layout["G"], layout["GP"], block_t),
                     DEAD=dead, dead_blocks=dead.shape[1])  # fmt: skip
    sums = dict(DQA=_placeholder(q.device), DQD=None, sab=0, sah=0, sat=0)
    if dq_sums is not None:
        sums = dict(DQA=dq_sums, DQD=None, **_strides("sa", dq_sums.stride()[:3], "bht"))
        if cfg["DQ_ATOMIC"] == 2:
            sums["DQD"] = _row_descriptor(dq_sums, layout["G"], layout["GP"], cfg["BLOCK_M"] // layout["GP"])
    kernels._bwd_dkdv_kernel[grid](
        Q=q, K=k, V=v, DO=grad_out, LSE=lse, DELTA=delta, DKO=dk, DVO=dv, **tiles, **sums,
        **_mask_args(opts, documents, q),
        **_strides("sq", q.stride(), "bhtd"), **_strides("sk", k.stride(), "bhtd"),
        **_strides("sv", v.stride(), "bhtd"), **_strides("sdo", grad_out.stride(), "bhtd"),
        **_strides("sl", lse.stride(), "bht"), **_strides("sg", dk.stride(), "bhtd"),
        Hk=Hk, Tq=q.shape[2], Tk=Tk, scale=opts.scale, qk_scale=opts.scale * _LOG2E, softcap=opts.softcap,
        **layout, HAS_SOFTCAP=opts.softcap > 0,
        **cfg,
    )


def _reduce_bias_grad(parts: Tensor, bias: Tensor, B: int, Hk: int, G: int) -> Tensor:
    """The depth bias's gradient in its shape and dtype from the dQ kernel's (B * Hk, blocks, GP, L) parts."""
    grad = parts.view(B, Hk, -1, *parts.shape[2:]).sum(dim=(0, 2))[:, :G]  # (Hk, G, L)
    grad = grad.reshape(Hk * G, -1)  # (Hq, L): query head h = hk * G + g
    return (grad.sum(0) if bias.dim() == 1 else grad).to(device=bias.device, dtype=bias.dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- torch.library ops -------------------------------------------------------------------------
# The non-tensor arguments are :class:`Options`, spelled out. ``bias`` is the (L,) or (Hq, L)
# depth bias or None; the backward computes its gradient only with ``bias_grad``.


def _interpreter_upcast(tensors, depth_k, depth_v):
    """The Triton interpreter computes bfloat16 dots wrongly: on CPU run bfloat16 in float32."""
    if tensors[0].device.type == "cpu" and tensors[0].dtype == torch.bfloat16:
        return [t.float() for t in tensors], [t.float() for t in depth_k], [t.float() for t in depth_v], torch.bfloat16
    return tensors, depth_k, depth_v, None


def _run_forward(q, k, v, depth_k, depth_v, documents, bias, *options, config=None):
    (q, k, v), depth_k, depth_v, cast = _interpreter_upcast([q, k, v], depth_k, depth_v)
    out, lse = _forward(q, k, v, depth_k, depth_v, documents, bias, Options(*options), config)
    return (out if cast is None else out.to(cast)), lse


def _run_backward(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad, *options,
                  config=None):  # fmt: skip
    (grad_out, q, k, v, out), depth_k, depth_v, cast = _interpreter_upcast([grad_out, q, k, v, out], depth_k, depth_v)
    *grads, dbias = _backward(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad,
                              Options(*options), config)  # fmt: skip
    return (*grads, dbias) if cast is None else (*(g.to(cast) for g in grads), dbias)


class _EagerMoDA(torch.autograd.Function):
    """The eager path: forward and backward kernels with autograd's bookkeeping and nothing more.

    ``depth`` is the key entries then the value entries, ``n_depth`` of each.
    """

    @staticmethod
    def forward(ctx, q, k, v, documents, bias, opts, config, n_depth, *depth):
        depth_k, depth_v = list(depth[:n_depth]), list(depth[n_depth:])
        out, lse = _run_forward(q, k, v, depth_k, depth_v, documents, bias, *opts, config=config)
        ctx.save_for_backward(q, k, v, out, lse, documents, bias, *depth)
        ctx.num_depth, ctx.options, ctx.config = n_depth, opts, config
        ctx.bias_grad = ctx.needs_input_grad[4]
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        run_backward = functools.partial(_run_backward, config=ctx.config)
        dq, dk, dv, ddk, ddv, _, dbias = _autograd_backward(ctx, grad_out, grad_lse, run_backward)[:7]
        return dq, dk, dv, None, dbias, None, None, None, *ddk, *ddv


# Registered with torch.library.define / impl: the kernels run as they are. (A
# torch.library.custom_op wraps them in a Python check over every input tensor,
# which costs more than the kernels at the 2L depth entries of a model's call.)
torch.library.define(
    "moda_flex::triton_forward",
    "(Tensor q, Tensor k, Tensor v, Tensor[] depth_k, Tensor[] depth_v, Tensor? documents, Tensor? bias, "
    "float scale, bool causal, int window, int depth_first, bool sequence, float softcap, bool bias_first) "
    "-> (Tensor, Tensor)",
)
torch.library.define(
    "moda_flex::triton_backward",
    "(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor[] depth_k, Tensor[] depth_v, "
    "Tensor out, Tensor lse, Tensor? documents, Tensor? bias, bool bias_grad, float scale, bool causal, int window, "
    "int depth_first, bool sequence, float softcap, bool bias_first) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)


@torch.library.impl("moda_flex::triton_forward", ("cuda", "cpu"))
def _forward_op(q, k, v, depth_k, depth_v, documents, bias, *options):
    """out (B, Hq, Tq, D) and lse (B, Hq, Tq) float32."""
    return _run_forward(q, k, v, depth_k, depth_v, documents, bias, *options)


@torch.library.register_fake("moda_flex::triton_forward")
def _forward_fake(q, k, v, depth_k, depth_v, documents, bias, *options):
    B, Hq, Tq, D = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, Hq, Tq), dtype=torch.float32)


@torch.library.impl("moda_flex::triton_backward", ("cuda", "cpu"))
def _backward_op(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad, *options):
    """dq, dk, dv, the depth gradients as two (B, Hk, Tq, L, D) tensors whatever the depth form, and the bias's.

    The bias's gradient has its shape with ``bias_grad``, else it is empty.
    """
    return _run_backward(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad, *options)


@torch.library.register_fake("moda_flex::triton_backward")
def _backward_fake(grad_out, grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, bias_grad, *options):
    fmt = torch.contiguous_format
    B, Hk, Tq, D = k.shape[0], k.shape[1], q.shape[2], q.shape[3]
    depth_shape = (B, Hk, Tq, _num_slots(depth_k), D)
    return (
        torch.empty_like(q, memory_format=fmt),
        torch.empty_like(k, memory_format=fmt),
        torch.empty_like(v, memory_format=fmt),
        q.new_empty(depth_shape),
        q.new_empty(depth_shape),
        torch.empty_like(bias) if bias_grad else q.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, depth_k, depth_v, documents, bias, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, documents, bias, *depth_k, *depth_v)
    ctx.num_depth = len(depth_k)
    ctx.options = tuple(options)
    # Not ctx.needs_input_grad: here it lists the flattened inputs, whose positions move with the depth entries.
    ctx.bias_grad = bias is not None and bias.requires_grad


def _autograd_backward(ctx, grad_out, grad_lse, run_backward=None):
    """Gradients of q, k, v, depth_k, depth_v (depth in its input form), documents (None), the bias, the options.

    The eager path's backward too. The kernels' gradients have no graph: a backward under create_graph=True
    is refused, rather than return second derivatives that are silently wrong.
    """
    refuse_create_graph("triton")
    (q, k, v, out, lse, documents, bias), depth = ctx.saved_tensors[:7], ctx.saved_tensors[7:]
    depth_k, depth_v = list(depth[: ctx.num_depth]), list(depth[ctx.num_depth :])
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    run_backward = run_backward or torch.ops.moda_flex.triton_backward
    dq, dk, dv, ddk, ddv, dbias = run_backward(
        grad_out.contiguous(), grad_lse, q, k, v, depth_k, depth_v, out, lse, documents, bias, ctx.bias_grad,
        *ctx.options,
    )
    grads = (dq, dk, dv, _depth_grads(ddk, depth_k), _depth_grads(ddv, depth_v), None, dbias if ctx.bias_grad else None)
    return grads + (None,) * len(ctx.options)


def _depth_grads(grad: Tensor, depth: list[Tensor]) -> list[Tensor]:
    """(B, Hk, Tq, L, D) depth gradient in the form of the depth input: itself, or one view per entry."""
    return [grad] if _is_slab(depth) else list(grad.unbind(3))


torch.library.register_autograd("moda_flex::triton_forward", _autograd_backward, setup_context=_setup_context)
