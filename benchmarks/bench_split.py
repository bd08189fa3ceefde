"""One MoDA call, forward + backward: the split path against the fused kernel and SDPA's sequence-only kernels.

Rows (bf16, causal, random inputs, median ms of ``triton.testing.do_bench``
after its warm-up, all in one run; with ``--graph``, of
``triton.testing.do_bench_cudagraph``: each call captured in a CUDA graph and
replayed, so the GPU's time without the host's, as a CUDA-graphed step sees it):

- ``split``: ``backend="split"``, the sequence part on cuDNN (compute capability 9.x);
- ``split/flash``: the same with cuDNN switched off (``sdpa_kernel``), the sequence part on FlashAttention;
- ``triton``: the fused kernel (``backend="triton"``);
- ``cudnn``, ``flash``: SDPA without depth (``enable_gqa=True``), the attention a user compares against;
- ``depth``: split minus cudnn, the depth part's cost, against its HBM floor: depth K and V read in the
  forward and the backward and both gradients written, ``12 * B * Hk * T * L * D`` bytes at the copy bandwidth.

Usage::

    python benchmarks/bench_split.py                   # the shapes of the issue's table
    python benchmarks/bench_split.py --shapes table6,1k
    python benchmarks/bench_split.py --shapes table6 --profile   # the split row's kernels (torch.profiler)
    python benchmarks/bench_split.py --shapes table6,1k --graph  # GPU time: calls replayed from CUDA graphs
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moda_flex import moda_attention

from bench_call import copy_bandwidth

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402

SHAPES = {  # B, Hq, Hk, T, D, L
    "table6": (32, 6, 2, 512, 64, 47),
    "1k": (1, 64, 8, 1024, 64, 64),
    "4k": (1, 64, 8, 4096, 64, 64),
    "16k": (1, 64, 8, 16384, 64, 64),
    "64k": (1, 64, 8, 65536, 64, 64),
}


def _bench(fn, graph: bool = False) -> float:
    """Median ms of ``fn``; with ``graph``, of its replays from a CUDA graph (the host's time left out)."""
    import triton.testing

    if graph:
        fn()  # the first call builds what a capture may not: compiled kernels, cached tables
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def random_call(shape: tuple) -> tuple[tuple, torch.Tensor]:
    """A call's leaves (q, k, v, depth_k, depth_v) of ``shape`` (B, Hq, Hk, T, D, L), random bf16 on CUDA (seed 0),
    and the output's gradient."""
    B, Hq, Hk, T, D, L = shape
    torch.manual_seed(0)

    def leaf(*size):
        return torch.randn(*size, device="cuda", dtype=torch.bfloat16).requires_grad_()

    leaves = (leaf(B, Hq, T, D), leaf(B, Hk, T, D), leaf(B, Hk, T, D), leaf(B, Hk, T, L, D), leaf(B, Hk, T, L, D))
    return leaves, torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16)


def forward_backward(run, tensors, grad):
    """A call of ``run(*tensors)`` and the gradients of its output against ``grad``, as one function to time."""

    def call():
        torch.autograd.grad(run(*tensors), tensors, grad)

    return call


def sdpa(*backend):
    """Causal GQA SDPA without depth, on the ``backend`` kernels only."""

    def run(q, k, v):
        with sdpa_kernel(list(backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return run


def measure(shape: tuple, bandwidth: float, profile: bool = False, graph: bool = False) -> dict:
    B, Hq, Hk, T, D, L = shape
    leaves, grad = random_call(shape)
    q, k, v = leaves[:3]

    def step(run, tensors):
        return forward_backward(run, tensors, grad)

    def flash_split(*tensors):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return moda_attention(*tensors, backend="split")

    rows = {
        "split": step(lambda *t: moda_attention(*t, backend="split"), leaves),
        "split/flash": step(flash_split, leaves),
        "triton": step(lambda *t: moda_attention(*t, backend="triton"), leaves),
        "cudnn": step(sdpa(SDPBackend.CUDNN_ATTENTION), (q, k, v)),
        "flash": step(sdpa(SDPBackend.FLASH_ATTENTION), (q, k, v)),
    }
    if profile:
        rows["split"]()
        with torch.profiler.profile() as prof:
            for _ in range(3):
                rows["split"]()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
    ms = {}
    for name, call in rows.items():
        try:
            ms[name] = _bench(call, graph)
        except Exception as error:  # a row that cannot run on this card says why, the others still run
            print(f"  {name}: {type(error).__name__}: {str(error)[:200]}")
            ms[name] = math.nan
    ms["depth"] = ms["split"] - ms["cudnn"]
    ms["depth floor"] = 12 * B * Hk * T * L * D / bandwidth * 1e3
    return ms


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--profile", action="store_true", help="print the split row's top kernels over 3 calls")
    p.add_argument("--graph", action="store_true", help="time replays of each call from a CUDA graph: GPU time")
    args = p.parse_args(argv)
    cli.require_cuda(p, "bench_split.py")
    bandwidth = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; bf16, causal, fwd+bwd, median ms"
          + (" of CUDA graph replays" if args.graph else ""))
    print("| shape | split | split/flash | triton | cudnn | flash | split / cudnn | triton / split | depth | depth floor "
          "| depth / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        m = measure(SHAPES[name], bandwidth, args.profile, args.graph)
        print(f"| {name} {SHAPES[name]} | {m['split']:.3f} | {m['split/flash']:.3f} | {m['triton']:.3f} | "
              f"{m['cudnn']:.3f} | {m['flash']:.3f} | {m['split'] / m['cudnn']:.2f} | {m['triton'] / m['split']:.2f} | "
              f"{m['depth']:.3f} | {m['depth floor']:.3f} | {m['depth'] / m['depth floor']:.2f} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
