"""The example GPT's training step with this checkout's layers and with another checkout's, in one process.

A compiled step's time moves by 10-50% from one process to the next, even on
one machine (BENCHMARKS.md), more than most changes to the model's layers
are worth. This builds each model twice: with the blocks of this checkout's
``moda_flex/nn.py`` (``new``) and with those of another checkout's
(``old``, ``--old``), loaded as a module of this package, so every other
module, the kernels included, is this checkout's. Each is compiled as
``bench_model.py`` compiles it, then all are timed in turn, a share of the
steps a round (``bench_model.time_steps``). It prints each model's median
step and host time, its GPU kernels a step, and each round's ratios: MoDA
over the baseline within a checkout, new over old within an arm. With
``--kernels N`` it then lists, from each model's profile, the N kernels
whose GPU time a step moved most: for each arm from old to new, and for each
MoDA arm of this checkout from the baseline's step to its own.

Usage::

    git worktree add ../before HEAD~1
    python benchmarks/ab_nn.py --old ../before/moda_flex/nn.py --shape gpt2s
    python benchmarks/ab_nn.py --old ../before/moda_flex/nn.py --shape gpt2s --mode reduce-overhead --rounds 4
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import re
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402
import gpt  # noqa: E402
import moda_flex.nn  # noqa: E402

from bench_model import (  # noqa: E402
    ARMS, MODES, SHAPES, Case, gpu_profile, kernel_events, kernel_kind, prepare, round_ratios, time_steps,
)  # fmt: skip

OLD_MODULE = "moda_flex._nn_old"  # the name the other checkout's nn.py is loaded under


def load_nn(path: str) -> ModuleType:
    """The ``nn.py`` at ``path`` as a module of this package (its relative imports are this checkout's
    modules)."""
    spec = importlib.util.spec_from_file_location(OLD_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "moda_flex"
    sys.modules[OLD_MODULE] = module  # dataclasses resolve a class's annotations through its module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def blocks_of(module: ModuleType):
    """Inside the block, the example GPT builds its blocks from ``module``'s ``Block`` (one from before
    ``rotary``, the shared rotation table, is built without it: each block then makes its own rotation)."""
    default = gpt.Block
    takes_rotary = "rotary" in inspect.signature(module.Block).parameters
    gpt.Block = module.Block if takes_rotary else (lambda config, ffn_depth, rotary: module.Block(config, ffn_depth))
    try:
        yield
    finally:
        gpt.Block = default


def shown(ratios: list[float]) -> str:
    """Each round's ratio (:func:`bench_model.round_ratios`), and their median."""
    return " ".join(f"{r:.3f}" for r in ratios) + f"  median {statistics.median(ratios):.3f}"


def round_ms(chunks: list[dict], key: str = "times") -> list[float]:
    """Each round's median step (``times``) or issue time (``issued``) of a model's timed chunks, ms."""
    return [1e3 * statistics.median(chunk[key]) for chunk in chunks]


def kernel_us(step, steps: int = 3) -> dict[str, tuple[float, float]]:
    """Each kernel's GPU time (us) and launches a step over ``steps`` profiled steps, by name less inductor's
    trailing index (``triton_poi_fused_add_7`` and ``_9`` are one row: a compile numbers its kernels anew)."""
    rows: dict[str, tuple[float, float]] = {}
    for event in kernel_events(gpu_profile(step, steps)):
        name = re.sub(r"_\d+$", "", event.key) if kernel_kind(event.key) == "inductor" else event.key
        us, count = rows.get(name, (0.0, 0.0))
        rows[name] = (us + event.self_device_time_total / steps, count + event.count / steps)
    return rows


def kernel_moves(new: dict, old: dict, rows: int) -> list[str]:
    """Table rows (kernel, old us, new us, difference, launches) of the ``rows`` kernels (:func:`kernel_us`)
    whose time a step moved most from the ``old`` step to the ``new`` one, then of all kernels."""

    def row(name: str, n: tuple[float, float], o: tuple[float, float]) -> str:
        return f"| {name[:90]} | {o[0]:.1f} | {n[0]:.1f} | {n[0] - o[0]:+.1f} | {o[1]:.0f} -> {n[1]:.0f} |"

    def total(side: dict) -> tuple[float, float]:
        return (sum(us for us, _ in side.values()), sum(count for _, count in side.values()))

    zero = (0.0, 0.0)
    names = sorted(new.keys() | old.keys(), key=lambda n: -abs(new.get(n, zero)[0] - old.get(n, zero)[0]))
    return [row(n, new.get(n, zero), old.get(n, zero)) for n in names[:rows]] + [row("all", total(new), total(old))]


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--old", required=True, help="the other checkout's moda_flex/nn.py")
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt2s", help="model and batch shape")
    p.add_argument("--mode", choices=[m for m in MODES if m != "eager"], default="compiled", help="how the steps run")
    p.add_argument("--arms", type=cli.choice_list(ARMS), default="none,attn+ffn",
                   help=f"comma-separated depth_kv values, from {', '.join(ARMS)}")  # fmt: skip
    p.add_argument("--rounds", type=cli.at_least(1), default=6, help="rounds; each times every model in turn")
    p.add_argument("--steps", type=cli.at_least(1), default=8, help="timed steps a model a round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, compilation included")
    p.add_argument("--kernels", type=int, default=0, help="then list the N kernels that moved most (see above)")
    args = p.parse_args(argv)
    if not Path(args.old).is_file():
        p.error(f"--old {args.old}: no such file")
    cli.require_cuda(p, "ab_nn.py")
    checkouts = {"new": moda_flex.nn, "old": load_nn(args.old)}
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(args.arms))

    steps, profiled, kernels = {}, {}, {}
    for arm in args.arms:
        for name, module in checkouts.items():
            start = time.perf_counter()
            with blocks_of(module):
                step = steps[arm, name] = prepare(Case(arm, args.mode, "auto", "auto"), SHAPES[args.shape], args.warmup)
            profiled[arm, name] = kernel_us(step)
            kernels[arm, name] = round(sum(count for _, count in profiled[arm, name].values()))
            print(f"  {arm} {name}: compiled in {time.perf_counter() - start:.0f} s, {kernels[arm, name]} kernels "
                  "a step", flush=True)  # fmt: skip
    chunks = {key: [] for key in steps}  # each model's timed steps, a chunk a round
    for _ in range(args.rounds):
        for key, step in steps.items():
            chunks[key].append(time_steps(step, args.steps))

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, shape {args.shape}, {args.mode}, "
          f"{args.rounds} rounds of {args.steps} steps")  # fmt: skip
    print("| model | checkout | step (ms) | host (ms) | kernels a step | by round (ms) |")
    print("|---|---|---|---|---|---|")
    for (arm, name), timed in chunks.items():
        rounds, host = round_ms(timed), statistics.median(round_ms(timed, "issued"))
        print(f"| {arm} | {name} | {statistics.median(rounds):.2f} | {host:.2f} | {kernels[arm, name]} | "
              f"{' '.join(f'{t:.1f}' for t in rounds)} |")  # fmt: skip
    print()
    for arm in args.arms:
        print(f"  {arm}, new / old by round: {shown(round_ratios(chunks[arm, 'new'], chunks[arm, 'old']))}")
    if "none" in args.arms:
        for arm in (a for a in args.arms if a != "none"):
            for name in checkouts:
                ratios = round_ratios(chunks[arm, name], chunks["none", name])
                print(f"  {arm} / none, {name}, by round: {shown(ratios)}")
    if args.kernels:
        pairs = [(f"{arm}: old -> new", profiled[arm, "new"], profiled[arm, "old"]) for arm in args.arms]
        pairs += [(f"new: none -> {arm}", profiled[arm, "new"], profiled["none", "new"])
                  for arm in args.arms if arm != "none" and "none" in args.arms]  # fmt: skip
        for title, to, base in pairs:
            print(f"\n{title}, GPU us a step, the {args.kernels} kernels that moved most")
            print("| kernel | from | to | difference | launches |\n|---|---|---|---|---|")
            print("\n".join(kernel_moves(to, base, args.kernels)), flush=True)


if __name__ == "__main__":
    main()
