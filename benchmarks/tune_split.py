"""Launch options of the split path's depth kernels: forward + backward of one call per option, one table.

Each row times ``backend="split"`` (bf16, causal) with the depth kernels'
design (``tiles``: Tensor Core tiles; ``tokens``: per-token products), tokens
per program (a multiple of the design's default), warps, stages and, for
tiles, the slot chunk overridden; the sequence part is the same in every row.
Median ms of ``triton.testing.do_bench``, or with ``--graph`` of replays from
a CUDA graph (GPU time: what a CUDA-graphed step pays, where a short call's
host time would hide the kernels'). Every option compiles both depth kernels
again, so keep the grid small (the default's is 9 options a shape).

Usage::

    python benchmarks/tune_split.py --shapes table6,16k
    python benchmarks/tune_split.py --shapes 64k --tokens 1,2 --warps 2,4 --stages 1,2
    python benchmarks/tune_split.py --shapes table6 --slots 12,47 --chunks 16,32,64 --stages 1,2,3 --graph
    python benchmarks/tune_split.py --shapes table6,1k --designs tiles,tokens --tokens 1,2 --warps 2,4 --graph
    python benchmarks/tune_split.py --shapes table6 --slots 12,47 --backward-split 1,2 --tokens 1 --warps 4,8 --graph
    python benchmarks/tune_split.py --shapes table6 --slots 12,47 --tokens 1 --warps 4 --maxnreg 0,96/0,80/112 --graph
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

from moda_flex import moda_attention
from moda_flex.backends.split import ops

from bench_split import SHAPES, _bench, forward_backward, random_call, sdpa

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--shapes", default="table6,16k", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--designs", default="", help="comma-separated depth kernel designs (tiles, tokens); default: the chosen one")
    p.add_argument("--tokens", type=cli.int_list, default="1,2,4", help="multiples of the design's tokens a program")
    p.add_argument("--backward-split", type=cli.int_list, default="1",
                   help="divisors of the backward's tokens and warps a program (after --tokens, --warps); 2: half the "
                        "forward's, at the same entries a thread")
    p.add_argument("--warps", type=cli.int_list, default="2,4,8", help="warps a program")
    p.add_argument("--stages", type=cli.int_list, default="1", help="software pipeline stages")
    p.add_argument("--chunks", type=cli.int_list, default="0", help="(token, slot) columns a step (BLOCK_C); 0: the default")
    p.add_argument("--maxnreg", type=_register_caps, default="0",
                   help="register caps a thread, each N (both kernels) or F/B (forward, backward); 0: the layout's")
    p.add_argument("--slots", type=cli.int_list, default="0", help="L of each shape's calls; 0: the shape's")
    p.add_argument("--graph", action="store_true", help="time replays from a CUDA graph: GPU time")
    args = p.parse_args(argv)
    cli.require_cuda(p, "tune_split.py")
    default_layout = ops._layout
    print(f"device: {torch.cuda.get_device_name()}; split fwd+bwd, median ms" + (" of graph replays" if args.graph else ""))
    for name, slots in itertools.product(args.shapes.split(","), args.slots):
        *sizes, L = SHAPES[name]
        L = slots or L
        tensors, grad = random_call((*sizes, L))
        call = forward_backward(lambda *t: moda_attention(*t, backend="split"), tensors, grad)
        # the vendor's part alone: a row's depth part is its time minus this
        sequence_only = forward_backward(sdpa(SDPBackend.CUDNN_ATTENTION), tensors[:3], grad)

        results = []
        designs = args.designs.split(",") if args.designs else [None]
        options = (designs, args.tokens, args.backward_split, args.warps, args.stages, args.chunks, args.maxnreg)
        for option in itertools.product(*options):
            def layout(q, kv_heads, slots, backward=False, option=option):
                design, tokens, split, warps, stages, chunk, maxnreg = option
                chosen = default_layout(q, kv_heads, slots, backward, design=design)
                if chosen["design"] == "tiles":
                    chosen["BLOCK_C"] = chunk or chosen["BLOCK_C"]
                split, cap = (split, maxnreg[1]) if backward else (1, maxnreg[0])
                return dict(chosen, BLOCK_T=max(1, chosen["BLOCK_T"] * tokens // split),
                            num_warps=max(1, warps // split), num_stages=stages,
                            **({"maxnreg": cap} if cap else {}))  # fmt: skip

            ops._layout = layout
            try:
                results.append((_bench(call, args.graph), *option))
            except Exception as error:
                print(f"  {_describe(option)}: {type(error).__name__}: {str(error)[:160]}")
        ops._layout = default_layout
        default, vendor = _bench(call, args.graph), _bench(sequence_only, args.graph)
        results.sort()
        print(f"{name} L={L}: default {default:.3f} ms, cuDNN sequence-only {vendor:.3f}; best: "
              + "; ".join(f"{ms:.3f} ({_describe(option)})" for ms, *option in results[:8]), flush=True)


def _register_caps(text: str) -> list[tuple[int, int]]:
    """``"0,128,96/128"`` -> [(0, 0), (128, 128), (96, 128)]: (forward, backward) register caps."""
    caps = []
    for item in text.split(","):
        forward, _, backward = item.partition("/")
        caps.append((int(forward), int(backward or forward)))
    return caps


def _describe(option: tuple) -> str:
    design, tokens, split, warps, stages, chunk, maxnreg = option
    backward = f" (backward /{split})" if split > 1 else ""
    return (f"{design or 'default'}, tokens x{tokens}{backward}, {warps} warps, {stages} stages, "
            f"chunk {chunk or 'default'}, maxnreg {'/'.join(str(cap or '-') for cap in maxnreg)}")


if __name__ == "__main__":
    main()
