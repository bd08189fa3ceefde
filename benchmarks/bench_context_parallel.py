"""Context-parallel MoDA across the GPUs of one host against MoDA on one GPU.

Forward and forward + backward of ``context_parallel_moda_attention`` at T
tokens over all ranks (T / world per GPU, the zigzag split), and of
``moda_attention`` on rank 0 alone at each ``--single-seq-len``. B=1, causal,
random inputs; median of repeats after warm-up; a context-parallel time is the
slowest rank's. ``tokens/s/GPU`` counts forward + backward; the last column
divides each forward + backward time by the one-GPU run at ``T / world``.

Usage::

    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py                # T=131072 on 2 GPUs vs T=65536 on 1
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --single-seq-len 65536,131072
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --device cpu \\
        --seq-len 256 --single-seq-len 128 --kv-heads 2 --groups 2 --slots 4 --head-dim 16   # gloo, tiny
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moda_flex import context_parallel_moda_attention, moda_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402


def _inputs(args, tokens: int, device, dtype, seed: int) -> list[torch.Tensor]:
    """q (1, Hq, tokens, D), k, v (1, Hk, tokens, D), depth_k, depth_v (1, Hk, tokens, L, D), all leaves."""
    generator = torch.Generator(device=device).manual_seed(seed)
    Hk, D = args.kv_heads, args.head_dim
    shapes = [(1, Hk * args.groups, tokens, D), (1, Hk, tokens, D), (1, Hk, tokens, D),
              (1, Hk, tokens, args.slots, D), (1, Hk, tokens, args.slots, D)]  # fmt: skip
    return [
        torch.randn(shape, generator=generator, device=device, dtype=dtype).requires_grad_() for shape in shapes
    ]


def _time_ms(fn, device, warmup: int, repeats: int, group=None) -> float:
    """Median milliseconds of ``fn()``; with a group, the slowest rank's median."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group)
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median)


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _steps(attend, leaves):
    """(forward, forward + backward) closures over the same leaves."""
    grad_out = torch.randn_like(leaves[0])

    def forward():
        with torch.no_grad():
            attend(*leaves)

    def forward_backward():
        for t in leaves:
            t.grad = None
        attend(*leaves).backward(grad_out)

    return forward, forward_backward


def _row(name, gpus, tokens, fwd_ms, fwd_bwd_ms, peak_mib) -> dict:
    return {
        "config": name,
        "GPUs": gpus,
        "T": tokens,
        "T/GPU": tokens // gpus,
        "fwd ms": f"{fwd_ms:.2f}",
        "fwd+bwd ms": f"{fwd_bwd_ms:.2f}",
        "tokens/s/GPU": f"{tokens / gpus / (fwd_bwd_ms / 1e3):,.0f}",
        "peak MiB": "n/a" if peak_mib is None else f"{peak_mib:,.0f}",
    }


def _peak_mib(device):
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def main(argv=None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda: NCCL; cpu: gloo")
    parser.add_argument("--seq-len", type=int, default=131072, help="T over all ranks")
    parser.add_argument("--single-seq-len", default="65536", help="comma-separated T for one GPU; '' for none")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads Hk")
    parser.add_argument("--groups", type=int, default=8, help="G = Hq / Hk")
    parser.add_argument("--slots", type=int, default=64, help="L depth entries per token")
    parser.add_argument("--head-dim", type=int, default=64, help="D")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    parser.add_argument("--backend", default="auto", help="moda_attention backend")
    parser.add_argument("--variant", choices=["causal", "full"], default="causal", help="mask variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs (the median is reported)")
    args = parser.parse_args(argv)
    cli.check_device(parser, args.device)

    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    timing = dict(warmup=args.warmup, repeats=args.repeats)
    rows = []

    def context_parallel(*leaves):
        return context_parallel_moda_attention(*leaves, variant=args.variant, backend=args.backend)

    _reset_peak(device)
    forward, forward_backward = _steps(context_parallel, _inputs(args, args.seq_len // world, device, dtype, rank))
    fwd = _time_ms(forward, device, group=group, **timing)
    fwd_bwd = _time_ms(forward_backward, device, group=group, **timing)
    rows.append(_row("context parallel", world, args.seq_len, fwd, fwd_bwd, _peak_mib(device)))

    def one_gpu(*leaves):
        return moda_attention(*leaves, variant=args.variant, backend=args.backend)

    for tokens in [int(t) for t in args.single_seq_len.split(",") if t]:
        if rank == 0:
            _reset_peak(device)
            forward, forward_backward = _steps(one_gpu, _inputs(args, tokens, device, dtype, 0))
            fwd, fwd_bwd = _time_ms(forward, device, **timing), _time_ms(forward_backward, device, **timing)
            rows.append(_row("one GPU", 1, tokens, fwd, fwd_bwd, _peak_mib(device)))
            del forward, forward_backward
        dist.barrier(group)

    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
        print(f"# {name} x {world}, torch {torch.__version__}; B=1, Hk={args.kv_heads}, G={args.groups}, "
              f"L={args.slots}, D={args.head_dim}, {args.variant}, {str(dtype).replace('torch.', '')}, "
              f"backend {args.backend}; median ms (context parallel: slowest rank)")  # fmt: skip
        # The target's ratio: context parallel at T against one GPU at T / world (ideal: 2 for causal at 2x the
        # tokens, world = 2).
        same_share = [row for row in rows[1:] if row["T"] == rows[0]["T/GPU"]]
        for row in rows:
            ratio = float(row["fwd+bwd ms"]) / float(same_share[0]["fwd+bwd ms"]) if same_share else None
            row["fwd+bwd vs one GPU at T/GPU"] = "-" if ratio is None else f"{ratio:.2f}"
        columns = list(rows[0])
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        for row in rows:
            print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
