"""Which path a launch takes, and its launch configuration (block sizes, warps, stages, flags).

Two paths, chosen at launch (:func:`hopper_path`): the generic one (any CUDA
GPU, and the interpreter) and the Hopper one (compute capability 9.x, calls
large enough not to be bound by the host), which streams the tiles of the
unmasked blocks through tensor descriptors (the TMA copy engine) and launches
with configurations chosen for sm90. Both run the same kernels; the Hopper
parts sit behind constexpr flags of the launch configuration
(:func:`launch_config`). On an H100 the Hopper path is a few percent faster
without depth and slower with it (docs/speed.md, "The Hopper path
(opt-in)"), so it is opt-in: ``MODA_FLEX_TRITON_PATH=auto`` takes it on
Hopper GPUs for large calls, ``=hopper`` wherever the tensors allow
descriptors (the interpreter included); ``generic``, the default, never.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import torch
from torch import Tensor

from ..blocks import next_pow2

# The smallest M of a Tensor Core dot: the depth phase works on tiles of
# max(pow2(G), 16) rows, the rows of 16 / pow2(G) consecutive tokens when G < 16.
MIN_DOT_ROWS = 16

PATH_ENV = "MODA_FLEX_TRITON_PATH"
_PATHS = ("auto", "generic", "hopper")
# The Hopper path loses to the generic one with depth (H100, docs/speed.md, "The Hopper path (opt-in)"): a call
# takes it only when asked.
DEFAULT_PATH = "generic"
# Below this many scores (B * Hq * Tq * Tk) a call is bound by the host, where building the descriptors
# costs about 50 us per forward + backward: auto keeps the generic path.
_HOPPER_MIN_SCORES = 1 << 28


def padded_head_dim(D: int) -> int:
    """The kernels' padded head dim: D rounded up to a power of two, at least 16 (the least K of a dot)."""
    return max(MIN_DOT_ROWS, next_pow2(D))


def hopper_path(*tensors: Tensor) -> bool:
    """Whether a launch over ``tensors`` (q, k, ...) takes the Hopper path.

    ``auto``: on a GPU of compute capability 9.x, for calls of
    at least ``_HOPPER_MIN_SCORES`` scores. The tensors must suit tensor
    descriptors either way: 16-bit floats (or any float under the
    interpreter), a head dim the kernels need not pad (a power of two, 16 to
    128), unit last stride, 16-byte aligned base and strides.
    """
    path = os.environ.get(PATH_ENV, DEFAULT_PATH)
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
    return padded_head_dim(D) == D <= 128 and all(_descriptor_ok(t) for t in tensors)


def _descriptor_ok(t: Tensor) -> bool:
    """Whether a tensor descriptor may cover ``t``: unit last stride, 16-byte aligned base and other strides."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1])


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


# Forward calls of at most this many keys take key blocks of 64 (:func:`_generic_config`).
SHORT_KEYS = 1024

# A launch hook: ``config(kernel, default) -> config``, with ``kernel`` one of
# "fwd", "dq", "dkdv" and ``default`` the launch options the launcher would use
# (block sizes, num_warps, num_stages, and the flags TMA, LOOP_STAGES, WS,
# DQ_ATOMIC of :func:`launch_config`), a fresh dict. Turning TMA on is the hook's to
# check: the tensors must allow descriptors (:func:`hopper_path`).
ConfigHook = Callable[[str, dict], dict]


def launch_config(device: torch.device, head_dim: int, G: int, which: str, hook: Optional[ConfigHook],
                  has_depth: bool = True, programs: int = 0, hopper: bool = False,
                  keys: Optional[int] = None) -> dict:  # fmt: skip
    """Block sizes and launch options for ``which`` in {"fwd", "dkdv", "dq"} of a call on ``device`` with
    queries of ``head_dim``, through ``hook`` if given.

    ``programs``: for "dkdv", the number of (key block, batch x KV head)
    programs at BLOCK_N = 128; where a configuration takes key blocks of 128
    (the Hopper path, the generic one at head dims over 128), fewer programs
    than the GPU has SMs halve them. The generic configurations were chosen
    on an H200 at T=16384, G=8, D=64, the forward's and the dK/dV kernel's
    also at T=512-4096 and G=3 (docs/design-notes.md, "The fused kernel", "Tiles by call").

    ``keys``: for "fwd", Tk: at most :data:`SHORT_KEYS` take key blocks of 64
    on the generic path (None: not known to be short).

    ``hopper``: the Hopper path's configuration, the one with ``TMA`` on. The
    flags: ``TMA`` (tensor descriptors for the tiles of the unmasked blocks),
    ``LOOP_STAGES`` (the software pipeline's depth on that loop), for "dkdv"
    ``ROW_G`` (the rows a query token takes: G, or GP with ``TMA``), for "fwd"
    ``WS`` (warp specialization of that loop, off; Triton 3.6 does not
    compile it for this kernel on sm_90), and for "dkdv" ``DQ_ATOMIC``: 0 (the
    default, deterministic), dQ from its own kernel; 1 or 2, the dK/dV kernel
    adds the sequence part of dQ to float32 sums with atomics (1: per
    element; 2: by the TMA engine's bulk reductions, with ``TMA``, on a GPU
    only), which saves two of the backward's seven matrix products but makes
    dQ's last bits vary between runs.
    """
    few = which == "dkdv" and device.type == "cuda" and programs < _sm_count(device)
    sm90 = device.type == "cuda" and _capability(device)[0] == 9
    short = which == "fwd" and keys is not None and keys <= SHORT_KEYS
    cfg = _config_for(device.type, padded_head_dim(head_dim), G, which, has_depth, few, short, hopper, sm90)
    return cfg if hook is None else hook(which, dict(cfg))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _config_for(device_type: str, head_dim: int, G: int, which: str, has_depth: bool, few_programs: bool,
                short_keys: bool, hopper: bool, sm90: bool) -> dict:  # fmt: skip
    GP = next_pow2(G)
    if device_type != "cuda":
        # The interpreter: few, small programs.
        cfg = dict(BLOCK_M=max(16, GP), BLOCK_N=16) | ({} if which == "dkdv" else dict(BLOCK_C=16))
    elif hopper:
        cfg = _sm90_config(head_dim, which, has_depth, few_programs)
    else:
        cfg = _generic_config(head_dim, which, has_depth, few_programs, short_keys, sm90)
    cfg["BLOCK_M"] = max(cfg["BLOCK_M"], GP, MIN_DOT_ROWS)
    cfg.update(TMA=hopper, LOOP_STAGES=cfg.get("num_stages", 1))
    if which == "fwd":
        cfg["WS"] = False
    if which == "dkdv":
        cfg["DQ_ATOMIC"] = 0
        # The rows a query token takes (kernels/common.py, block_rows): G, packed without padding, on the generic
        # path at head dims up to 64 (0.66-0.97x the backward's GPU time at G 3 and 5; 1.11x at D=128, where GP
        # stays); GP on the Hopper path, whose descriptors copy GP heads a token. H200, docs/design-notes.md, "The
        # fused kernel", "Packed rows in dK/dV".
        cfg["ROW_G"] = G if not hopper and head_dim <= 64 else GP
    return cfg


def _generic_config(head_dim: int, which: str, has_depth: bool, few_programs: bool, short_keys: bool,
                    sm90: bool) -> dict:  # fmt: skip
    """Block sizes, warps and stages of the generic path on a GPU (``sm90``: of compute capability 9.x)."""
    if which == "dkdv" and head_dim == 128 and sm90:
        # 64 query rows and keys over 4 warps, 3 stages: 0.89-0.98x the backward's GPU time of the tiles below at
        # T=512-4096, G 3 and 8 (H200, docs/design-notes.md, "The fused kernel", "Tiles by call").
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    if which == "fwd" and has_depth:
        # Short calls at D <= 64: key blocks of 64 waste less of the causal diagonal's block (0.90-0.94x the
        # forward's GPU time at T=512-1024; 0.98-1.01x at 2048-4096 and 1.07x at 16384, H200, docs/design-notes.md,
        # "The fused kernel", "Tiles by call").
        block_n = 64 if short_keys and head_dim <= 64 else 128
        cfg = dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_C=32, num_warps=4, num_stages=3)
    elif which == "fwd":
        cfg = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_C=32, num_warps=8, num_stages=3)
    elif which == "dkdv" and head_dim <= 64:
        # Keys in blocks of 64 over 4 warps: a backward in 0.73-0.96x the GPU time of the earlier tiles (keys in
        # blocks of 128, or 64 for few programs, over 8 warps) from T=1024 to 16384, G 3 and 8 (H200,
        # docs/design-notes.md, "The fused kernel", "Tiles by call").
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2)
    elif which == "dkdv":
        cfg = dict(BLOCK_M=128, BLOCK_N=64 if few_programs else 128, num_warps=8, num_stages=2)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_C=32, num_warps=4, num_stages=3)
    if head_dim == 128 and which == "fwd" and sm90:
        # 128-row tiles over 8 warps: 0.50-0.88x the time of the 64-row ones on an H100 (results/hopper_h100.md,
        # the generic-fwd-8w rows); two stages of them need an H100's shared memory.
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
# fewest spills (D=128 with depth).
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

