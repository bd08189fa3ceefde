"""One eager ``moda_attention`` call, forward + backward, at the lengths people train at.

At short lengths a call is bound by the host: the Python, the allocations and
the kernel launches cost more than the kernels. For each shape this prints
(ms per call, bf16, causal, median of repeats after warm-up, random inputs):

- ``wall``: calls issued back to back, then one synchronize, divided by their number;
- ``host``: the time to issue one call while the GPU is kept busy, so the host never waits;
- for ``moda`` (depth as one (B, Hk, T, L, D) view of a larger buffer),
  ``moda-entries`` (depth as L separate (B, Hk, T, D) tensors, what a model
  passes), both on the fused kernels, ``split-entries`` (the entries on the
  split path) and SDPA's flash, cuDNN and efficient backends (sequence only);
- ``floor``: the best SDPA wall time plus the depth HBM floor: reading depth
  K/V in the forward and the backward and writing their gradients
  (6 L B Hk T D bytes x 2) at the bandwidth of a device-to-device copy
  measured in the same run; ``moda / floor`` is the ratio the target bounds.

Usage::

    python benchmarks/bench_call.py
    python benchmarks/bench_call.py --profile     # also where the host time of one call goes
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moda_flex import moda_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402

# (B, Hq, Hk, T, L): the Table 6 model's attention (last layer), and a wide-GQA layer at T=1024.
SHAPES = [(32, 6, 2, 512, 47), (1, 64, 8, 1024, 64)]
D = 64
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times[2:])


def wall_ms(fn, calls: int = 50, repeats: int = 7) -> float:
    """Median over repeats of (``calls`` calls back to back, then synchronize) / calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(samples)


def host_ms(fn, calls: int = 20, repeats: int = 7) -> float:
    """Median time to issue one call while a long GPU sleep keeps the device busy."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # about a second of GPU cycles: the queue never drains
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e3)
        torch.cuda.synchronize()
    return statistics.median(samples)


def make_calls(B: int, Hq: int, Hk: int, T: int, L: int) -> tuple[dict, int]:
    """Forward + backward closures per method, and the depth bytes one call must move."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    q, k, v = rand(B, Hq, T, D), rand(B, Hk, T, D), rand(B, Hk, T, D)
    grad = torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    buf_k, buf_v = (torch.randn(B, Hk, T, L + 16, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    # (B, Hk, T, L, D) views of a larger slot buffer, leaves, read in place
    depth_k, depth_v = buf_k[:, :, :, :L].requires_grad_(), buf_v[:, :, :, :L].requires_grad_()
    entries_k = [rand(B, Hk, T, D) for _ in range(L)]
    entries_v = [rand(B, Hk, T, D) for _ in range(L)]

    def moda():
        out = moda_attention(q, k, v, depth_k, depth_v, backend="triton")
        torch.autograd.grad(out, (q, k, v, depth_k, depth_v), grad)

    def entries(backend):
        def call():
            out = moda_attention(q, k, v, entries_k, entries_v, backend=backend)
            torch.autograd.grad(out, (q, k, v, *entries_k, *entries_v), grad)

        return call

    calls = {"moda": moda, "moda-entries": entries("triton"), "split-entries": entries("split")}
    for name, backend in SDPA_BACKENDS.items():

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad)

        try:
            sdpa()
        except RuntimeError:  # this SDPA backend does not run here
            continue
        calls[f"sdpa-{name}"] = sdpa
    depth_bytes = 6 * L * B * Hk * T * D * 2  # read K, V forward and backward; write dK, dV (bf16)
    return calls, depth_bytes


def profile(fn, calls: int = 20) -> str:
    """The host-side functions that take the most time over ``calls`` calls."""
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    return text.getvalue()


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--profile", action="store_true", help="print a host profile of the moda-entries call")
    args = p.parse_args(argv)
    cli.require_cuda(p, "bench_call.py")
    bandwidth = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print()
    print("| B | Hq | Hk | T | L | method | wall (ms) | host (ms) | floor (ms) | wall / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B, Hq, Hk, T, L in SHAPES:
        calls, depth_bytes = make_calls(B, Hq, Hk, T, L)
        walls = {name: wall_ms(fn) for name, fn in calls.items()}
        best_sdpa = min(t for name, t in walls.items() if name.startswith("sdpa"))
        floor = best_sdpa + depth_bytes / bandwidth * 1e3
        for name, fn in calls.items():
            ratio = "-" if name.startswith("sdpa") else f"{walls[name] / floor:.2f}"
            print(f"| {B} | {Hq} | {Hk} | {T} | {L} | {name} | {walls[name]:.3f} | {host_ms(fn):.3f} | "
                  f"{floor:.3f} | {ratio} |")  # fmt: skip
        if args.profile:
            print(profile(calls["moda-entries"]))


if __name__ == "__main__":
    main()
