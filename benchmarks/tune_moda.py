"""Time the Triton kernels under candidate launch configurations (block sizes, warps, stages).

A row of every kernel at its default comes first. Each candidate then
replaces one kernel's configuration through the ``config=`` hook of
``moda_flex.backends.triton.triton_attention``; the others keep their
defaults. Prints forward and backward GPU times (ms: the kernels' own time,
from torch.profiler, not the wall time, which a short call spends on the
host) for L = 0 and L = ``--slots`` at one (B, Hk, T, G), after SDPA's cuDNN
kernel on the sequence part alone (the time a call without depth could take).
Usage::

    python benchmarks/tune_moda.py --seq 16384 --groups 8 --slots 64
    python benchmarks/tune_moda.py --batch 8 --kv-heads 4 --seq 1024 --groups 3 --slots 22 --kernels fwd,dq,dkdv   # a GPT-2-small layer
    python benchmarks/tune_moda.py --batch 8 --kv-heads 4 --seq 1024 --groups 3 --slots 22 --head-dim 128 --kernels dkdv
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moda_flex import causal
from moda_flex.backends.blocks import next_pow2
from moda_flex.backends.triton import triton_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402
from bench_model import gpu_profile, kernel_events  # noqa: E402

CANDIDATES = {
    "fwd": [
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_C=32, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_C=16, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=64, BLOCK_C=32, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_C=32, num_warps=8, num_stages=3),
        # short calls (a model layer at T ~ 1024): more, smaller programs
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_C=32, num_warps=4, num_stages=3),
        dict(BLOCK_M=32, BLOCK_N=64, BLOCK_C=16, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=64, BLOCK_C=16, num_warps=4, num_stages=2),
    ],
    "dq": [
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_C=32, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_C=16, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=64, BLOCK_C=32, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_C=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=32, BLOCK_N=64, BLOCK_C=16, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_C=32, num_warps=8, num_stages=2),
        dict(BLOCK_M=128, BLOCK_N=32, BLOCK_C=32, num_warps=8, num_stages=3),
    ],
    "dkdv": [
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
        dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2),
        dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),  # the generic tiles at D=128 before 64 x 64
        # a query token's rows packed (G) or padded to a power of two (GP): the default is G up to D=64
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, ROW_G="GP"),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, ROW_G="GP"),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, ROW_G="G"),
        # dQ's sequence part added by the dK/dV kernel (float32 atomics, nondeterministic)
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, DQ_ATOMIC=1),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, DQ_ATOMIC=1),
    ],
}


def _timed(fn, repeats: int = 20) -> float:
    """The GPU time (ms) of one ``fn()``, its kernels' own time summed (torch.profiler) over ``repeats``
    after a warm-up: at a model layer's lengths a call's wall time is its host's, not its kernels'."""
    for _ in range(3):
        fn()
    return sum(e.self_device_time_total for e in kernel_events(gpu_profile(fn, repeats))) / repeats / 1e3


def _forward_backward_times(forward, leaves: tuple) -> tuple[float, float]:
    """GPU times (ms) of ``forward()`` without autograd and of its backward into ``leaves``."""
    with torch.no_grad():
        fwd = _timed(forward)
    out = forward()
    do = torch.randn_like(out)
    bwd = _timed(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
    return fwd, bwd


def _sequence_inputs(B, Hk, T, G, D) -> tuple:
    """Random bf16 q (B, Hk * G, T, D) and k, v (B, Hk, T, D) on the GPU, requiring gradients."""
    torch.manual_seed(0)
    q = torch.randn(B, Hk * G, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, Hk, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, v


def _times(B, Hk, T, G, D, L, config):
    """Forward and backward GPU times (ms) of one call with L depth slots under the launch hook ``config``."""
    q, k, v = _sequence_inputs(B, Hk, T, G, D)
    # (B, Hk, T, L, D) views of larger buffers, as a depth stream's prefix
    dk, dv = (torch.randn(B, Hk, T, L + 16, D, device="cuda", dtype=q.dtype)[:, :, :, :L].requires_grad_()
              for _ in range(2))  # fmt: skip
    leaves = (q, k, v, dk, dv)
    return _forward_backward_times(
        lambda: triton_attention(*leaves, causal(), 1 / math.sqrt(D), config=config)[0], leaves
    )


def _cudnn_times(B, Hk, T, G, D):
    """Forward and backward GPU times (ms) of SDPA's cuDNN kernel on the sequence part alone, GQA unexpanded."""
    leaves = _sequence_inputs(B, Hk, T, G, D)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return _forward_backward_times(
            lambda: F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True), leaves
        )


def _replacing(which: str, candidate: dict, G: int):
    """A launch hook that gives kernel ``which`` the ``candidate`` configuration (BLOCK_M at least pow2(G);
    a ``ROW_G`` of "G" or "GP" is G or pow2(G))."""
    GP = next_pow2(G)
    rows = {"G": G, "GP": GP}

    def config(kernel: str, default: dict) -> dict:
        if kernel != which:
            return default
        chosen = {**default, **candidate, "BLOCK_M": max(candidate["BLOCK_M"], GP)}
        if "ROW_G" in candidate:
            chosen["ROW_G"] = rows[candidate["ROW_G"]]
        return chosen

    return config


def main(argv=None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--batch", type=cli.at_least(1), default=1, help="B")
    parser.add_argument("--kv-heads", type=cli.at_least(1), default=8, help="Hk")
    parser.add_argument("--seq", type=int, default=16384, help="T")
    parser.add_argument("--groups", type=int, default=8, help="G = Hq / Hk")
    parser.add_argument("--slots", type=int, default=64, help="L depth entries per token")
    parser.add_argument("--head-dim", type=cli.at_least(1), default=64, help="D")
    parser.add_argument("--kernels", type=cli.choice_list(CANDIDATES), default="fwd,dq",
                        help=f"comma-separated, from {', '.join(CANDIDATES)}")  # fmt: skip
    args = parser.parse_args(argv)
    cli.require_cuda(parser, "tune_moda.py")
    shape = (args.batch, args.kv_heads, args.seq, args.groups, args.head_dim)
    print(f"{torch.cuda.get_device_name()}  B={args.batch} Hk={args.kv_heads} T={args.seq} G={args.groups} "
          f"D={args.head_dim} L=0/{args.slots}; GPU ms a call (kernel time, torch.profiler)")  # fmt: skip
    print(f"{'kernel':>6} {'config':<62} {'fwd L0':>8} {'bwd L0':>8} {'fwd L':>8} {'bwd L':>8}")
    f0, b0 = _cudnn_times(*shape)
    print(f"{'cudnn':>6} {'SDPA, sequence only':<62} {f0:8.3f} {b0:8.3f}", flush=True)
    rows = [("all", "the defaults (configs.py)", None)]
    rows += [(which, str(cand), _replacing(which, cand, args.groups)) for which in args.kernels
             for cand in CANDIDATES[which]]  # fmt: skip
    for which, name, config in rows:
        try:
            f0, b0 = _times(*shape, 0, config)
            f1, b1 = _times(*shape, args.slots, config)
            print(f"{which:>6} {name:<62} {f0:8.3f} {b0:8.3f} {f1:8.3f} {b1:8.3f}", flush=True)
        except Exception as err:  # a candidate that does not compile or fit is reported, not fatal
            print(f"{which:>6} {name:<62} failed: {type(err).__name__}: {str(err)[:80]}", flush=True)


if __name__ == "__main__":
    main()
