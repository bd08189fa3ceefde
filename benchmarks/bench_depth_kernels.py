"""The split path's depth kernels alone, as a model's layer calls them: each kernel's own GPU time.

One call of the split path's forward and backward (``moda_flex.backends.split.ops``; bf16, causal, random
inputs laid out as the example GPT's layers make them, (B, T, H, D) in memory: heads after tokens, the
gradient in the output's layout) with the depth as L entries of their own, as a model's stream holds them,
and the depth gradients added in place into a (2, B, Hk, T, L, D) gradient buffer, as a stream's readers add them
(:mod:`moda_flex.backends.chain`). Per row: the depth forward's and the depth backward's own GPU time
(``torch.profiler``, the mean over 10 calls after one), the backward call's time replayed from a CUDA graph
(the vendor's backward with it), the same call writing the buffer without adding (what the addend costs),
what the depth backward's copies for the vendor cost (its time less the same kernel's told that the call has
no sequence part, which writes none), and the bytes each depth kernel moves a call over its time, against the
copy bandwidth in the header.

Usage::

    python benchmarks/bench_depth_kernels.py                         # the Table 6 call at L = 24 and 47
    python benchmarks/bench_depth_kernels.py --shapes table6,16k --slots 12,24
    ncu --kernel-name regex:"depth_(forward|backward)" --launch-skip 4 --launch-count 2 \\
        python benchmarks/bench_depth_kernels.py --slots 12 --calls-only     # Nsight Compute, a later call of each

``--calls-only``: each shape's forward and backward called three times in turn, nothing timed and no
profiler, for a profiler of one's own (Nsight Compute fixes the clocks, so its durations are not the rows').
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from moda_flex.backends.split import ops, sequence

from bench_call import copy_bandwidth
from bench_split import SHAPES, _bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402


def kernel_us(call, name: str, calls: int = 10) -> float:
    """The mean GPU time (us) a call of ``call`` spends in kernels whose name holds ``name``, after one call."""
    call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if name in e.key) / calls


def forward_bytes(B: int, Hq: int, Hk: int, T: int, D: int, L: int) -> int:
    """What the depth forward moves a call in bf16: the entries, q and the sequence part's output read, the
    merged output written (the lse's 4 bytes a row left out)."""
    return 2 * (2 * B * Hk * T * L * D + 3 * B * Hq * T * D)


def backward_bytes(B: int, Hq: int, Hk: int, T: int, D: int, L: int) -> int:
    """What the depth backward moves a call in bf16: the entries read, the buffer read and written, q, o and
    dO read and written again for the vendor's backward, k and v read and written sanitized, dq written."""
    entries = 2 * B * Hk * T * L * D
    rows = B * Hq * T * D
    return 2 * (3 * entries + 6 * rows + 4 * B * Hk * T * D + rows)


def calls(shape: tuple) -> tuple:
    """A call of ``shape`` (B, Hq, Hk, T, D, L) on random inputs: the forward, a function that makes the
    backward (adding the depth gradients into the buffer, or with ``add=False`` writing them; ``options``: the
    call's, or others), and the call's options."""
    B, Hq, Hk, T, D, L = shape
    torch.manual_seed(0)

    def randn(*size):
        return torch.randn(*size, device="cuda", dtype=torch.bfloat16)

    def heads(H):  # a (B, H, T, D) view of (B, T, H, D) memory, the model's: the forward 2-6% slower (BENCHMARKS.md)
        return randn(B, T, H, D).transpose(1, 2)

    q, k, v = heads(Hq), heads(Hk), heads(Hk)
    depth_k, depth_v = [heads(Hk) for _ in range(L)], [heads(Hk) for _ in range(L)]
    opts = ops.Options(D**-0.5, True, True, 0, sequence.kernel_for(q.device, D, True))
    buffer = randn(2, B, Hk, T, L, D)

    def forward():
        return ops._forward(q, k, v, depth_k, depth_v, opts)

    out, lse = forward()
    grad = torch.randn_like(out)  # the output's layout, as a model's output projection sends it back

    def backward(add=True, options=opts):
        return lambda: ops._backward(grad, None, q, k, v, depth_k, depth_v, out, lse, options, into=buffer, add=add)

    return forward, backward, opts


def measure(shape: tuple) -> dict:
    B, Hq, Hk, T, D, L = shape
    forward, backward, opts = calls(shape)
    forward_kernel, backward_kernel = kernel_us(forward, "depth_forward"), kernel_us(backward(), "depth_backward")
    without_copies = kernel_us(backward(options=opts._replace(sequence=False)), "depth_backward")
    return {
        "forward us": forward_kernel,
        "backward us": backward_kernel,
        "copies us": backward_kernel - without_copies,
        "backward call us": _bench(backward(), graph=True) * 1e3,
        "written call us": _bench(backward(add=False), graph=True) * 1e3,
        "forward TB/s": forward_bytes(B, Hq, Hk, T, D, L) / forward_kernel / 1e6,
        "backward TB/s": backward_bytes(B, Hq, Hk, T, D, L) / backward_kernel / 1e6,
    }


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--shapes", default="table6", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--slots", type=cli.int_list, default="24,47", help="L of each shape's calls")
    p.add_argument("--calls-only", action="store_true", help="call each kernel three times, time nothing")
    args = p.parse_args(argv)
    cli.require_cuda(p, "bench_depth_kernels.py")
    if args.calls_only:
        for name in args.shapes.split(","):
            for L in args.slots:
                forward, backward, _ = calls((*SHAPES[name][:-1], L))
                for _ in range(3):
                    forward()
                    backward()()
        torch.cuda.synchronize()
        return
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
          f"{copy_bandwidth() / 1e12:.2f} TB/s; bf16, causal, the buffer added in place")
    columns = ("forward us", "backward us", "copies us", "backward call us", "written call us", "forward TB/s",
               "backward TB/s")  # fmt: skip
    print("| shape | L | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for name in args.shapes.split(","):
        for L in args.slots:
            row = measure((*SHAPES[name][:-1], L))
            print(f"| {name} | {L} | " + " | ".join(f"{row[c]:.1f}" if "us" in c else f"{row[c]:.2f}" for c in columns)
                  + " |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
