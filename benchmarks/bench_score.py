"""What a score function costs: forward + backward of causal MoDA with softcap and a learned depth bias.

For each shape and backend (``triton``: the fused kernels; ``flex``:
FlexAttention, compiled on CUDA), one ``moda_attention`` call, forward +
backward, with no score, ``softcap(CAP)``, ``depth_bias`` (a learned (Hq, L)
bias, whose gradient is computed too) and ``softcap(CAP) & depth_bias``.
Random inputs, depth as a (B, Hk, T, L, D) view of a larger slot buffer;
median of repeats after warm-up. Prints ms per call and the ratio to the same
backend with no score.

Usage::

    python benchmarks/bench_score.py                       # B=8, Hq/Hk 6/2 and 16/4, T=2048, L=24, D=64, bf16
    python benchmarks/bench_score.py --backends triton     # the fused kernels only
    python benchmarks/bench_score.py --device cpu --tiny   # tiny sizes, float32, triton through its interpreter
    python benchmarks/bench_score.py --backends flex --scores depth_bias --flex-options '{"num_stages": 1}'

``--flex-options`` replaces the kernel options the flex backend passes when a
score's tensors learn (``LEARNED_SCORE_KERNEL_OPTIONS``); a case that fails to
compile is reported in the table, not fatal.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402

# (B, Hq, Hk, T, L, D): a small model's layer (G = 3) and a wider one (G = 4).
SHAPES = [(8, 6, 2, 2048, 24, 64), (8, 16, 4, 2048, 24, 64)]
TINY_SHAPES = [(1, 4, 2, 24, 3, 16)]
SCORES = ("none", "softcap", "depth_bias", "softcap & depth_bias")
BACKENDS = ("triton", "flex")


def make_score(name: str, cap: float, q_heads: int, slots: int, device):
    """The score ``name`` of SCORES (None for "none") and the bias it learns (or None)."""
    from moda_flex import depth_bias, softcap

    if name == "none":
        return None, None
    if name == "softcap":
        return softcap(cap), None
    bias = torch.zeros(q_heads, slots, device=device, requires_grad=True)  # a layer's (Hq, L) parameter
    return (depth_bias(bias) if name == "depth_bias" else softcap(cap) & depth_bias(bias)), bias


def make_step(backend: str, score_name: str, shape: tuple, cap: float, device, dtype):
    """A closure running one forward + backward, its inputs made once."""
    from moda_flex import moda_attention

    B, Hq, Hk, T, L, D = shape
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return torch.randn(*size, device=device, dtype=dtype, generator=g)

    q, k, v = (rand(B, H, T, D).requires_grad_() for H in (Hq, Hk, Hk))
    # (B, Hk, T, L, D) views of an (L + 8)-slot buffer, read in place
    depth_k, depth_v = (rand(B, Hk, T, L + 8, D)[:, :, :, :L].requires_grad_() for _ in range(2))
    grad_out = rand(B, Hq, T, D)
    score, bias = make_score(score_name, cap, Hq, L, device)
    leaves = [q, k, v, depth_k, depth_v] + ([] if bias is None else [bias])

    def step():
        out = moda_attention(q, k, v, depth_k, depth_v, score=score, backend=backend)
        torch.autograd.grad(out, leaves, grad_out)

    return step


def time_ms(step, device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``step`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main(argv=None) -> list:
    """Time every (shape, backend, score); print a table and return its rows."""
    p = cli.parser(__doc__)
    cli.add_device(p)
    p.add_argument("--tiny", action="store_true", help=f"tiny sizes {TINY_SHAPES} in float32 instead of {SHAPES}")
    p.add_argument("--backends", type=cli.choice_list(BACKENDS), default=",".join(BACKENDS),
                   help=f"comma-separated, from {', '.join(BACKENDS)}")  # fmt: skip
    p.add_argument("--scores", type=cli.choice_list(SCORES), default=",".join(SCORES),
                   help=f"comma-separated, from {', '.join(SCORES)}")  # fmt: skip
    p.add_argument("--flex-options", type=json.loads, help="JSON kernel options for flex when a score learns")
    p.add_argument("--cap", type=float, default=30.0, help="the softcap")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs per case (compilation, autotuning)")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per case")
    args = p.parse_args(argv)
    device = cli.check_device(p, args.device)
    if device.type == "cpu":
        # The fused kernels run on CPU through Triton's interpreter, chosen before triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.flex_options is not None:
        from moda_flex.backends.flex import scoring

        scoring.LEARNED_SCORE_KERNEL_OPTIONS = args.flex_options
    dtype = torch.bfloat16 if device.type == "cuda" and not args.tiny else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {name}, torch {torch.__version__}, {dtype}, causal, forward + backward, cap {args.cap:g}, median ms")
    print()
    print("| B | Hq | Hk | T | L | D | backend | score | ms | vs no score |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for shape in TINY_SHAPES if args.tiny else SHAPES:
        torch._dynamo.reset()  # each shape and score compiles flex afresh: stay under dynamo's recompile limit
        for backend in args.backends:
            base = None
            for score_name in args.scores:
                step = make_step(backend, score_name, shape, args.cap, device, dtype)
                try:
                    ms = time_ms(step, device, args.warmup, args.repeats)
                except Exception as error:  # a compile failure is a result here
                    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
                    reason = f"{type(error).__name__}: " + " / ".join(lines[:2])[:160]
                    print("| " + " | ".join(map(str, shape)) + f" | {backend} | {score_name} | failed: {reason} | |",
                          flush=True)  # fmt: skip
                    continue
                if score_name == "none":
                    base = ms
                ratio = ms / base if base else float("nan")
                rows.append((*shape, backend, score_name, ms, ratio))
                print("| " + " | ".join(map(str, shape)) + f" | {backend} | {score_name} | {ms:.3f} | "
                      f"{ratio:.2f} |", flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
