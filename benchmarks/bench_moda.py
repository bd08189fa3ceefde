"""Forward + backward (or, with ``--forward-only``, forward) time of MoDA against sequence-only SDPA: Table 4's sweeps.

B=1, D=64, Hk=8, bf16, causal, random inputs; median of repeats after warm-up
(``triton.testing.do_bench``). Columns (ms):

- ``triton``: ``moda_attention(..., backend="triton")`` with L depth slots,
  the depth tensors a strided view of an (L + 16)-slot buffer.
- ``triton L=0``: the same kernel with no depth slots.
- ``flex``: ``moda_attention(..., backend="flex")``, when it imports and runs.
- ``sdpa-flash`` / ``sdpa-cudnn``: ``scaled_dot_product_attention`` causal,
  same Hq / Hk (``enable_gqa``), sequence only, whichever backends run.
- ``extra``: triton over triton L=0, minus 1; ``/sdpa``: triton over the best
  SDPA; ``flex/tri``: flex over triton; ``util``: depth utilization of the
  fused depth phase (useful MACs / computed MACs).

Usage::

    python benchmarks/bench_moda.py                      # all three sweeps
    python benchmarks/bench_moda.py --sweep T --quick    # T up to 16K only
    python benchmarks/bench_moda.py --markdown results.md
    python benchmarks/bench_moda.py --sweep T --quick --no-flex --forward-only
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moda_flex import moda_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402

SWEEPS = {
    "T": [(t, 8, 64) for t in (1024, 2048, 4096, 8192, 16384, 32768, 65536)],
    "G": [(16384, g, 64) for g in (2, 4, 8, 16, 32)],
    "L": [(16384, 8, l) for l in (64, 128, 256)],
}
QUICK_MAX_T = 16384
HK, D = 8, 64


def depth_utilization(G: int, L: int) -> float:
    """Useful / computed MACs of the fused forward's depth phase at its CUDA launch configuration.

    A tile of ``R = max(pow2(G), 16)`` rows (``P = R / pow2(G)`` tokens)
    meets P tokens x BLOCK_S slots; each row keeps its own token's BLOCK_S
    columns.
    """
    from moda_flex.backends.blocks import next_pow2
    from moda_flex.backends.triton.configs import MIN_DOT_ROWS, launch_config

    block_c = launch_config(torch.device("cuda", torch.cuda.current_device()), D, G, "fwd", None)["BLOCK_C"]
    rows = max(next_pow2(G), MIN_DOT_ROWS)
    block_s = block_c // (rows // next_pow2(G))
    return G / rows * L / (block_s * math.ceil(L / block_s))


def _bench(fn) -> float:
    import triton.testing

    fn()
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def _step(run, leaves, grad_out, forward_only=False):
    """One timed call: forward + backward, or the forward alone (no graph kept)."""
    if forward_only:

        def forward():
            with torch.no_grad():
                run(*leaves)

        return forward

    def step():
        for t in leaves:
            t.grad = None
        run(*leaves).backward(grad_out)

    return step


def measure(T: int, G: int, L: int, with_flex: bool, forward_only: bool = False) -> dict:
    """Milliseconds of each column for one (T, G, L); None where a column cannot run."""
    torch.manual_seed(0)
    # Each shape compiles flex afresh; without a reset dynamo stops recompiling after
    # its recompile limit and flex falls back to an unfused path that materializes scores.
    torch._dynamo.reset()
    Hq = HK * G
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, Hq, T, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, HK, T, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, HK, T, D, device=dev, dtype=dt, requires_grad=True)
    buf_k = torch.randn(1, HK, T, L + 16, D, device=dev, dtype=dt)
    buf_v = torch.randn(1, HK, T, L + 16, D, device=dev, dtype=dt)
    dk = buf_k[:, :, :, :L].requires_grad_()
    dv = buf_v[:, :, :, :L].requires_grad_()
    grad_out = torch.randn_like(q)
    row = {}

    def moda(backend, depth=True):
        def run(q, k, v, *depth_kv):
            return moda_attention(q, k, v, *depth_kv, backend=backend)

        leaves = [q, k, v, dk, dv] if depth else [q, k, v]
        return _bench(_step(run, leaves, grad_out, forward_only))

    row["triton"] = moda("triton")
    row["triton L=0"] = moda("triton", depth=False)
    row["flex"] = None
    if with_flex:
        try:
            row["flex"] = moda("flex")
        except Exception as err:  # the flex backend is optional here: report and go on
            print(f"  flex skipped at T={T} G={G} L={L}: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):

        def run(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        try:
            row[name] = _bench(_step(run, [q, k, v], grad_out, forward_only))
        except RuntimeError as err:
            print(f"  {name} skipped at T={T} G={G}: {str(err)[:120]}", file=sys.stderr)
            row[name] = None
    del q, k, v, buf_k, buf_v, dk, dv, grad_out
    torch.cuda.empty_cache()
    return row


def _derived(T, G, L, row) -> dict:
    sdpa = [row[c] for c in ("sdpa-flash", "sdpa-cudnn") if row[c] is not None]
    return {
        "extra": row["triton"] / row["triton L=0"] - 1.0,
        "/sdpa": row["triton"] / min(sdpa) if sdpa else None,
        "flex/tri": row["flex"] / row["triton"] if row["flex"] is not None else None,
        "util": depth_utilization(G, L),
    }


COLUMNS = ["T", "G", "Hq", "L", "triton", "triton L=0", "flex", "sdpa-flash", "sdpa-cudnn", "extra", "/sdpa",
           "flex/tri", "util"]


def _fmt(name, value) -> str:
    if value is None:
        return "n/a"
    if name in ("extra", "util"):
        return f"{100 * value:.1f}%"
    if name in ("/sdpa", "flex/tri"):
        return f"{value:.2f}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def main(argv=None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--sweep", choices=["T", "G", "L", "all"], default="all", help="which of Table 4's sweeps")
    parser.add_argument("--quick", action="store_true", help=f"only T <= {QUICK_MAX_T}")
    parser.add_argument("--no-flex", action="store_true", help="leave out the flex column")
    parser.add_argument("--forward-only", action="store_true", help="time the forward alone (no autograd graph)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables as markdown (default: print only)")
    args = parser.parse_args(argv)
    cli.require_cuda(parser, "bench_moda.py")

    import triton

    header = (f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
              f"B=1, D={D}, Hk={HK}, bf16, causal, {'forward' if args.forward_only else 'forward+backward'}, median ms")
    print(header)
    lines = [header.lstrip("# "), ""]
    sweeps = ["T", "G", "L"] if args.sweep == "all" else [args.sweep]
    for sweep in sweeps:
        print(f"\nsweep {sweep}")
        print(" | ".join(f"{c:>10}" for c in COLUMNS))
        lines += [f"### sweep {sweep}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for T, G, L in SWEEPS[sweep]:
            if args.quick and T > QUICK_MAX_T:
                continue
            row = measure(T, G, L, with_flex=not args.no_flex, forward_only=args.forward_only)
            row.update(_derived(T, G, L, row))
            row.update(T=T, G=G, Hq=HK * G, L=L)
            cells = [_fmt(c, row[c]) for c in COLUMNS]
            print(" | ".join(f"{c:>10}" for c in cells), flush=True)
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()
