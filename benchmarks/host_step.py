"""The host's share of a compiled training step, on CPU: the baseline against MoDA with every Triton launch stubbed.

In a model compiled in the default mode a MoDA step is bound by the host
(BENCHMARKS.md). This measures the host's part without a GPU: the example
GPT, compiled with ``fullgraph=True``, takes forward + backward steps on
CPU at a tiny shape (so the baseline's own kernels cost little) with MoDA's
attention on the fused kernel's ops (``backend="triton"``, what ``auto``
runs in a compiled model's default mode) and every Triton launch stubbed
out (:func:`host_split.launches_stubbed`): the MoDA row's time over the
baseline's is the Python, allocations and dispatch MoDA adds. With
``--profile`` it also lists the functions whose own time (cProfile) grows
most from the baseline's step to MoDA's.

A CPU's host is not a GPU machine's (the H100 machine's runs this Python
about 2x slower), and CUDA adds its own costs (allocations, copies,
launches): use it to compare two versions of the code on one machine, in
alternating runs (on a 2-core machine one run's MoDA layer moves by 100
us or more from the next's: compare medians of several).

Median ms per step of the timed steps after warm-up (compilation included
in the warm-up).

Usage::

    python benchmarks/host_step.py
    python benchmarks/host_step.py --layers 16 --profile
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402


def _model_step(depth_kv: str, layers: int, compiler: str):
    """One step of a tiny post-norm GPT (width 96, 6/2 heads, B=1, T=8), compiled by ``compiler``."""
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(n_layer=layers, n_embd=96, n_head=6, n_kv_head=2, norm="post", depth_kv=depth_kv,
                       block_size=8, backend="auto" if depth_kv == "none" else "triton")  # fmt: skip
    model = GPT(config)
    run = torch.compile(model, fullgraph=True, backend=compiler)
    idx = torch.randint(0, config.vocab_size, (1, 8))

    def step():
        _, loss = run(idx, idx)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def measure(layers: int, steps: int, warmup: int, compiler: str, profile: bool) -> dict:
    """ms per step of each arm, and with ``profile`` each arm's cProfile statistics over ``steps`` steps."""
    from host_split import launches_stubbed

    result = {}
    for arm in ("none", "attn"):
        step = _model_step(arm, layers, compiler)
        with launches_stubbed():
            for _ in range(warmup):
                step()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            stats = None
            if profile:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(steps):
                    step()
                profiler.disable()
                stats = pstats.Stats(profiler).stats
        result[arm] = (1e3 * statistics.median(times), stats)
        torch._dynamo.reset()
    return result


def _own_times(stats: dict, steps: int) -> dict:
    """us of own time a step, by function."""
    return {f"{Path(file).name}:{line}({name})": 1e6 * own / steps for (file, line, name), (_, _, own, _, _) in stats.items()}


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--layers", type=cli.at_least(2), default=8, help="transformer blocks")
    p.add_argument("--steps", type=cli.at_least(1), default=40, help="timed steps per arm")
    p.add_argument("--warmup", type=cli.at_least(1), default=3, help="untimed steps first, compilation included")
    p.add_argument("--compiler", default="inductor", help="torch.compile backend (aot_eager: no code generation)")
    p.add_argument("--profile", action="store_true", help="list the functions whose own time grows most with MoDA")
    args = p.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused kernel's CPU support; no kernel runs
    torch.set_num_threads(1)
    result = measure(args.layers, args.steps, args.warmup, args.compiler, args.profile)
    (base, base_stats), (moda, moda_stats) = result["none"], result["attn"]
    print(f"compiled ({args.compiler}) step on CPU, {args.layers} layers, Triton launches stubbed, torch {torch.__version__}")
    print("| model | ms a step | us a MoDA layer over the baseline |\n|---|---|---|")
    print(f"| none | {base:.2f} | - |")
    print(f"| attn | {moda:.2f} | {1e3 * (moda - base) / (args.layers - 1):.0f} |")  # the first block reads no depth
    if args.profile:
        before, after = _own_times(base_stats, args.steps), _own_times(moda_stats, args.steps)
        grown = sorted(((after.get(f, 0.0) - before.get(f, 0.0), f) for f in set(before) | set(after)), reverse=True)
        print("\nown time a step, MoDA over the baseline (cProfile):")
        for us, name in grown[:25]:
            print(f"  {us:8.1f} us  {name}")


if __name__ == "__main__":
    main()
