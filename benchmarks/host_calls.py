"""The Python a compiled training step runs, counted: the baseline against MoDA, function by function.

A compiled step in the default mode is bound by the host on the GPU
machines, and their hosts' speed moves by 10-30% from run to run
(BENCHMARKS.md), more than one change to MoDA's launches is worth. A call
count does not move: this profiles (cProfile) the example GPT's compiled
step (forward, backward, fused AdamW, bf16 autocast; ``bench_model.py``'s
step) at a model's width and depth but a short sequence, and prints the
functions whose calls a step grows most from the baseline to MoDA, with
each one's calls a MoDA layer and its own time a call under the profiler
(which inflates every call alike: read the times as ranks, the counts as
they are). Beside them, the GPU kernels a step launches (torch.profiler),
each arm's total and the kernels whose launches a layer changed most, by
name: a launch is host time in a step the GPU waits for.

Usage::

    python benchmarks/host_calls.py --shape gpt2s
    python benchmarks/host_calls.py --shape table6 --layers 4 --arms none,attn --rows 40
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402

from bench_model import (  # noqa: E402
    ARMS, BACKENDS, SHAPES, Case, gpu_profile, host_profile, kernel_events, prepare, resized,
)  # fmt: skip


# The file a function of inductor's generated code is keyed by: each model's graphs are modules of their own
# (named by a hash), so a function like ``call``, the wrapper that launches a graph's kernels, is compared as
# the sum over a step's graphs.
GENERATED = "<inductor's generated code>"


def calls_a_step(step, steps: int) -> dict[tuple, tuple[float, float]]:
    """Each function's (calls, own seconds) a step over ``steps`` profiled steps, keyed by (file, line, name);
    the functions of inductor's generated code by (:data:`GENERATED`, 0, name)."""
    generated = cache_dir()
    rows = {}
    # pstats: {function: (primitive calls, calls, own time, cumulative, callers)}
    for (file, line, name), row in host_profile(step, steps).stats.items():
        key = (GENERATED, 0, name) if file.startswith(generated) else (file, line, name)
        calls, seconds = rows.get(key, (0.0, 0.0))
        rows[key] = (calls + row[1] / steps, seconds + row[2] / steps)
    return rows


def launches_a_step(step, steps: int) -> dict[str, float]:
    """Each GPU kernel's launches a step over ``steps`` profiled steps (:func:`bench_model.gpu_profile`), keyed
    by :func:`kernel_family`."""
    launches = {}
    for event in kernel_events(gpu_profile(step, steps)):
        family = kernel_family(event.key)
        launches[family] = launches.get(family, 0.0) + event.count / steps
    return launches


def kernel_family(name: str) -> str:
    """A kernel's name less the number inductor appends to its generated kernels (``triton_poi_fused_add_12``:
    ``triton_poi_fused_add``), which differs between two models' graphs for the same fused work."""
    return re.sub(r"_\d+$", "", name) if name.startswith("triton_") else name


def launch_growth(base: dict[str, float], moda: dict[str, float], layers: int) -> list[tuple[str, float]]:
    """(kernel, launches a layer that MoDA's step makes more than the baseline's, negative for fewer) for every
    kernel whose count differs, the largest change first."""
    rows = [(name, (moda.get(name, 0.0) - base.get(name, 0.0)) / layers) for name in {*base, *moda}]
    return sorted((row for row in rows if row[1]), key=lambda row: (-abs(row[1]), row[0]))


def growth(base: dict, moda: dict, layers: int) -> list[tuple]:
    """(function, extra calls a layer, own us a call in MoDA's step, extra own us a layer) for every function
    MoDA's step calls more often than the baseline's, and the generated code's functions whose own time grew,
    the most extra time first."""
    rows = []
    for function, (calls, seconds) in moda.items():
        base_calls, base_seconds = base.get(function, (0.0, 0.0))
        if calls > base_calls:
            rows.append((function, (calls - base_calls) / layers, 1e6 * seconds / calls,
                         1e6 * (seconds - base_seconds) / layers))  # fmt: skip
        elif function[0] == GENERATED and seconds > base_seconds:  # as many calls, each longer
            rows.append((function, 0.0, 1e6 * seconds / calls, 1e6 * (seconds - base_seconds) / layers))
    return sorted(rows, key=lambda row: -row[3])


def named(function: tuple) -> str:
    """A profiled function as ``file:line(name)``, the file's last two parts; a builtin by its name."""
    file, line, name = function
    if file == "~":  # a builtin
        return name
    if file == GENERATED:
        return f"{file}: {name}"
    return f"{'/'.join(Path(file).parts[-2:])}:{line}({name})"


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt2s", help="the model's width, heads and norm")
    p.add_argument("--layers", type=cli.at_least(2), default=4, help="transformer blocks (compile time grows with it)")
    p.add_argument("--seq", type=cli.at_least(1), default=64, help="tokens a sequence (short: the GPU waits)")
    p.add_argument("--arms", type=cli.choice_list(ARMS), default="none,attn+ffn",
                   help=f"comma-separated depth_kv values, from {', '.join(ARMS)}; the first is the base")  # fmt: skip
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="MoDA's backend")
    p.add_argument("--steps", type=cli.at_least(1), default=5, help="profiled steps")
    p.add_argument("--rows", type=cli.at_least(1), default=30, help="functions listed")
    args = p.parse_args(argv)
    cli.require_cuda(p, "host_calls.py")
    shape = resized(SHAPES[args.shape], args.layers, batch=1, seq=args.seq)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {shape}, compiled (default mode)")
    arms = args.arms

    profiles, launches = {}, {}
    for arm in arms:
        step = prepare(Case(arm, "compiled", "auto", "auto" if arm == "none" else args.backend), shape, warmup=3)
        profiles[arm] = calls_a_step(step, args.steps)
        launches[arm] = launches_a_step(step, args.steps)
        calls = sum(c for c, _ in profiles[arm].values())
        seconds = sum(s for _, s in profiles[arm].values())
        print(f"  {arm:9s} {calls:9.0f} Python calls a step, {1e3 * seconds:7.1f} ms own time under cProfile, "
              f"{sum(launches[arm].values()):5.0f} GPU kernels a step")  # fmt: skip

    base = profiles[arms[0]]
    for arm in arms[1:]:
        rows = growth(base, profiles[arm], args.layers)
        extra = sum(row[1] for row in rows)
        print(f"\n{arm} over {arms[0]}: {extra:.0f} more calls a layer ({args.layers} layers), "
              f"{sum(row[3] for row in rows):.0f} us more own time a layer under cProfile")  # fmt: skip
        print("| function | calls a layer | us a call | us a layer |")
        print("|---|---|---|---|")
        for function, calls, per_call, total in rows[: args.rows]:
            print(f"| `{named(function)}` | {calls:.1f} | {per_call:.1f} | {total:.0f} |")
        kernels = launch_growth(launches[arms[0]], launches[arm], args.layers)
        print(f"\n{arm} over {arms[0]}: {sum(n for _, n in kernels):.2f} more GPU kernels a layer")
        print("| kernel | launches a layer |\n|---|---|")
        for name, extra in kernels[: args.rows]:
            print(f"| `{name[:100]}` | {extra:+.2f} |")


if __name__ == "__main__":
    main()
