"""What launching the split path's depth kernel costs the host, launcher by launcher (CUDA only).

In the default compiled mode a MoDA step is bound by the host (BENCHMARKS.md,
"On an H200"), and Triton's launcher takes some 90 us of it a launch on the
H200 machine's CPU, against some 20 for the launches inductor makes of its
own kernels (a profile of the step). This times the forward's depth
kernel, at a shape where its GPU time is a few us, launched:

- ``triton``: ``kernel[grid](...)``, as the split op launches it;
- ``triton, its binary's launcher``: the compiled kernel's own ``run``, with
  the arguments bound once: Triton's per-call binding, cache key and checks
  left out, the floor a launcher of ours could reach;
- ``triton_op, eager``: the launch inside a ``torch.library.triton_op`` (``wrap_triton``), called eagerly;
- ``triton_op, compiled``: that op from ``torch.compile(fullgraph=True)``,
  the kernel's flat wrapper (``moda_flex/backends/split/flat.py``: its
  strides as scalars, as inductor takes them); with the register cap
  (``maxnreg``) and without;
- the same compiled op, the vendor's forward in its body too;
- ``x8`` rows: 8 launches a call, each reading the last one's output (no
  two alike, so none is merged): a launch's marginal cost is the
  difference to the one-launch row over 7, without the compiled
  function's own cost (its guards, its wrapper), which a model's step
  pays once;

and, for scale, the whole split forward op (the sanitizing pass, the vendor's
forward, the slot table and this launch) and the vendor's forward alone. The
depth slots reach the kernel through a slot table built once, before the
timing, as a tensor argument: what an opaque table op beside a traced body
would give it. A one-launch row's output is checked equal to the first
row's; a row that fails prints its error instead of a time.

Median us per call of repeats of 200 calls, each repeat ending with a
synchronize; beside it, the kernels a call runs (from a profile of one call).

Usage::

    python benchmarks/launch_split.py --slots 12
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor

from moda_flex.backends.blocks import cdiv
from moda_flex.backends.slots import depth_args
from moda_flex.backends.split import kernels, ops, sequence
from moda_flex.backends.split.flat import FLAT
from moda_flex.backends.traced import launch_flat, one_pointer_a_side

from bench_call import wall_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402


def _gpu_work(fn) -> str:
    """The CUDA kernels and copies one call of ``fn`` runs, by name and count (a profile of one call after one
    untimed): a compiled launch that copies its arguments shows more than the one kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    return ", ".join(f"{name[:40]} x{names.count(name)}" for name in dict.fromkeys(names)) or "none"


def _launcher(q: Tensor, depth_k: list[Tensor], depth_v: list[Tensor], causal: bool, scale: float):
    """``launch(run, q, out_s, lse_s, first, table, capped=True) -> (out, lse)``, the split forward's depth
    launch through ``run(kernel)[grid]`` (``run``: ``wrap_triton``, or the identity for Triton's launcher),
    with the host's work for it (layout, strides) done once, here; the slot table it reads; the tensors that
    table points into (hold them)."""
    B, T = q.shape[0], q.shape[2]
    Hk, L = depth_k[0].shape[1], len(depth_k)
    layout = ops._layout(q, Hk, L)
    kernel = kernels.FORWARD[layout.pop("design")]
    grid = (cdiv(T, layout["BLOCK_T"]), B * Hk)
    depth, held = depth_args(depth_k, depth_v, L, q.device)
    table = depth.pop("DK_TAB")
    depth.pop("DV_TAB")

    def launch(run, q, out_s, lse_s, first, table, capped=True, flat=False, direct=False):
        options = layout if capped else {name: value for name, value in layout.items() if name != "maxnreg"}
        out = torch.empty_like(q)
        lse = torch.empty(lse_s.shape, device=q.device, dtype=torch.float32)  # the vendor's layout
        ls, lo = sequence.lse_view(lse_s), sequence.lse_view(lse)
        arguments = dict(
            Q=q, OS=out_s, LS=ls, FIRST=first, O=out, LO=lo, **depth,
            sq=q.stride(), sos=out_s.stride(), sls=ls.stride(), so=out.stride(), slo=lo.stride(),
            Hk=Hk, Tq=T, Tk=T, L=L, depth_first=0, qk_scale=scale * ops._LOG2E,
            **options, HAS_SEQ=True, CAUSAL=causal,
        )  # fmt: skip
        tables = dict(DK_TAB=table, DV_TAB=table[L:])
        if direct:
            return _binary_launcher(kernel, grid, {**arguments, **tables}), out
        if flat:  # the wrapper takes each side's table as its first pointer argument
            wrapper, constants = FLAT[kernel]
            launch_flat(wrapper, grid, run, **constants, **one_pointer_a_side({**arguments, **tables}))
        else:
            run(kernel)[grid](**arguments, **tables)
        return out, lse

    return launch, table, held


def _binary_launcher(kernel, grid: tuple, arguments: dict):
    """``run()``: the launch ``kernel[grid](**arguments)`` makes, through the compiled binary's own launcher,
    its arguments bound here once (valid for these very tensors only)."""
    from triton import knobs
    from triton.runtime.driver import driver

    binary = kernel[grid](**arguments)  # compiles, launches once, returns the compiled kernel
    values = [arguments[name] for name in kernel.arg_names]
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    grid3 = (*grid, 1, 1)[:3]
    metadata = binary.launch_metadata(grid3, stream, *values)

    def run():
        binary.run(*grid3, stream, binary.function, binary.packed_metadata, metadata,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)  # fmt: skip

    return run


def measure(slots: int, repeats: int) -> list[tuple[str, str, str]]:
    """(row, us or error, GPU work a call) of each launcher (module docstring), B=1, Hq=6, Hk=2, T=8, D=64,
    bf16, causal."""
    from torch.library import triton_op, wrap_triton

    B, Hq, Hk, T, D = 1, 6, 2, 8, 64
    scale = D**-0.5

    def randn(*size):
        return torch.randn(*size, device="cuda", dtype=torch.bfloat16)

    q, k, v = randn(B, Hq, T, D), randn(B, Hk, T, D), randn(B, Hk, T, D)
    depth_k = [randn(B, Hk, T, D) for _ in range(slots)]
    depth_v = [randn(B, Hk, T, D) for _ in range(slots)]
    kernel = sequence.kernel_for(q.device, D, True)
    out_s, lse_s = sequence.forward(kernel, q, k, v, True, scale)
    first = torch.full((B, Hk), T, device="cuda", dtype=torch.int32)
    launch, table, _held = _launcher(q, depth_k, depth_v, True, scale)
    args = (q, out_s, lse_s, first, table)

    @triton_op("moda_flex_bench::depth_forward", mutates_args=())
    def eager_op(q: Tensor, out_s: Tensor, lse_s: Tensor, first: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
        return launch(wrap_triton, q, out_s, lse_s, first, table)

    @triton_op("moda_flex_bench::depth_forward_flat", mutates_args=())
    def flat(q: Tensor, out_s: Tensor, lse_s: Tensor, first: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
        return launch(wrap_triton, q, out_s, lse_s, first, table, flat=True)

    @triton_op("moda_flex_bench::depth_forward_flat_uncapped", mutates_args=())
    def flat_uncapped(q: Tensor, out_s: Tensor, lse_s: Tensor, first: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
        return launch(wrap_triton, q, out_s, lse_s, first, table, capped=False, flat=True)

    @triton_op("moda_flex_bench::split_forward_traced", mutates_args=())
    def traced(q: Tensor, k: Tensor, v: Tensor, first: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
        out_s, lse_s = sequence.forward(kernel, q, k, v, True, scale)
        return launch(wrap_triton, q, out_s, lse_s, first, table, flat=True)

    def chained(step):
        """8 launches by ``step(q, out_s, lse_s, first, table) -> (out, lse)``, each on the last one's output."""

        def run(q, *rest):
            for _ in range(8):
                q = step(q, *rest)[0]
            return q, None

        return run

    compiled_flat = torch.compile(lambda *a: flat(*a), fullgraph=True)
    compiled_flat8 = torch.compile(chained(flat), fullgraph=True)
    compiled_uncapped = torch.compile(lambda *a: flat_uncapped(*a), fullgraph=True)
    compiled_traced = torch.compile(lambda *a: traced(*a), fullgraph=True)
    binary, binary_out = launch(None, *args, direct=True)

    def binary_launch():
        binary()
        return binary_out, None

    def triton_launch(*a):
        return launch(lambda fn: fn, *a)

    inputs = ops.Inputs(q, k, v, depth_k, depth_v)
    opts = ops.Options(scale, True, True, 0, kernel)
    expected = triton_launch(*args)[0]
    ways = {
        "triton": lambda: triton_launch(*args),
        "triton x8": lambda: chained(triton_launch)(*args),
        "triton, its binary's launcher": binary_launch,
        "triton_op, eager": lambda: eager_op(*args),
        "triton_op, compiled": lambda: compiled_flat(*args),
        "triton_op, compiled x8": lambda: compiled_flat8(*args),
        "triton_op, compiled, no register cap": lambda: compiled_uncapped(*args),
        "triton_op, vendor forward + depth, compiled": lambda: compiled_traced(q, k, v, first, table),
        "split forward op (for scale)": lambda: torch.ops.moda_flex.split_forward(*inputs, *opts),
        f"vendor forward ({kernel}, for scale)": lambda: sequence.forward(kernel, q, k, v, True, scale),
    }
    rows = []
    for name, fn in ways.items():
        us = None
        try:
            same = torch.equal(fn()[0], expected) if name.startswith("triton") and "x8" not in name else None
            us = wall_ms(fn, calls=200, repeats=repeats) * 1e3
            cell = f"{us:.1f}" + ("" if same is None else " (same)" if same else " (DIFFERS)")
            work = _gpu_work(fn)
        except Exception as error:  # an experiment: say what failed and go on
            cell, work = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}", "-"
        rows.append((name, cell, work, us))
    return rows


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--slots", type=cli.at_least(1), default=12, help="depth slots L")
    p.add_argument("--repeats", type=cli.at_least(1), default=9, help="timed repeats of 200 calls")
    args = p.parse_args(argv)
    cli.require_cuda(p, "launch_split.py")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; the forward's depth kernel at L={args.slots}, "
          f"B=1, Hq=6, Hk=2, T=8, D=64: host us per call")  # fmt: skip
    print("| launcher | us | GPU work a call |\n|---|---|---|")
    rows = measure(args.slots, args.repeats)
    for name, cell, work, _ in rows:
        print(f"| {name} | {cell} | {work} |")
    us = {name: value for name, _, _, value in rows}
    for one, eight in [("triton", "triton x8"), ("triton_op, compiled", "triton_op, compiled x8")]:
        if us[one] is not None and us[eight] is not None:
            print(f"{one}: {(us[eight] - us[one]) / 7:.1f} us a launch more (x8 against one launch)")


if __name__ == "__main__":
    main()
