"""Launch options of the split path's depth kernels: forward + backward of one call per option, one table.

Each row times ``backend="split"`` (bf16, causal) with the depth kernels'
tokens per program (a multiple of the least that fills 16 rows), warps and
stages overridden; the sequence part is the same in every row. Median ms of
``triton.testing.do_bench``.

Usage::

    python benchmarks/tune_split.py --shapes table6,16k
"""

from __future__ import annotations

import argparse
import itertools

import torch

from moda_flex import moda_attention
from moda_flex.backends.split import ops

from bench_split import SHAPES, _bench


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="table6,16k", help=f"comma-separated, from {', '.join(SHAPES)}")
    args = p.parse_args(argv)
    default_layout = ops._layout
    print(f"device: {torch.cuda.get_device_name()}; split fwd+bwd, median ms")
    for name in args.shapes.split(","):
        B, Hq, Hk, T, D, L = SHAPES[name]
        torch.manual_seed(0)
        tensors = [torch.randn(*size, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for size in ((B, Hq, T, D), (B, Hk, T, D), (B, Hk, T, D), (B, Hk, T, L, D), (B, Hk, T, L, D))]
        grad = torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16)

        def call():
            torch.autograd.grad(moda_attention(*tensors, backend="split"), tensors, grad)

        results = []
        for tokens, warps, stages in itertools.product((1, 2, 4), (1, 2, 4, 8), (1, 2)):
            def layout(*a, tokens=tokens, warps=warps, stages=stages):
                chosen = default_layout(*a)
                return dict(chosen, BLOCK_T=chosen["BLOCK_T"] * tokens, num_warps=warps, num_stages=stages)

            ops._layout = layout
            try:
                results.append((_bench(call), tokens, warps, stages))
            except Exception as error:
                print(f"  tokens x{tokens} warps {warps} stages {stages}: {type(error).__name__}")
        ops._layout = default_layout
        default = _bench(call)
        results.sort()
        print(f"{name} {SHAPES[name]}: default {default:.3f} ms; best: "
              + "; ".join(f"{ms:.3f} (tokens x{t}, {w} warps, {s} stages)" for ms, t, w, s in results[:5]), flush=True)


if __name__ == "__main__":
    main()
