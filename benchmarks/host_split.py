"""The host's share of one split-path call: its Python, allocations and dispatch, with every Triton launch
stubbed out, on any machine (a GPU is not needed, nor used).

At short lengths a call is bound by the host. This times, on CPU with tiny
tensors (so the vendor's CPU op costs little), the two ways a call is issued:

- ``eager``: ``moda_attention(..., backend="split")`` forward + backward,
  L depth entries as a model passes them (each a leaf of its own);
- ``ops``: the two ``torch.library`` ops called directly, as a compiled
  graph's wrapper calls them.

Median us per call of repeats after warm-up. The figures are the host's
alone: on a GPU each launch adds Triton's launcher, and the kernels run
beside it.

Usage::

    python benchmarks/host_split.py --slots 12,47
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the split path's CPU support; no kernel runs (all are stubbed)

import torch  # noqa: E402

from moda_flex import moda_attention  # noqa: E402
from moda_flex.backends.split import kernels, ops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402


class _NoLaunch:
    """A Triton kernel whose launches do nothing: ``kernel[grid](...)`` returns at once."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def launches_stubbed():
    """Every Triton kernel of the split path a :class:`_NoLaunch` inside the block, as it was after."""
    names = ("_sanitize_kv_kernel", "_prepare_backward_kernel")
    saved = {name: getattr(kernels, name) for name in names}, [dict(kernels.FORWARD), dict(kernels.BACKWARD)]
    for name in names:
        setattr(kernels, name, _NoLaunch())
    for designs in (kernels.FORWARD, kernels.BACKWARD):
        designs.update({design: _NoLaunch() for design in designs})
    try:
        yield
    finally:
        for name, kernel in saved[0].items():
            setattr(kernels, name, kernel)
        kernels.FORWARD.update(saved[1][0])
        kernels.BACKWARD.update(saved[1][1])


def _median_us(fn, repeats: int, calls: int = 100) -> float:
    for _ in range(calls // 4):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def measure(slots: int, repeats: int) -> dict:
    """us per call of each way (module docstring), B=1, Hq=6, Hk=2, T=8, D=64, causal."""
    B, Hq, Hk, T, D = 1, 6, 2, 8, 64

    def leaf(*size):
        return torch.randn(*size, requires_grad=True)

    q, k, v = leaf(B, Hq, T, D), leaf(B, Hk, T, D), leaf(B, Hk, T, D)
    depth_k = [leaf(B, Hk, T, D) for _ in range(slots)]
    depth_v = [leaf(B, Hk, T, D) for _ in range(slots)]
    leaves = [q, k, v, *depth_k, *depth_v]

    def eager_forward():
        return moda_attention(q, k, v, depth_k, depth_v, backend="split")

    def eager():
        torch.autograd.grad(eager_forward().sum(), leaves)

    inputs = ops.Inputs(*(t.detach() for t in (q, k, v)), [t.detach() for t in depth_k], [t.detach() for t in depth_v])
    opts = ops.Options(D**-0.5, True, True, 0, "cpu")
    out, lse = torch.ops.moda_flex.split_forward(*inputs, *opts)
    grads = ops.Grads(torch.randn_like(out), None, out, lse)

    def by_ops():
        torch.ops.moda_flex.split_forward(*inputs, *opts)
        torch.ops.moda_flex.split_backward(*grads, *inputs, *opts)

    return {"eager forward": _median_us(eager_forward, repeats), "eager": _median_us(eager, repeats),
            "ops": _median_us(by_ops, repeats)}  # fmt: skip


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--slots", type=cli.int_list, default="12,47", help="L of each row")
    p.add_argument("--repeats", type=cli.at_least(1), default=9, help="timed repeats of 100 calls")
    args = p.parse_args(argv)
    print("host us per call, every Triton launch stubbed out (forward + backward unless named)")
    print("| L | eager forward | eager | ops |\n|---|---|---|---|")
    for slots in args.slots:
        with launches_stubbed():
            row = measure(slots, args.repeats)
        print(f"| {slots} | " + " | ".join(f"{row[name]:.0f}" for name in ("eager forward", "eager", "ops")) + " |")


if __name__ == "__main__":
    main()
