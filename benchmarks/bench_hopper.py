"""The Triton backend's Hopper path against its generic path: correctness first, then forward + backward time.

1. Checks: every variant below against the float32 reference and against the
   generic path, bf16, on the output and the five gradients (max abs
   error); a variant fails when its error exceeds twice the generic path's
   plus 2^-8 of the reference's largest value. Also, for the ``hopper``
   variant, ragged lengths and a case with NaN in one key, checked against
   the generic path alone (NaN in the same entries, the rest close). A
   variant whose results differ makes the run exit with status 1 after the
   tables; one that does not compile or run is reported and not timed.
2. Timing (GPU only): B=1, Hq=64, Hk=8, causal, bf16, D in {64, 128},
   T in {4096, 16384, 65536}, L in {0, 64} (L=128, 256 at T=16384), for the
   generic path, each Hopper variant, and sequence-only SDPA (flash, cuDNN);
   then the wall time of a host-bound call (one layer of the Table 6 model)
   on both paths.

FLOPs (counted, the same for every method): causal forward
``2 * B * Hq * T^2 * D`` (two matmuls over half the square), backward 2.5x,
forward + backward ``7 * B * Hq * T^2 * D``; depth FLOPs are left out. The
depth part of a MoDA row (its time minus the same method at L=0) is shown
against its HBM floor, ``12 * B * Hk * T * L * D`` bytes at 3.35 TB/s.

Variants are launch configurations given through ``triton_attention``'s
``config=`` hook (see ``moda_flex/backends/triton/configs.py``), the path
through ``MODA_FLEX_TRITON_PATH``. One that fails to compile or run is
reported in the table and the run goes on. On a GPU the checks run in
``--jobs`` worker processes first, which also compiles every kernel the
timing needs into Triton's cache.

Usage::

    python benchmarks/bench_hopper.py --out hopper.md          # H100 / H200, about 4 minutes
    python benchmarks/bench_hopper.py --quick --out hopper.md  # T <= 16384
    python benchmarks/bench_hopper.py --device cpu --tiny      # the checks only, under the Triton interpreter
"""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402

PATH_ENV = "MODA_FLEX_TRITON_PATH"  # moda_flex.backends.triton.configs.PATH_ENV, readable before triton loads
HBM_BYTES_PER_S = 3.35e12  # H100 SXM spec
HK, G = 8, 8


@dataclass(frozen=True)
class Launch:
    """A launch configuration: the path, and per-kernel overrides of its default launches.

    ``gpu_only``: uses what the interpreter cannot run; ``long``: also timed at T=65536.
    """

    path: str
    overrides: dict = field(default_factory=dict)
    note: str = ""
    gpu_only: bool = False
    long: bool = False


VARIANTS = {
    "generic": Launch("generic", note="today's kernels and tiles", long=True),
    "sm90-tiles": Launch("hopper", {k: {"TMA": False} for k in ("fwd", "dq", "dkdv")},
                          note="Hopper tiles, pointer loads"),
    "hopper": Launch("hopper", note="Hopper tiles + TMA (the Hopper path as shipped)", long=True),
    "hopper-fwd-n64": Launch("hopper", {"fwd": {"BLOCK_N": 64, "num_stages": 3, "LOOP_STAGES": 3}},
                              note="forward BLOCK_N 64"),
    # two stages: the dK/dV kernel's third matmul and the float32 dQ tile spill registers at three (sm_90 compile)
    "hopper-dq-atomic": Launch("hopper", {"dkdv": {"DQ_ATOMIC": 1, "num_stages": 2, "LOOP_STAGES": 2}},
                                note="dQ by element atomics (nondeterministic)"),
    "hopper-dq-tma": Launch("hopper", {"dkdv": {"DQ_ATOMIC": 2, "num_stages": 2, "LOOP_STAGES": 2}},
                             gpu_only=True, long=True, note="dQ by TMA bulk reductions (nondeterministic)"),
    "generic-fwd-8w": Launch("generic", {"fwd": {"BLOCK_M": 128, "BLOCK_C": 16, "num_warps": 8}},
                              note="generic, forward on 128-row tiles with 8 warps (the Hopper forward's)"),
    "hopper-ws": Launch("hopper", {"fwd": {"WS": True, "num_warps": 4}}, gpu_only=True,
                         note="warp-specialized forward loop"),
}
SDPA = ("sdpa-cudnn", "sdpa-flash")  # cuDNN first: the other rows are divided by it


# ---- inputs and one call ------------------------------------------------------------------------


def _inputs(B, Hq, Hk, Tq, Tk, L, D, device, seed=0):
    """q (B, Hq, Tq, D), k, v (B, Hk, Tk, D) and the depth K/V as strided (B, Hk, Tq, L, D) views of
    (L + 16)-slot buffers (read in place), bf16, all leaves that require grad."""
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: 20 GB of depth at T=65536, D=128

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)

    q, k, v = randn(B, Hq, Tq, D), randn(B, Hk, Tk, D), randn(B, Hk, Tk, D)
    depth = [randn(B, Hk, Tq, L + 16, D)[:, :, :, :L] for _ in range(2)]
    return [t.requires_grad_() for t in (q, k, v, *depth)]


def _hook(variant: Launch):
    """The ``config=`` hook of a variant: its overrides on each kernel's default launch."""

    def config(kernel: str, default: dict) -> dict:
        return {**default, **variant.overrides.get(kernel, {})}

    return config


def _call(variant: Launch, leaves, grad_out, attention_variant=None):
    """out and the gradients of q, k, v, depth_k, depth_v (leaf order), on the variant's path."""
    from moda_flex import causal
    from moda_flex.backends.triton import triton_attention

    os.environ[PATH_ENV] = variant.path
    scale = 1.0 / math.sqrt(leaves[0].shape[-1])
    out = triton_attention(*leaves, attention_variant or causal(), scale, config=_hook(variant))[0]
    grads = torch.autograd.grad(out, leaves, grad_out)
    return [out.detach(), *grads]


# ---- correctness --------------------------------------------------------------------------------

NAMES = ("out", "dq", "dk", "dv", "ddepth_k", "ddepth_v")


@dataclass(frozen=True)
class Case:
    """One correctness shape; ``nan`` puts a NaN in one key (compared with the generic path, not the reference)."""

    B: int
    Hq: int
    Hk: int
    Tq: int
    Tk: int
    L: int
    D: int
    kind: str = "causal"
    nan: bool = False

    def name(self) -> str:
        extra = (f" {self.kind}" if self.kind != "causal" else "") + (" NaN" if self.nan else "")
        return f"B{self.B} Hq{self.Hq} Hk{self.Hk} T{self.Tq}/{self.Tk} L{self.L} D{self.D}{extra}"


def _cases(tiny: bool, variant_name: str) -> list[Case]:
    """The shapes a variant is checked on. On a GPU they compile the same kernels the timing runs
    (lengths multiples of 256, at least 132 dK/dV programs); the ``hopper`` variant also gets
    ragged lengths, G=3, a window with a soft-cap, and a NaN in one key."""
    if tiny:
        cases = [Case(1, 16, 2, 40, 40, L, D) for D in (32, 64) for L in (0, 5)]
        extra = [Case(1, 6, 2, 21, 37, 3, 16), Case(1, 16, 2, 40, 40, 4, 32, "window+softcap"),
                 Case(1, 16, 2, 40, 40, 4, 32, nan=True)]
    else:
        cases = [Case(2, 64, 8, 1280, 1280, L, D) for D in (64, 128) for L in (0, 64)]
        extra = [Case(1, 24, 8, 1000, 1100, 13, 64), Case(2, 64, 8, 1280, 1280, 64, 64, "window+softcap"),
                 Case(2, 64, 8, 1280, 1280, 64, 128, nan=True)]
    return cases + (extra if variant_name == "hopper" else [])


def _attention_variant(case: Case, device):
    from moda_flex import causal, depth_bias, sliding_window, softcap

    if case.kind == "causal":
        return causal()
    bias = torch.linspace(-1.0, 1.0, case.Hq * case.L, device=device).view(case.Hq, case.L)
    return sliding_window(case.Tk // 3) & softcap(20.0) & depth_bias(bias)


def _reference(case: Case, leaves, grad_out, attention_variant):
    """out and the five gradients of the reference backend in float32 (its error is far below bf16's, and
    float64 would need twice the memory in each of the checking processes)."""
    from moda_flex.backends.reference import reference_attention

    wide = [t.detach().float().requires_grad_() for t in leaves]
    out = reference_attention(*wide, attention_variant, 1.0 / math.sqrt(case.D))[0]
    return [out.detach(), *torch.autograd.grad(out, wide, grad_out.float())]


def _max_abs(a, b) -> float:
    """Largest |a - b| over the entries finite in both (0.0 for empty tensors)."""
    ok = torch.isfinite(a) & torch.isfinite(b)
    return (a.double() - b.double())[ok].abs().max().item() if ok.any() else 0.0


def check(variant_name: str, device: str, tiny: bool) -> list[dict]:
    """Errors of one variant on its cases, one dict per case: per tensor, the variant's and the generic
    path's max abs error against the reference (NaN case: against the generic path), and pass/fail."""
    variant, generic = VARIANTS[variant_name], VARIANTS["generic"]
    rows = []
    for case in _cases(tiny, variant_name):
        leaves = _inputs(case.B, case.Hq, case.Hk, case.Tq, case.Tk, case.L, case.D, device)
        if case.nan:
            with torch.no_grad():
                leaves[1][0, 1, case.Tk // 2, 3] = float("nan")
        grad_out = torch.randn(leaves[0].shape, generator=torch.Generator(device=device).manual_seed(1),
                               device=device, dtype=leaves[0].dtype)
        attention_variant = _attention_variant(case, device)
        row = {"variant": variant_name, "case": case.name(), "ok": True, "errors": {}}
        try:
            got = _call(variant, leaves, grad_out, attention_variant)
            base = _call(generic, leaves, grad_out, attention_variant)
            ref = base if case.nan else _reference(case, leaves, grad_out, attention_variant)
        except Exception as err:  # a variant that does not compile or run is reported, and the run goes on
            row.update(ok=None, failure=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
            rows.append(row)
            continue
        for name, a, b, r in zip(NAMES, got, base, ref):
            if case.nan:  # NaN in the same entries as the generic path's, the others close
                same_rows = torch.equal(torch.isnan(a), torch.isnan(b))
                err, limit = _max_abs(a, b), 2.0**-6 * max(_max_abs(b, torch.zeros_like(b)), 1e-6)
                row["ok"] &= same_rows and err <= limit
            else:
                err, err_generic = _max_abs(a, r), _max_abs(b, r)
                limit = 2 * err_generic + 2.0**-8 * max(_max_abs(r, torch.zeros_like(r)), 1e-6)
                row["ok"] &= err <= limit
            row["errors"][name] = (err, err_generic if not case.nan else None, limit)
        rows.append(row)
    return rows


def _check_job(args):
    """Worker entry: ``check`` in a fresh process (its compiles land in Triton's on-disk cache)."""
    variant_name, device, tiny = args
    try:
        return check(variant_name, device, tiny)
    except Exception as err:  # report, never take the pool down
        return [{"variant": variant_name, "case": "all", "ok": None,
                 "failure": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}", "errors": {}}]


def run_checks(names, device: str, tiny: bool, jobs: int) -> list[dict]:
    work = [(n, device, tiny) for n in names if not (tiny and VARIANTS[n].gpu_only)]
    if jobs <= 1:
        return [row for job in work for row in _check_job(job)]
    context = multiprocessing.get_context("spawn")
    # one process per variant: a kernel that faults leaves its CUDA context unusable, and only its own rows fail
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context, max_tasks_per_child=1) as pool:
        return [row for rows in pool.map(_check_job, work) for row in rows]


def check_table(rows: list[dict]) -> list[str]:
    lines = ["| variant | case | ok | " + " | ".join(f"{n} err (generic) / limit" for n in NAMES) + " |",
             "|" + "---|" * (3 + len(NAMES))]
    for row in rows:
        if "failure" in row:
            cells = [row["failure"]] + [""] * (len(NAMES) - 1)
        else:
            cells = []
            for name in NAMES:
                err, generic, limit = row["errors"][name]
                cells.append(f"{err:.2e} ({generic:.2e}) / {limit:.1e}" if generic is not None
                             else f"{err:.2e} / {limit:.1e}")
        ok = {True: "yes", False: "NO", None: "did not run"}[row["ok"]]
        lines.append(f"| {row['variant']} | {row['case']} | {ok} | " + " | ".join(cells) + " |")
    return lines


# ---- timing -------------------------------------------------------------------------------------


def _median_ms(fn, budget_ms: float = 400.0) -> float:
    """Median of CUDA-event timings of ``fn`` after one warm-up call: 3 to 30 repeats within ``budget_ms``."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    times = []
    for _ in range(max(3, min(30, int(budget_ms / max(first, 1e-3))))):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _sdpa_step(backend_name: str, leaves, grad_out):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    q, k, v = leaves[:3]

    def forward():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return forward


def time_method(method: str, D: int, T: int, L: int) -> tuple[float, float]:
    """Forward and forward + backward medians (ms) of one method at (D, T, L); raises if it cannot run."""
    leaves = _inputs(1, HK * G, HK, T, T, L, D, "cuda")
    grad_out = torch.randn_like(leaves[0])
    if method in SDPA:
        forward = _sdpa_step(method, leaves, grad_out)
        used = leaves[:3]
    else:
        from moda_flex import causal
        from moda_flex.backends.triton import triton_attention

        variant = VARIANTS[method]
        os.environ[PATH_ENV] = variant.path

        def forward():
            return triton_attention(*leaves, causal(), 1.0 / math.sqrt(D), config=_hook(variant))[0]

        used = leaves

    def step():
        torch.autograd.grad(forward(), used, grad_out)

    with torch.no_grad():
        fwd = _median_ms(forward)
    both = _median_ms(step)
    del leaves, grad_out
    torch.cuda.empty_cache()
    return fwd, both


def _plan(quick: bool) -> list[tuple[int, int, int, str]]:
    """(D, T, L, method) in timing order: SDPA once per (D, T), the triton methods at each L."""
    triton_methods = list(VARIANTS)
    plan = []
    for D in (64, 128):
        for T in (4096, 16384) + (() if quick else (65536,)):
            methods = [m for m in triton_methods if T < 65536 or VARIANTS[m].long]
            plan += [(D, T, 0, m) for m in SDPA]
            plan += [(D, T, L, m) for L in (0, 64) for m in methods]
    plan += [(64, 16384, L, m) for L in (128, 256) for m in ("generic", "hopper")]
    return plan


def run_timing(quick: bool, failed: set, wrong: set) -> list[dict]:
    """Times every planned row; a variant in ``failed`` is not timed (``wrong``: its results differed)."""
    rows = []
    for D, T, L, method in _plan(quick):
        row = dict(D=D, T=T, L=L, method=method, fwd=None, total=None, note="")
        if method in failed:
            row["note"] = "failed its check" if method in wrong else "its check did not run"
        else:
            try:
                row["fwd"], row["total"] = time_method(method, D, T, L)
            except Exception as err:  # a variant that does not compile or run is reported, not fatal
                row["note"] = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
                torch.cuda.empty_cache()
        rows.append(row)
        print(_time_line(row, rows), flush=True)
    return rows


HOST_SHAPE = dict(B=32, Hq=6, Hk=2, T=512, L=47, D=64)  # one layer of the Table 6 model


def time_host(method: str, calls: int = 30) -> float:
    """Wall milliseconds per forward + backward call at HOST_SHAPE, ``calls`` issued back to back.

    At this size the call is bound by the host (Python, launches), where the
    Hopper path adds descriptor construction.
    """
    from moda_flex import causal
    from moda_flex.backends.triton import triton_attention

    s = HOST_SHAPE
    leaves = _inputs(s["B"], s["Hq"], s["Hk"], s["T"], s["T"], s["L"], s["D"], "cuda")
    grad_out = torch.randn_like(leaves[0])
    variant = VARIANTS[method]
    os.environ[PATH_ENV] = variant.path

    def step():
        out = triton_attention(*leaves, causal(), 1.0 / math.sqrt(s["D"]), config=_hook(variant))[0]
        torch.autograd.grad(out, leaves, grad_out)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def host_table(failed: set) -> list[str]:
    shape = ", ".join(f"{k}={v}" for k, v in HOST_SHAPE.items())
    lines = [f"Host-bound call ({shape}; wall ms per fwd+bwd, 30 back to back):", ""]
    for method in ("generic", "hopper"):
        if method in failed:
            continue
        try:
            lines.append(f"- {method}: {time_host(method):.3f} ms")
        except Exception as err:  # reported, not fatal
            lines.append(f"- {method}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
        print(lines[-1], flush=True)
    return lines + [""]


def _flops(D: int, T: int) -> float:
    return 7.0 * HK * G * T * T * D  # B = 1


def _time_line(row: dict, rows: list[dict]) -> str:
    """One markdown row: ms, TFLOP/s, ratios to cuDNN and to the generic path, and the depth part."""

    def find(method, L):
        for r in rows:
            if (r["D"], r["T"], r["L"], r["method"]) == (row["D"], row["T"], L, method) and r["total"]:
                return r["total"]
        return None

    total = row["total"]
    cells = [row["D"], row["T"], row["L"] if row["method"] not in SDPA else "-", row["method"]]
    if total is None:
        return "| " + " | ".join(map(str, cells)) + " | " + " | ".join(["n/a"] * 6) + f" | {row['note']} |"
    cudnn, generic = find("sdpa-cudnn", 0), find("generic", row["L"])
    depth = ""
    base = find(row["method"], 0)
    if row["L"] and base and row["method"] not in SDPA:
        floor = 12 * HK * row["T"] * row["L"] * row["D"] / HBM_BYTES_PER_S * 1e3
        depth = f"{total - base:.2f} ({(total - base) / floor:.2f}x floor)"
    cells += [f"{row['fwd']:.2f}", f"{total:.2f}", f"{_flops(row['D'], row['T']) / total / 1e9:.0f}",
              f"{total / cudnn:.2f}" if cudnn else "n/a",
              f"{total / generic:.2f}" if generic and row["method"] not in SDPA else "",
              depth]
    return "| " + " | ".join(map(str, cells)) + f" | {row['note']} |"


TIME_HEADER = ["| D | T | L | method | fwd ms | fwd+bwd ms | TFLOP/s | /cuDNN | /generic | depth part ms | note |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]


# ---- main ---------------------------------------------------------------------------------------


def main(argv=None) -> None:
    parser = cli.parser(__doc__)
    cli.add_device(parser, "; cpu runs the checks only, under the Triton interpreter")
    parser.add_argument("--tiny", action="store_true", help="tiny check shapes (for the interpreter)")
    parser.add_argument("--quick", action="store_true", help="time T <= 16384 only")
    # A check process holds up to about 20 GB on the GPU (float32 reference at D=128).
    parser.add_argument("--jobs", type=int, default=3, help="worker processes for the checks on a GPU")
    parser.add_argument("--variants", type=cli.choice_list(VARIANTS), default=",".join(VARIANTS),
                        help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--out", metavar="FILE", help="also write the tables as markdown")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    device = cli.check_device(parser, args.device)
    names = args.variants
    if "generic" not in names:
        names.insert(0, "generic")

    import triton

    if device.index is not None:
        torch.cuda.set_device(device)  # the timing allocates on the current device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    header = f"{where}, torch {torch.__version__}, triton {triton.__version__}"
    print(header, flush=True)
    started = time.time()
    checks = run_checks(names, args.device, args.tiny or device.type == "cpu",
                        args.jobs if device.type == "cuda" else 1)
    lines = [f"# Hopper path: {header}", "", "## Checks (max abs error, bf16)", "", *check_table(checks), ""]
    print("\n".join(lines[2:]), f"\nchecks: {time.time() - started:.0f} s", flush=True)
    failed = {row["variant"] for row in checks if not row["ok"]}  # not timed
    wrong = {row["variant"] for row in checks if row["ok"] is False}  # ran and disagreed: the run fails
    if device.type == "cuda":
        print("\n".join(TIME_HEADER), flush=True)
        timing = run_timing(args.quick, failed, wrong)
        lines += ["## Forward + backward (B=1, Hq=64, Hk=8, causal, bf16; TFLOP/s = 7*Hq*T^2*D / time)", "",
                  *TIME_HEADER, *(_time_line(r, timing[: i + 1]) for i, r in enumerate(timing)), "",
                  *host_table(failed)]
        print(f"total: {time.time() - started:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    if failed - wrong:
        print(f"did not compile or run (reported above): {', '.join(sorted(failed - wrong))}", file=sys.stderr)
    if wrong:
        print(f"CHECK FAILED, results differ: {', '.join(sorted(wrong))}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
