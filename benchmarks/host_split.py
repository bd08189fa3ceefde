"""The host's share of one call of the split path and of the fused kernel: its Python, allocations and dispatch.

At short lengths a call is bound by the host. This times, with tiny tensors
(so the kernels cost little), the two ways a split-path call is issued:

- ``eager``: ``moda_attention(..., backend="split")`` forward + backward,
  L depth entries as a model passes them (each a leaf of its own);
- ``ops``: the two ``torch.library`` ops called directly, as a compiled
  graph's wrapper calls them;

and beside them ``vendor``, the sequence part's aten ops alone (forward +
backward), which a baseline's SDPA calls cost too, ``fused ops``, the
fused kernel's two opaque ops (what a compiled model's calls take where
they cannot be traced, such as with dynamic shapes), and its forward
alone, through the op (``fused fwd op``) and called directly (``fused fwd
direct``): their difference is the dispatcher's. On CPU (the default; no
GPU is needed) every Triton launch is stubbed out and the vendor is SDPA's
CPU op: the rows time the Python around the launches. With ``--device cuda`` each L gets two rows, launches
stubbed and real: their difference is what the launches cost the host.

Median us per call of repeats after warm-up (on CUDA each repeat ends with
a synchronize, so a call costs at least its kernels' GPU time).

Usage::

    python benchmarks/host_split.py --slots 12,47
    python benchmarks/host_split.py --slots 0,12,47 --device cuda
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from moda_flex import moda_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402


class _NoLaunch:
    """A Triton kernel whose launches do nothing: ``kernel[grid](...)`` returns at once."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def launches_stubbed():
    """Every Triton kernel of the split path and of the fused kernel a :class:`_NoLaunch` inside the block, as it
    was after."""
    from moda_flex.backends.split import kernels
    from moda_flex.backends.triton import kernels as fused_kernels

    modules = {kernels: ("_sanitize_kv_kernel",),
               fused_kernels: ("forward_kernel", "dq_kernel", "dkdv_kernel")}  # fmt: skip
    saved = {(module, name): getattr(module, name) for module, names in modules.items() for name in names}
    designs_saved = [dict(kernels.FORWARD), dict(kernels.BACKWARD)]
    for module, name in saved:
        setattr(module, name, _NoLaunch())
    for designs in (kernels.FORWARD, kernels.BACKWARD):
        designs.update({design: _NoLaunch() for design in designs})
    try:
        yield
    finally:
        for (module, name), kernel in saved.items():
            setattr(module, name, kernel)
        kernels.FORWARD.update(designs_saved[0])
        kernels.BACKWARD.update(designs_saved[1])


def _median_us(fn, repeats: int, device: torch.device, calls: int = 100) -> float:
    for _ in range(calls // 4):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def measure(slots: int, repeats: int, device: torch.device) -> dict:
    """us per call of each way (module docstring), B=1, Hq=6, Hk=2, T=8, D=64, causal (bfloat16 on CUDA)."""
    return {name: _median_us(fn, repeats, device) for name, fn in ways(slots, device).items()}


def ways(slots: int, device: torch.device) -> dict:
    """Each way of :func:`measure` as a function that makes one call."""
    from moda_flex.backends.capture import fused_records
    from moda_flex.backends.split import ops, sequence
    from moda_flex.backends.triton import launch as triton_launch

    B, Hq, Hk, T, D = 1, 6, 2, 8, 64
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def leaf(*size):
        return torch.randn(*size, device=device, dtype=dtype, requires_grad=True)

    q, k, v = leaf(B, Hq, T, D), leaf(B, Hk, T, D), leaf(B, Hk, T, D)
    depth_k = [leaf(B, Hk, T, D) for _ in range(slots)]
    depth_v = [leaf(B, Hk, T, D) for _ in range(slots)]
    leaves = [q, k, v, *depth_k, *depth_v]

    def eager_forward():
        return moda_attention(q, k, v, depth_k, depth_v, backend="split")

    def eager():
        torch.autograd.grad(eager_forward().sum(), leaves)

    inputs = ops.Inputs(*(t.detach() for t in (q, k, v)), [t.detach() for t in depth_k], [t.detach() for t in depth_v])
    kernel = sequence.kernel_for(device, D, True)
    opts = ops.Options(D**-0.5, True, True, 0, kernel)
    out, lse = torch.ops.moda_flex.split_forward(*inputs, *opts)
    grads = ops.Grads(torch.randn_like(out), None, out, lse)

    def by_ops():
        torch.ops.moda_flex.split_forward(*inputs, *opts)
        torch.ops.moda_flex.split_backward(*grads, *inputs, *opts)

    def vendor():
        out_s, lse_s = sequence.forward(kernel, *inputs[:3], True, opts.scale)
        sequence.backward(kernel, grads.grad_out, *inputs[:3], out_s, lse_s, True, opts.scale)

    fused_inputs, fused_opts = fused_records(inputs, opts)
    fused_out, fused_lse = torch.ops.moda_flex.triton_forward(*fused_inputs, *fused_opts)
    fused_grads = triton_launch.Grads(grads.grad_out, None, fused_out, fused_lse, False)

    def by_fused_ops():
        torch.ops.moda_flex.triton_forward(*fused_inputs, *fused_opts)
        torch.ops.moda_flex.triton_backward(*fused_grads, *fused_inputs, *fused_opts)

    def fused_forward_op():
        torch.ops.moda_flex.triton_forward(*fused_inputs, *fused_opts)

    def fused_forward_direct():
        triton_launch.forward(fused_inputs, fused_opts)

    return {"eager forward": eager_forward, "eager": eager, "ops": by_ops, "vendor": vendor, "fused ops": by_fused_ops,
            "fused fwd op": fused_forward_op, "fused fwd direct": fused_forward_direct}  # fmt: skip


def profile(slots: int, device: torch.device, calls: int = 300) -> None:
    """Print where the host spends a fused op pair's time, by own time (real launches on CUDA, else stubbed)."""
    import cProfile
    import pstats

    with launches_stubbed() if device.type == "cpu" else contextlib.nullcontext():
        fn = ways(slots, device)["fused ops"]
        for _ in range(calls // 4):
            fn()
        with cProfile.Profile() as prof:
            for _ in range(calls):
                fn()
    print(f"\nfused ops, L={slots}, {calls} calls (forward + backward), by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--slots", type=cli.int_list, default="12,47", help="L of each row")
    p.add_argument("--repeats", type=cli.at_least(1), default=9, help="timed repeats of 100 calls")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: also a row with real launches")
    p.add_argument("--profile", action="store_true", help="also profile the fused ops at the last L "
                   "(real launches on CUDA)")
    args = p.parse_args(argv)
    device = cli.check_device(p, args.device)
    if device.type == "cpu":  # the split path's CPU support, chosen before triton is imported; no kernel runs
        os.environ.setdefault("TRITON_INTERPRET", "1")
    names = ("eager forward", "eager", "ops", "vendor", "fused ops", "fused fwd op", "fused fwd direct")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"host us per call on {where}, torch {torch.__version__} (forward + backward unless named)")
    print("| L | Triton launches | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for slots in args.slots:
        stubbed = [True, False] if device.type == "cuda" else [True]
        for stub in stubbed:
            with launches_stubbed() if stub else contextlib.nullcontext():
                row = measure(slots, args.repeats, device)
            cells = " | ".join(f"{row[name]:.0f}" if name in row else "-" for name in names)
            print(f"| {slots} | {'stubbed' if stub else 'real'} | {cells} |")
    if args.profile:
        profile(args.slots[-1], device)


if __name__ == "__main__":
    main()
