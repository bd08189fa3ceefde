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
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from moda_flex import depth
from moda_flex.backends import slots

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from bench_call import copy_bandwidth  # noqa: E402

SHAPES = {
    "table6": dict(config=dict(n_layer=24, n_embd=384, n_head=6, n_kv_head=2, norm="post"), batch=32, seq=512),
    "gpt2s": dict(config=dict(n_layer=12, n_embd=768, n_head=12, n_kv_head=4, norm="pre"), batch=8, seq=1024),
}
ARMS = ("none", "attn", "attn+ffn")
MODES = ("eager", "compiled", "reduce-overhead")


# What a kernel's name says it computes, first match wins: the vendor's attention (the sequence part, and all
# of the baseline's attention); the split path's depth kernels (the merge with the sequence part is fused into
# the depth forward) and its NaN rule's passes; the fused MoDA kernels (sequence and depth in one); cuBLAS's
# products; inductor's generated kernels (norms, rotations, the sums of each depth entry's gradients); the rest.
KERNEL_KINDS = (
    ("vendor attention", ("flash", "fmha", "cudnn", "attention")),  # first: FlashAttention has a "convert_dq_kernel"
    ("split depth + merge", ("_depth_forward", "_depth_backward")),
    ("split NaN passes", ("_sanitize_kv", "_prepare_backward")),
    ("fused moda", ("forward_kernel", "dq_kernel", "dkdv_kernel")),
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


def measure(config: GPTConfig, batch: int, seq: int, mode: str, steps: int, warmup: int,
            profile: bool = False, host_profile: bool = False) -> dict:  # fmt: skip
    """Median step time (ms), the host's median time to issue a step (ms) and peak memory (MiB) of one model.

    ``profile`` prints its top kernels (torch.profiler), its kernel launches
    per step and the step's time by kind (:func:`time_split`: the kinds of
    :data:`KERNEL_KINDS`, other, and the host gap),
    ``host_profile`` its top Python functions by own time and by cumulative
    time (cProfile), both over 3 steps.
    """
    torch.manual_seed(0)
    model = GPT(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if mode == "eager":
        run = model
    else:
        run = torch.compile(model, fullgraph=True, mode=None if mode == "compiled" else mode)
    idx = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")

    def step():
        torch.compiler.cudagraph_mark_step_begin()  # a new step: the graphs' outputs of the last may be overwritten
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = run(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
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
    tables = (slots._PINNED.made - tables_before) / steps  # a table made is a call whose addresses are new
    ms = 1e3 * statistics.median(times)
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
        gpu_events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        split = time_split({e.key: e.self_device_time_total for e in gpu_events}, 3, ms)
        launches = sum(e.count for e in gpu_events) / 3
        print(f"  per step: {launches:.0f} kernels; " + ", ".join(f"{kind} {t:.2f} ms" for kind, t in split.items()),
              flush=True)
    if host_profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        profiler.disable()
        for order in ("tottime", "cumulative"):  # where the host's time goes, then which calls hold it
            pstats.Stats(profiler).sort_stats(order).print_stats(30)
    del model, optimizer, run
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return {"ms": ms, "host_ms": 1e3 * statistics.median(issued), "peak_mib": peak, "tables": tables}


@contextlib.contextmanager
def entry_gradients(how: str):
    """Inside the block, a depth stream's entries get their gradients by ``how``: ``auto`` (the stream's
    default, :func:`moda_flex.depth.buffers_gradients`), ``buffer`` or ``summed`` (each entry its own)."""
    choices = {"auto": depth.buffers_gradients, "buffer": lambda choice: True, "summed": lambda choice: False}
    if how not in choices:
        raise ValueError(f"--entry-gradients takes {', '.join(choices)}, got {how!r}")
    default = depth.buffers_gradients
    depth.buffers_gradients = choices[how]
    try:
        yield
    finally:
        depth.buffers_gradients = default


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="table6", help="model and batch shape")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated depth_kv values, from {ARMS}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}")
    p.add_argument("--steps", type=int, default=20, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first, compilation included")
    p.add_argument("--profile", action="store_true", help="print each row's top kernels and its time by kind over 3 steps (torch.profiler)")
    p.add_argument("--host-profile", action="store_true", help="print each row's top Python functions (cProfile)")
    p.add_argument("--entry-gradients", default="auto",
                   help="comma-separated, from auto (the depth stream's default), buffer (each layer's kernel adds "
                        "into the stream's one gradient buffer, where it can: moda_flex.backends.chain) and summed "
                        "(each entry sums its readers' gradients): a row of MoDA for each")  # fmt: skip
    cli.add_backend(p)
    args = p.parse_args(argv)
    cli.require_cuda(p, "bench_model.py")
    shape = SHAPES[args.shape]
    arms, modes = args.arms.split(","), args.modes.split(",")
    bandwidth = copy_bandwidth()
    B, T = shape["batch"], shape["seq"]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, shape {args.shape} "
          f"{shape['config']} B={B} T={T}, bf16, MoDA backend {args.backend}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")  # fmt: skip

    rows = []
    for arm in arms:
        for mode in modes:
            for how in ["auto"] if arm == "none" else args.entry_gradients.split(","):
                # the baseline keeps auto (SDPA), the attention a user compares against
                backend = "auto" if arm == "none" else args.backend
                config = GPTConfig(**shape["config"], depth_kv=arm, block_size=T, backend=backend)
                with entry_gradients(how):
                    result = measure(config, B, T, mode, args.steps, args.warmup, args.profile, args.host_profile)
                Hk, D = config.n_kv_head, config.n_embd // config.n_head
                floor_bytes = 6 * depth_reads(config) * B * Hk * T * D * 2
                name = arm if how == "auto" else f"{arm}, {how}"
                rows.append({"arm": name, "mode": mode, "floor_ms": floor_bytes / bandwidth * 1e3, **result})
                print(f"  {name:9s} {mode:9s} {result['ms']:8.1f} ms (host {result['host_ms']:.1f})  "
                      f"{result['peak_mib']:8.0f} MiB  {result['tables']:.1f} slot tables made a step",
                      flush=True)  # fmt: skip

    bases = {r["mode"]: r for r in rows if r["arm"] == "none"}
    print()
    print("| model | mode | step (ms) | host (ms) | tokens/s | peak (MiB) | step / base | mem / base "
          "| floor (ms) | base+floor (ms) | step / (base+floor) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = bases.get(r["mode"], rows[0])
        target = base["ms"] + r["floor_ms"]
        print(f"| {r['arm']} | {r['mode']} | {r['ms']:.1f} | {r['host_ms']:.1f} | {B * T / r['ms'] * 1e3:,.0f} | "
              f"{r['peak_mib']:.0f} | "
              f"{r['ms'] / base['ms']:.2f}x | {r['peak_mib'] / base['peak_mib']:.2f}x | {r['floor_ms']:.2f} | "
              f"{target:.1f} | {r['ms'] / target:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
