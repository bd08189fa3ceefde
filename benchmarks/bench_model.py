"""Training step of the example GPT: baseline against MoDA, eager and compiled.

For each model (``depth_kv`` = none / attn / attn+ffn) and mode (eager,
``torch.compile(model, fullgraph=True)``, and the same with
``mode="reduce-overhead"``: CUDA graphs) this times the full step (forward,
backward, fused AdamW) in bf16 autocast on random tokens: median of the timed
steps after warm-up (compilation included in the warm-up), tokens/s, and peak
memory over the timed steps. Ratios are to the compiled baseline of the same
run.

``host``: the median time the host takes to issue a step (``step()``
returning, before the synchronize). Where it is about the step's time, the
step is bound by the host: the GPU waits for launches. Each row's line
also says how many depth slot tables a timed step made (pinned host
buffers, :mod:`moda_flex.backends.slots`): none where every call found its
addresses from an earlier step.

``back to back``: the mean step of as many steps again, issued one after
another with one synchronize at the end: the GPU's pace where the host runs
ahead (a loop that reads no value a step). The timed step synchronizes every
step, as a loop that logs its loss every step does, so it also pays the host's
time from the step's start to its first kernel.

``floor``: the extra HBM bytes MoDA must move per step, over the bandwidth of
a device-to-device copy measured in the same run: every depth entry a layer
reads is read in the forward and in the backward, and its gradient written
(6 bytes-of-entry per read, bf16). ``base+floor`` is the compiled baseline
plus that time; ``/ (base+floor)`` how far a row is from it.

Usage::

    python benchmarks/bench_model.py --shape table6          # 24 layers, width 384, 6/2 heads, B=32, T=512
    python benchmarks/bench_model.py --shape gpt2s           # 12 layers, width 768, 12/4 heads, B=8, T=1024
    python benchmarks/bench_model.py --shape table6 --modes compiled --arms none,attn+ffn
    python benchmarks/bench_model.py --shape table6 --arms attn+ffn --backend split   # MoDA's layers on one backend
    python benchmarks/bench_model.py --shape table6 --modes compiled --arms none,attn --backend auto,triton --rounds 3
    python benchmarks/bench_model.py --shape table6 --modes compiled --arms none,attn+ffn --launchers triton,static --rounds 3
    python benchmarks/bench_model.py --shape gpt2s --layers 4 --batch 1 --seq 64 --modes compiled --backend auto,split --rounds 7
"""

from __future__ import annotations

import contextlib
import cProfile
import math
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from moda_flex import depth
from moda_flex.backends import slots

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from moda_flex.backends import NAMES as BACKENDS  # noqa: E402

from bench_call import copy_bandwidth  # noqa: E402

SHAPES = {
    "table6": dict(config=dict(n_layer=24, n_embd=384, n_head=6, n_kv_head=2, norm="post"), batch=32, seq=512),
    "gpt2s": dict(config=dict(n_layer=12, n_embd=768, n_head=12, n_kv_head=4, norm="pre"), batch=8, seq=1024),
}


def resized(shape: dict, layers: Optional[int] = None, batch: Optional[int] = None, seq: Optional[int] = None) -> dict:
    """``shape`` (one of :data:`SHAPES`) with its depth, batch or sequence length replaced where given: a model's
    width and heads at a size where the GPU waits for the host (few layers, short sequences)."""
    config = shape["config"] if layers is None else dict(shape["config"], n_layer=layers)
    return dict(config=config, batch=shape["batch"] if batch is None else batch, seq=shape["seq"] if seq is None else seq)


ARMS = ("none", "attn", "attn+ffn")
MODES = ("eager", "compiled", "reduce-overhead")
LAUNCHERS = ("triton", "static")
# How a depth stream's entries get their gradients (--entry-gradients), a rule in place of
# :func:`moda_flex.depth.buffers_gradients`: auto keeps it (None).
ENTRY_GRADIENTS = {"auto": None, "buffer": lambda choice, k: True, "summed": lambda choice, k: False}


# What a kernel's name says it computes, first match wins: the vendor's attention (the sequence part, and all
# of the baseline's attention); the split path's depth kernels (the merge with the sequence part is fused into
# the depth forward) and its NaN rule's passes; the fused MoDA kernels (sequence and depth in one); cuBLAS's
# products; inductor's generated kernels (norms, rotations, the sums of each depth entry's gradients); the rest.
KERNEL_KINDS = (
    ("vendor attention", ("flash", "fmha", "cudnn", "attention")),  # first: FlashAttention has a "convert_dq_kernel"
    ("split depth + merge", ("depth_forward", "depth_backward")),  # the kernels, or their flat wrappers
    ("split NaN passes", ("sanitize_kv",)),
    ("fused moda", ("forward_kernel", "dq_kernel", "dkdv_kernel", "forward_flat", "dq_flat", "dkdv_flat")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "ampere", "sm90")),
    ("inductor", ("triton_poi_", "triton_red_", "triton_per_", "triton_tem_")),
)


def kernel_kind(name: str) -> str:
    """The part of a step a GPU kernel belongs to: one of :data:`KERNEL_KINDS`' names, else ``other``."""
    lowered = name.lower()
    for kind, patterns in KERNEL_KINDS:
        if any(pattern in lowered for pattern in patterns):
            return kind
    return "other"


def time_split(kernel_us: dict[str, float], steps: int, step_ms: float) -> dict[str, float]:
    """Per step: GPU ms of each kernel kind, and the host gap, the step's time the GPU did not spend on kernels.

    Args:
        kernel_us: each kernel name's own GPU time (us) over ``steps`` profiled steps.
        step_ms: the step's median time measured without the profiler.
    """
    split = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for name, us in kernel_us.items():
        split[kernel_kind(name)] += us / 1e3 / steps
    split["host gap"] = max(0.0, step_ms - sum(split.values()))
    return split


def depth_reads(config: GPTConfig) -> int:
    """Depth entries read per token per step, summed over the attention layers."""
    writes = config.depth_writes
    return sum(writes * layer for layer in range(config.n_layer))


class Case(NamedTuple):
    """One row: a model (``arm``: its depth_kv), how it runs, how its entries get their gradients, its backend,
    and which launcher inductor's code launches our kernels through (``triton``'s own, or ``static``:
    inductor's static launcher, which it uses for its own kernels)."""

    arm: str
    mode: str
    how: str
    backend: str
    launcher: str = "triton"

    @property
    def name(self) -> str:
        extras = [x for x in (self.how, self.backend) if x != "auto"]
        extras += ["static launcher"] if self.launcher == "static" else []
        return ", ".join([self.arm, *extras])

    def config(self, shape: dict) -> GPTConfig:
        """The case's model at ``shape`` (one of :data:`SHAPES`)."""
        return GPTConfig(**shape["config"], depth_kv=self.arm, block_size=shape["seq"], backend=self.backend)


def compiled(model: torch.nn.Module, case: Case) -> Callable:
    """``model`` as ``case.mode`` runs it: itself (eager), or compiled with ``fullgraph=True`` in that mode with
    the case's launcher.

    The launcher is an option of the compile, not a patch of inductor's config around it: dynamo keys its
    cache by the compile's options, so under a patch a second model of the same structure would run the
    first's compiled step.
    """
    if case.mode == "eager":
        return model
    options = torch._inductor.list_mode_options("default" if case.mode == "compiled" else case.mode)
    options["static_launch_user_defined_triton_kernels"] = case.launcher == "static"
    return torch.compile(model, fullgraph=True, options=options)


def prepare(case: Case, shape: dict, warmup: int) -> Callable[[], None]:
    """The case's training step (forward, backward, fused AdamW, bf16 autocast, random tokens), compiled as its
    mode says and run ``warmup`` times (compilation included); the returned step holds the model."""
    B, T = shape["batch"], shape["seq"]
    config = case.config(shape)
    torch.manual_seed(0)
    model = GPT(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    run = compiled(model, case)
    idx = torch.randint(0, config.vocab_size, (B, T), device="cuda")

    def step():
        torch.compiler.cudagraph_mark_step_begin()  # a new step: the graphs' outputs of the last may be overwritten
        with entry_gradients(case.how):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = run(idx, idx)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    return step


def time_steps(step: Callable[[], None], steps: int) -> dict:
    """Each step's time and the host's time to issue it (s), the peak memory over them (MiB), the depth slot
    tables they made, and the mean step (s) of as many steps again issued back to back."""
    torch.cuda.reset_peak_memory_stats()
    tables_before = slots._PINNED.made
    times, issued = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        issued.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**20
    tables = slots._PINNED.made - tables_before
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - t0) / steps
    return {"times": times, "issued": issued, "peak_mib": peak, "tables": tables, "back_to_back": back_to_back}


def summary(timings: list[dict]) -> dict:
    """One row from its timed chunks: median step and issue time (ms), peak memory (MiB), slot tables a step
    (a table made is a call whose addresses are new), and the median of the chunks' back-to-back steps (ms)."""
    times = [t for chunk in timings for t in chunk["times"]]
    issued = [t for chunk in timings for t in chunk["issued"]]
    return {"ms": 1e3 * statistics.median(times), "host_ms": 1e3 * statistics.median(issued),
            "peak_mib": max(chunk["peak_mib"] for chunk in timings),
            "tables": sum(chunk["tables"] for chunk in timings) / len(times),
            "back_ms": 1e3 * statistics.median(chunk["back_to_back"] for chunk in timings)}  # fmt: skip


def round_ratios(chunks: list[dict], base_chunks: list[dict]) -> list[float]:
    """Each round's median step over the base row's median step in the same round: with ``--rounds`` the rows
    take turns, so a round's ratio is timed under one state of the host, and their spread is the run's."""
    return [statistics.median(c["times"]) / statistics.median(b["times"]) for c, b in zip(chunks, base_chunks)]


def host_profile(step: Callable[[], None], steps: int) -> pstats.Stats:
    """The Python of ``steps`` steps (cProfile), the last step's GPU work waited for."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    return pstats.Stats(profiler)


def _profiled(step: Callable[[], None], steps: int, activities: list):
    """The events of ``steps`` steps under torch.profiler's ``activities``, averaged by name (an ``EventList``),
    the last step's GPU work waited for."""
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages()


def host_calls_profile(step: Callable[[], None], steps: int):
    """The host's calls below Python over ``steps`` steps (torch.profiler, CPU and CUDA activities), averaged by
    name: aten ops, autograd nodes and the CUDA runtime and driver calls (``cudaLaunchKernel``,
    ``cuLaunchKernelEx``, ...), each with its own CPU time, which cProfile books to the builtin that made it."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []  # the runtime's calls
    return _profiled(step, steps, activities)


def gpu_profile(step: Callable[[], None], steps: int):
    """The GPU work of ``steps`` steps (torch.profiler), averaged by name (an ``EventList``; its kernels:
    :func:`kernel_events`)."""
    return _profiled(step, steps, [torch.profiler.ProfilerActivity.CUDA])


def kernel_events(averages) -> list:
    """The kernels among a :func:`gpu_profile`'s events: those with device time of their own."""
    return [e for e in averages if e.self_device_time_total > 0]


def profile_steps(step: Callable[[], None], step_ms: float, kernels: bool, host: bool, rows: int = 25) -> None:
    """Over 3 steps: with ``kernels`` the ``rows`` top kernels (torch.profiler), kernel launches per step and the step's
    time by kind (:func:`time_split`: the kinds of :data:`KERNEL_KINDS`, other, and the host gap); with
    ``host`` the top Python functions by own time and by cumulative time (cProfile), then the ``rows`` calls
    below Python with the most own CPU time (:func:`host_calls_profile`)."""
    if kernels:
        averages = gpu_profile(step, 3)
        print(averages.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))
        gpu_events = kernel_events(averages)
        split = time_split({e.key: e.self_device_time_total for e in gpu_events}, 3, step_ms)
        launches = sum(e.count for e in gpu_events) / 3
        print(f"  per step: {launches:.0f} kernels; " + ", ".join(f"{kind} {t:.2f} ms" for kind, t in split.items()),
              flush=True)
    if host:
        stats = host_profile(step, 3)
        for order in ("tottime", "cumulative"):  # where the host's time goes, then which calls hold it
            stats.sort_stats(order).print_stats(30)
        calls = host_calls_profile(step, 3)
        print(calls.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70), flush=True)


def release() -> None:
    """Free the compiled models of the cases timed so far."""
    torch._dynamo.reset()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def entry_gradients(how: str):
    """Inside the block, a depth stream's entries get their gradients by ``how``, a key of
    :data:`ENTRY_GRADIENTS`."""
    default = depth.buffers_gradients
    depth.buffers_gradients = ENTRY_GRADIENTS[how] or default
    try:
        yield
    finally:
        depth.buffers_gradients = default


def _shown(value: float, spec: str, unit: str = "") -> str:
    """``value`` formatted with its unit, or "-" where it was not measured (NaN)."""
    return "-" if math.isnan(value) else format(value, spec) + unit


def report(case: Case, timings: list[dict], step: Callable[[], None], args) -> None:
    """Print a case's line as its timing ends, and its profiles where asked for."""
    row = summary(timings)
    print(f"  {case.name:9s} {case.mode:9s} {row['ms']:8.1f} ms (host {row['host_ms']:.1f}, back to back "
          f"{row['back_ms']:.1f})  "
          f"{_shown(row['peak_mib'], '8.0f')} MiB  {row['tables']:.1f} slot tables made a step",
          flush=True)  # fmt: skip
    profile_steps(step, row["ms"], args.profile, args.host_profile, args.profile_rows)


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="table6", help="model and batch shape")
    p.add_argument("--arms", type=cli.choice_list(ARMS), default=",".join(ARMS),
                   help=f"comma-separated depth_kv values, from {', '.join(ARMS)}")  # fmt: skip
    p.add_argument("--modes", type=cli.choice_list(MODES), default=",".join(MODES),
                   help=f"comma-separated, from {', '.join(MODES)}")  # fmt: skip
    p.add_argument("--layers", type=cli.at_least(1), help="transformer blocks, in place of the shape's")
    p.add_argument("--batch", type=cli.at_least(1), help="sequences a step, in place of the shape's")
    p.add_argument("--seq", type=cli.at_least(1), help="tokens a sequence, in place of the shape's")
    p.add_argument("--steps", type=int, default=20, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first, compilation included")
    p.add_argument("--profile", action="store_true", help="print each row's top kernels and its time by kind over 3 steps (torch.profiler)")
    p.add_argument("--profile-rows", type=int, default=25, help="rows listed by --profile (kernels, the longest first) and by --host-profile (calls below Python)")
    p.add_argument("--host-profile", action="store_true",
                   help="print each row's top Python functions (cProfile), then its top calls below Python by own "
                        "CPU time (torch.profiler: aten ops, CUDA runtime and driver calls)")  # fmt: skip
    p.add_argument("--entry-gradients", type=cli.choice_list(ENTRY_GRADIENTS), default="auto",
                   help="comma-separated, from auto (the depth stream's default), buffer (each layer's kernel adds "
                        "into the stream's one gradient buffer, where it can: moda_flex.backends.chain) and summed "
                        "(each entry sums its readers' gradients): a row of MoDA for each")  # fmt: skip
    p.add_argument("--backend", type=cli.choice_list(BACKENDS), default="auto",
                   help=f"comma-separated moda_attention backends for MoDA's layers, from {', '.join(BACKENDS)}: "
                        "a row of each")  # fmt: skip
    p.add_argument("--launchers", type=cli.choice_list(LAUNCHERS), default="triton",
                   help="comma-separated, from triton (Triton's launcher for our kernels, inductor's default) and "
                        "static (inductor's static launcher, as for its own kernels): a row of MoDA for each; "
                        "with --rounds, one process times both")  # fmt: skip
    p.add_argument("--rounds", type=cli.at_least(1), default=1,
                   help="above 1: every row compiled first, then the rows timed in turn, a share of the steps a "
                        "round (drift of the host or the GPU then falls on every row alike)")  # fmt: skip
    args = p.parse_args(argv)
    cli.require_cuda(p, "bench_model.py")
    shape = resized(SHAPES[args.shape], args.layers, args.batch, args.seq)
    bandwidth = copy_bandwidth()
    B, T = shape["batch"], shape["seq"]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, shape {args.shape} "
          f"{shape['config']} B={B} T={T}, bf16, MoDA backend {','.join(args.backend)}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")  # fmt: skip

    # the baseline keeps auto (SDPA), the attention a user compares against
    cases = [Case(arm, mode, how, backend, launcher)
             for arm in args.arms for mode in args.modes
             for how in (["auto"] if arm == "none" else args.entry_gradients)
             for backend in (["auto"] if arm == "none" else args.backend)
             for launcher in (["triton"] if arm == "none" else args.launchers)]  # fmt: skip
    timings = {case: [] for case in cases}
    if args.rounds == 1:  # each case compiled, timed and freed in turn
        for case in cases:
            step = prepare(case, shape, args.warmup)
            timings[case].append(time_steps(step, args.steps))
            report(case, timings[case], step, args)
            del step
            release()
    else:  # every case compiled first, then timed in turn, a share of its steps a round; the peaks would
        # count every resident model's memory: not reported
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(cases))
        steps = {}
        for case in cases:  # each said as it is ready: a run cut off while compiling shows how far it got
            start = time.perf_counter()
            steps[case] = prepare(case, shape, args.warmup)
            print(f"  {case.name:9s} {case.mode:9s} compiled and warmed up in {time.perf_counter() - start:.0f} s",
                  flush=True)  # fmt: skip
        for _ in range(args.rounds):
            for case in cases:
                timings[case].append(time_steps(steps[case], max(1, args.steps // args.rounds)))
        for case in cases:
            for chunk in timings[case]:
                chunk["peak_mib"] = float("nan")
            report(case, timings[case], steps[case], args)
        del steps
        release()

    rows = {}
    for case in cases:
        config = case.config(shape)
        Hk, D = config.n_kv_head, config.head_dim
        floor_bytes = 6 * depth_reads(config) * B * Hk * T * D * 2
        rows[case] = {"arm": case.name, "mode": case.mode, "floor_ms": floor_bytes / bandwidth * 1e3,
                      **summary(timings[case])}  # fmt: skip

    base_cases = {case.mode: case for case in cases if case.arm == "none"}
    print()
    print("| model | mode | step (ms) | host (ms) | tokens/s | peak (MiB) | step / base | back to back (ms) "
          "| back to back / base | mem / base | floor (ms) | base+floor (ms) | step / (base+floor) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case, r in rows.items():
        base = rows[base_cases.get(case.mode, cases[0])]
        target = base["ms"] + r["floor_ms"]
        print(f"| {r['arm']} | {r['mode']} | {r['ms']:.1f} | {r['host_ms']:.1f} | {B * T / r['ms'] * 1e3:,.0f} | "
              f"{_shown(r['peak_mib'], '.0f')} | "
              f"{r['ms'] / base['ms']:.2f}x | {r['back_ms']:.1f} | {r['back_ms'] / base['back_ms']:.2f}x | "
              f"{_shown(r['peak_mib'] / base['peak_mib'], '.2f', 'x')} | "
              f"{r['floor_ms']:.2f} | "
              f"{target:.1f} | {r['ms'] / target:.2f}x |")  # fmt: skip
    if args.rounds > 1:
        print()
        for case in cases:
            if case.arm != "none" and case.mode in base_cases:
                ratios = round_ratios(timings[case], timings[base_cases[case.mode]])
                print(f"  {case.name} {case.mode}, step / base by round: " + " ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
