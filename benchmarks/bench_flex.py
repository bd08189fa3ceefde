"""The flex backend against FlexAttention itself: each design of ``flex_moda`` beside plain ``flex_attention`` and SDPA.

Forward + backward of one causal call, B=1, Hq=64, Hk=8, D=64, bf16, at
T = 1024, 4096, 16384: flex MoDA with L=64 depth slots in each design of
:data:`moda_flex.backends.flex.DESIGNS` (``"concat"``, one call over
``[sequence | depth]``, is :data:`~moda_flex.backends.flex.DESIGN`, what
``backend="flex"`` runs; ``"split"`` merges a separate depth part through
the lse) and with L=0 (one row: a call without depth is the same in every
design), plain ``flex_attention`` with a causal BlockMask and
``enable_gqa=True``, and ``scaled_dot_product_attention`` (FlashAttention on
CUDA). Median ms of ``triton.testing.do_bench`` after warm-up
(``time.perf_counter`` on CPU), then each MoDA row over plain flex against
its target (L=0 <= 1.10 at every T; L=64 <= 1.8, 1.5, 1.5 at T = 1024,
4096, 16384).

Before timing, each design is checked against the float32 reference on the
output, the lse and the gradients of q, k, v, depth_k and depth_v (at
T=1000, not a multiple of the 128-row blocks), and each design's compiled
graph is counted: after the first two lengths (a static graph, then a
dynamic one), a new length must compile nothing.

Usage::

    python benchmarks/bench_flex.py                       # CUDA: every design, L=0, plain flex and SDPA
    python benchmarks/bench_flex.py --designs concat      # the design backend="flex" runs (and L=0)
    python benchmarks/bench_flex.py --device cpu --tiny   # tiny sizes, float32, eager: the script itself
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402

from moda_flex import causal  # noqa: E402
from moda_flex.backends.flex import DESIGNS, flex_moda  # noqa: E402
from moda_flex.backends.reference import reference_attention  # noqa: E402
from moda_flex.testing import relative_error, tolerance  # noqa: E402

# (B, Hq, Hk, D), lengths, the L of the MoDA rows, and the length the check runs at.
SHAPE, LENGTHS, SLOTS, CHECK_LEN = (1, 64, 8, 64), (1024, 4096, 16384), (64, 0), 1000
TINY_SHAPE, TINY_LENGTHS, TINY_SLOTS, TINY_CHECK_LEN = (1, 4, 2, 16), (40, 70, 130), (3, 0), 37
# MoDA / plain flex_attention, per L and T: the targets.
TARGETS = {0: {1024: 1.10, 4096: 1.10, 16384: 1.10}, 64: {1024: 1.8, 4096: 1.5, 16384: 1.5}}
NAMES = ("q", "k", "v", "depth_k", "depth_v")


def make_inputs(shape, T: int, L: int, device, dtype, seed: int = 0) -> list:
    """q (B, Hq, T, D), k and v (B, Hk, T, D), depth_k and depth_v (B, Hk, T, L, D): leaves that require grad."""
    B, Hq, Hk, D = shape
    g = torch.Generator(device=device).manual_seed(seed)
    sizes = [(B, Hq, T, D), (B, Hk, T, D), (B, Hk, T, D), (B, Hk, T, L, D), (B, Hk, T, L, D)]
    return [torch.randn(*size, device=device, generator=g).to(dtype).requires_grad_() for size in sizes]


def moda_step(design: str, inputs: list, compiled: bool):
    """One forward + backward of flex MoDA, causal, in ``design``."""
    grad_out = torch.randn_like(inputs[0])
    scale = inputs[0].shape[-1] ** -0.5

    def step():
        out = flex_moda(*inputs, causal(), scale, compiled=compiled, return_lse=False, design=design)
        torch.autograd.grad(out, inputs, grad_out)

    return step


def plain_flex_step(inputs: list, compiled: bool):
    """One forward + backward of ``flex_attention`` with a causal BlockMask and grouped queries."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = inputs[:3]
    T = q.shape[2]

    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    block_mask = create_block_mask(causal_mask, None, None, T, T, device=q.device)
    grad_out = torch.randn_like(q)
    if compiled:
        flex = torch.compile(flex_attention)

        def forward():
            return flex(q, k, v, block_mask=block_mask, enable_gqa=True)

    else:  # the public function refuses a backward on CPU; its eager operator has one
        from moda_flex.backends.flex import eager_flex_with_grad

        def forward():
            return eager_flex_with_grad(q, k, v, block_mask, q.shape[-1] ** -0.5)[0]

    def step():
        torch.autograd.grad(forward(), [q, k, v], grad_out)

    return step


def sdpa_step(inputs: list):
    q, k, v = inputs[:3]
    grad_out = torch.randn_like(q)

    backend = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH

    def step():
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, [q, k, v], grad_out)

    return step


def time_ms(step, device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``step``: ``do_bench`` on CUDA, ``repeats`` timed runs after ``warmup`` elsewhere."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(step, warmup=25, rep=100, return_mode="median")
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def check(design: str, shape, T: int, L: int, device, dtype, compiled: bool) -> tuple[bool, str]:
    """Whether ``design`` matches the reference on out, lse and every gradient, and the errors as text."""
    inputs = make_inputs(shape, T, L, device, torch.float32, seed=1)
    mine = [t.detach().to(dtype).requires_grad_() for t in inputs]
    scale = shape[-1] ** -0.5
    out, lse = flex_moda(*mine, causal(), scale, compiled=compiled, design=design)
    ref_out, ref_lse = reference_attention(*inputs, causal(), scale)
    grad_out = torch.randn_like(ref_out)
    grads = torch.autograd.grad(out, mine, grad_out.to(dtype))
    ref_grads = torch.autograd.grad(ref_out, inputs, grad_out)
    errors = {"out": relative_error(out, ref_out), "lse": relative_error(lse, ref_lse)}
    errors.update({f"d{name}": relative_error(g, r) for name, g, r in zip(NAMES, grads, ref_grads) if r.numel()})
    limit = tolerance(dtype, device)
    ok = all(error <= limit for error in errors.values())
    text = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    return ok, f"{text} (tolerance {limit:.0e})"


def unique_graphs() -> int:
    from torch._dynamo.utils import counters  # dynamo's own tally of compiled graphs

    return counters["stats"]["unique_graphs"]


def main(argv=None) -> dict:
    """Check, count graphs, time; print the table and return ``{(row, T): ms}``."""
    p = cli.parser(__doc__)
    cli.add_device(p)
    p.add_argument("--tiny", action="store_true", help=f"shape {TINY_SHAPE}, T in {TINY_LENGTHS}, float32")
    p.add_argument("--designs", type=cli.choice_list(DESIGNS), default=",".join(DESIGNS),
                   help=f"comma-separated, from {', '.join(DESIGNS)}")  # fmt: skip
    p.add_argument("--warmup", type=cli.at_least(1), default=3, help="untimed runs per case (compilation)")
    p.add_argument("--repeats", type=cli.at_least(1), default=5, help="timed runs per case off CUDA")
    args = p.parse_args(argv)
    device = cli.check_device(p, args.device)
    tiny = args.tiny or device.type != "cuda"
    shape, lengths, slots, check_len = (
        (TINY_SHAPE, TINY_LENGTHS, TINY_SLOTS, TINY_CHECK_LEN) if tiny else (SHAPE, LENGTHS, SLOTS, CHECK_LEN)
    )
    dtype = torch.float32 if tiny else torch.bfloat16
    # Inductor compiles FlexAttention on CPU for inference only: off CUDA everything runs eagerly.
    compiled = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    B, Hq, Hk, D = shape
    print(f"# {name}, torch {torch.__version__}, {dtype}, causal, B={B} Hq={Hq} Hk={Hk} D={D}, "
          f"forward + backward, median ms{'' if compiled else ', eager'}")  # fmt: skip
    print()

    times, failed = {}, False
    # Without depth every design makes the same call: one row.
    cases = [(design, L) for L in slots for design in (args.designs if L else args.designs[:1])]
    labels = {(design, L): f"flex MoDA {design}, L={L}" if L else "flex MoDA, L=0" for design, L in cases}
    for design, L in cases:
        row = labels[design, L]
        torch._dynamo.reset()  # each row compiles afresh: its graphs are counted alone
        ok, errors = check(design, shape, check_len, L, device, dtype, compiled)
        failed |= not ok
        print(f"check {row}, T={check_len}: {'ok' if ok else 'FAILED'}: {errors}", flush=True)
        graphs = None
        for i, T in enumerate(lengths):
            times[row, T] = time_ms(moda_step(design, make_inputs(shape, T, L, device, dtype), compiled), device,
                                    args.warmup, args.repeats)  # fmt: skip
            if i == 0:  # the check's length, then this one: the static graph and the dynamic one
                graphs = unique_graphs()
        if compiled:
            new = unique_graphs() - graphs
            failed |= new > 0
            print(f"recompiles of {row} at T={lengths[1:]} after T={lengths[0]}: {new}", flush=True)
    for T in lengths:
        inputs = make_inputs(shape, T, 0, device, dtype)
        times["plain flex_attention", T] = time_ms(plain_flex_step(inputs, compiled), device, args.warmup,
                                                   args.repeats)  # fmt: skip
        times["SDPA", T] = time_ms(sdpa_step(inputs), device, args.warmup, args.repeats)

    moda_rows = [labels[case] for case in cases]
    rows = moda_rows + ["plain flex_attention", "SDPA"]
    print()
    print("| T | " + " | ".join(rows) + " | " + " | ".join(f"{r} / plain" for r in moda_rows) + " |")
    print("|---" * (1 + len(rows) + len(moda_rows)) + "|")
    for T in lengths:
        plain = times["plain flex_attention", T]
        cells = [f"{times[r, T]:.3f}" for r in rows]
        for case in cases:
            ratio = times[labels[case], T] / plain
            target = TARGETS.get(case[1], {}).get(T)
            mark = "" if target is None else (" (<= %.2f ok)" % target if ratio <= target else " (> %.2f)" % target)
            cells.append(f"{ratio:.2f}{mark}")
        print(f"| {T} | " + " | ".join(cells) + " |", flush=True)
    if failed:
        print("\nA check or the recompile count failed (above).")
    return times


if __name__ == "__main__":
    main()
