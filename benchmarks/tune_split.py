"""Launch options of the split path's depth kernels: forward + backward of one call per option, one table.

Each row times ``backend="split"`` (bf16, causal) with the depth kernels'
tokens per program (a multiple of the least that fills 16 rows), warps and
stages overridden; the sequence part is the same in every row. Median ms of
``triton.testing.do_bench``. Every option compiles both depth kernels again,
so keep the grid small (the default's is 9 options a shape).

Usage::

    python benchmarks/tune_split.py --shapes table6,16k
    python benchmarks/tune_split.py --shapes 64k --tokens 1,2 --warps 2,4 --stages 1,2
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

from moda_flex import moda_attention
from moda_flex.backends.split import ops

from bench_split import SHAPES, _bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--shapes", default="table6,16k", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--tokens", type=cli.int_list, default="1,2,4", help="multiples of the least tokens a program")
    p.add_argument("--warps", type=cli.int_list, default="2,4,8", help="warps a program")
    p.add_argument("--stages", type=cli.int_list, default="1", help="software pipeline stages")
    args = p.parse_args(argv)
    cli.require_cuda(p, "tune_split.py")
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
        for tokens, warps, stages in itertools.product(args.tokens, args.warps, args.stages):
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
