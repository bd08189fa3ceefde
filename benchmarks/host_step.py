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
alternating runs (on a 2-core machine a run's MoDA layer moves by tens of
us from the next's: compare medians of several).

Both models are compiled and warmed up first (compilation included in the
warm-up); then the arms take turns, ``--rounds`` times, each timing
``--steps`` steps: the table gives each arm's median over the rounds and
each round's MoDA layer over the baseline.

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


def _profiled(step, steps: int) -> dict:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    return pstats.Stats(profiler).stats


def measure(layers: int, steps: int, warmup: int, rounds: int, compiler: str, profile: bool) -> dict:
    """Each arm's median ms per step in each of ``rounds`` rounds (the arms take turns: a busy machine slows
    both alike), and with ``profile`` its cProfile statistics over ``steps`` steps."""
    from host_split import _median_us, launches_stubbed

    arms = ("none", "attn")
    with launches_stubbed():
        steps_of = {arm: _model_step(arm, layers, compiler) for arm in arms}
        for step in steps_of.values():
            for _ in range(warmup):
                step()
        cpu = torch.device("cpu")
        rounds_ms = [{arm: _median_us(steps_of[arm], steps, cpu, calls=1) / 1e3 for arm in arms} for _ in range(rounds)]
        stats = {arm: _profiled(steps_of[arm], steps) for arm in arms} if profile else {}
    torch._dynamo.reset()
    return {"rounds": rounds_ms, "stats": stats}


def _own_times(stats: dict, steps: int) -> dict:
    """us of own time a step, by function."""
    return {f"{Path(file).name}:{line}({name})": 1e6 * own / steps for (file, line, name), (_, _, own, _, _) in stats.items()}


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--layers", type=cli.at_least(2), default=8, help="transformer blocks")
    p.add_argument("--steps", type=cli.at_least(1), default=40, help="timed steps per arm and round")
    p.add_argument("--rounds", type=cli.at_least(1), default=5, help="rounds in which the arms take turns")
    p.add_argument("--warmup", type=cli.at_least(1), default=3, help="untimed steps first, compilation included")
    p.add_argument("--compiler", default="inductor", help="torch.compile backend (aot_eager: no code generation)")
    p.add_argument("--profile", action="store_true", help="list the functions whose own time grows most with MoDA")
    args = p.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused kernel's CPU support; no kernel runs
    torch.set_num_threads(1)
    result = measure(args.layers, args.steps, args.warmup, args.rounds, args.compiler, args.profile)
    rounds = result["rounds"]
    base, moda = (statistics.median(r[arm] for r in rounds) for arm in ("none", "attn"))
    # the first block reads no depth: a MoDA layer's cost over the baseline's, each round's difference
    per_layer = [1e3 * (r["attn"] - r["none"]) / (args.layers - 1) for r in rounds]
    print(f"compiled ({args.compiler}) step on CPU, {args.layers} layers, Triton launches stubbed, "
          f"{args.rounds} rounds of {args.steps} steps an arm, torch {torch.__version__}")  # fmt: skip
    print("| model | ms a step (median of rounds) | us a MoDA layer over the baseline: median, rounds |\n|---|---|---|")
    print(f"| none | {base:.2f} | - |")
    print(f"| attn | {moda:.2f} | {statistics.median(per_layer):.0f} ({', '.join(f'{us:.0f}' for us in per_layer)}) |")
    if args.profile:
        before, after = (_own_times(result["stats"][arm], args.steps) for arm in ("none", "attn"))
        grown = sorted(((after.get(f, 0.0) - before.get(f, 0.0), f) for f in set(before) | set(after)), reverse=True)
        print("\nown time a step, MoDA over the baseline (cProfile):")
        for us, name in grown[:25]:
            print(f"  {us:8.1f} us  {name}")


if __name__ == "__main__":
    main()
