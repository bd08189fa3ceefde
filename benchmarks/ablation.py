"""The paper's Table 5 kernel ablation, with this library's parts: forward + backward of causal MoDA.

    python benchmarks/ablation.py                      # B=1 T=1024 G=8 Hq=64 Hk=8 D=64 L=64, bf16, on a GPU
    python benchmarks/ablation.py --device cpu --quick # tiny sizes, float32: every row runs and is checked

Rows (each adds one idea to the one before, as in the paper):

1. naive PyTorch: a Python loop over query tokens; token t attends to keys
   0..t and its own L depth slots, every head separately.
2. flash-compatible layout: the depth K/V flattened into one key axis of
   T * L entries after the T sequence keys, and one ``flex_attention`` call
   (GQA) over all T + T * L columns with the MoDA mask applied: every
   128-column block of the depth axis is visited by every query block.
3. chunk-aware: ``moda_attention(..., backend="flex")``: the depth entries
   packed token after token and a BlockMask built from the structure, so a
   block of queries visits only its own chunk of depth columns (the G query
   heads of a KV head are folded into its rows).
4. group-aware: ``moda_attention(..., backend="triton")``: the fused kernel
   that reads each token's depth slots once for the G heads of its group.

Each row's output and its five input gradients are checked against the
reference backend (relative RMS error), then timed: median of ``--repeats``
after ``--warmup`` runs. The table puts the paper's A100 figures beside the
measured ones; the device here is named in the header.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402

PAPER_MS = {1: 2128.9, 2: 13.102, 3: 6.286, 4: 1.460}  # Table 5, one A100, bf16
ROWS = {
    1: "naive PyTorch (loop over tokens)",
    2: "flash-compatible layout (flex, whole depth axis)",
    3: "+ chunk-aware (moda_attention flex)",
    4: "+ group-aware (moda_attention triton)",
}
FULL_SHAPE = dict(B=1, T=1024, Hk=8, G=8, D=64, L=64)
QUICK_SHAPE = dict(B=1, T=40, Hk=2, G=2, D=16, L=3)
BLOCK = 128  # FlexAttention's block size


def naive(q, k, v, depth_k, depth_v, scale: float):
    """Row 1: token by token, each query head with its own copy of its group's keys.

    q (B, Hq, T, D); k, v (B, Hk, T, D); depth_k, depth_v (B, Hk, T, L, D).
    """
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, Hq, T, D)
    depth_k, depth_v = depth_k.repeat_interleave(G, dim=1), depth_v.repeat_interleave(G, dim=1)  # (B, Hq, T, L, D)
    outputs = []
    for t in range(q.shape[2]):
        keys = torch.cat([k[:, :, : t + 1], depth_k[:, :, t]], dim=2)  # (B, Hq, t + 1 + L, D)
        values = torch.cat([v[:, :, : t + 1], depth_v[:, :, t]], dim=2)
        weights = torch.softmax(scale * q[:, :, t : t + 1] @ keys.transpose(-1, -2), dim=-1)  # (B, Hq, 1, t + 1 + L)
        outputs.append(weights @ values)  # (B, Hq, 1, D)
    return torch.cat(outputs, dim=2)  # (B, Hq, T, D)


def flat_block_mask(T: int, L: int, device):
    """Row 2's BlockMask over ``[T keys | T * L depth entries]``: causal sequence blocks, every depth block.

    Sequence blocks wholly below the diagonal are full; the diagonal ones and
    every block holding depth columns are partial, so the mask is applied to
    every element of the depth axis.
    """
    from torch.nn.attention.flex_attention import BlockMask

    columns = T + T * L

    def mask_mod(b, h, q_idx, kv_idx):
        sequence = (kv_idx < T) & (kv_idx <= q_idx)
        own_depth = (kv_idx >= T) & ((kv_idx - T) // L == q_idx)
        return sequence | own_depth

    q_blocks, kv_blocks = -(-T // BLOCK), -(-columns // BLOCK)
    partial, full = [], []
    for i in range(q_blocks):
        last_query = min(T, (i + 1) * BLOCK) - 1
        full.append([j for j in range(kv_blocks) if (j + 1) * BLOCK <= min(T, i * BLOCK + 1)])
        partial.append([j for j in range(kv_blocks) if j not in full[i] and (j * BLOCK <= last_query or
                                                                              (j + 1) * BLOCK > T)])  # fmt: skip

    def as_tensors(lists):
        counts = torch.tensor([len(x) for x in lists], dtype=torch.int32, device=device)
        indices = torch.zeros(q_blocks, kv_blocks, dtype=torch.int32, device=device)
        for i, x in enumerate(lists):
            indices[i, : len(x)] = torch.tensor(x, dtype=torch.int32)
        return counts.view(1, 1, -1), indices.view(1, 1, q_blocks, kv_blocks)

    return BlockMask.from_kv_blocks(*as_tensors(partial), *as_tensors(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(T, columns))  # fmt: skip


def flash_compatible(block_mask):
    """Row 2: one flex_attention call over the flattened depth axis, under ``block_mask``."""
    if torch.cuda.is_available():
        from torch.nn.attention.flex_attention import flex_attention

        compiled = torch.compile(flex_attention)
    else:
        compiled = None

    def run(q, k, v, depth_k, depth_v, scale: float):
        B, Hk, T, L, D = depth_k.shape
        keys = torch.cat([k, depth_k.reshape(B, Hk, T * L, D)], dim=2)  # (B, Hk, T + T*L, D)
        values = torch.cat([v, depth_v.reshape(B, Hk, T * L, D)], dim=2)
        if compiled is not None and q.is_cuda:
            return compiled(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)
        # FlexAttention's public function has no backward on CPU; the library's CPU path (its eager
        # operator, one KV head per query head) serves this check at small sizes.
        from moda_flex.backends.flex import eager_flex_with_grad

        G = q.shape[1] // Hk
        keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
        return eager_flex_with_grad(q, keys, values, block_mask, scale)[0]

    return run


def library(backend: str):
    """Rows 3 and 4: moda_attention on one backend."""
    from moda_flex import moda_attention

    def run(q, k, v, depth_k, depth_v, scale: float):
        return moda_attention(q, k, v, depth_k, depth_v, scale=scale, backend=backend)

    return run


def implementation(row: int, shape: dict, device):
    """The function ``(q, k, v, depth_k, depth_v, scale) -> out`` of one row."""
    if row == 1:
        return naive
    if row == 2:
        return flash_compatible(flat_block_mask(shape["T"], shape["L"], device))
    return library("flex" if row == 3 else "triton")


def inputs(shape: dict, device, dtype, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v, depth_k, depth_v as leaves that require grad."""
    B, T, Hk, G, D, L = (shape[n] for n in ("B", "T", "Hk", "G", "D", "L"))
    generator = torch.Generator(device=device).manual_seed(seed)
    shapes = [(B, Hk * G, T, D), (B, Hk, T, D), (B, Hk, T, D), (B, Hk, T, L, D), (B, Hk, T, L, D)]
    return [torch.randn(s, generator=generator, device=device, dtype=dtype).requires_grad_() for s in shapes]


def forward_backward(fn, leaves, grad_out, scale: float) -> list[torch.Tensor]:
    """The output and the gradients of the five inputs."""
    out = fn(*leaves, scale)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def relative_error(results: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The largest RMS error relative to the RMS of the expected tensor, over output and gradients."""
    return max(
        float((r.float() - e.float()).pow(2).mean().sqrt() / e.float().pow(2).mean().sqrt().clamp_min(1e-30))
        for r, e in zip(results, expected)
    )


def time_ms(fn, leaves, grad_out, scale: float, warmup: int, repeats: int) -> float:
    """Median milliseconds of one forward + backward, after ``warmup`` untimed runs."""
    device = leaves[0].device
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        forward_backward(fn, leaves, grad_out, scale)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def table(results: dict) -> str:
    """Markdown: measured and paper milliseconds, and each row's speedup over row 1 and the row before."""
    lines = [
        "| row | implementation | ms | vs (1) | vs row before | rel. error | paper A100 ms | paper vs (1) | "
        "paper vs row before |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row, (ms, error) in results.items():
        before = results.get(row - 1)
        ours_before = f"{before[0] / ms:.2f}x" if before else "-"
        paper_before = f"{PAPER_MS[row - 1] / PAPER_MS[row]:.2f}x" if row > 1 else "-"
        lines.append(
            f"| ({row}) | {ROWS[row]} | {ms:.3f} | {results[1][0] / ms:.1f}x | {ours_before} | {error:.1e} | "
            f"{PAPER_MS[row]:.3f} | {PAPER_MS[1] / PAPER_MS[row]:.1f}x | {paper_before} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Run the four rows; print and return {row: (ms, relative error)}."""
    p = cli.parser(__doc__)
    cli.add_device(p)
    p.add_argument("--quick", action="store_true", help=f"tiny sizes {QUICK_SHAPE} instead of {FULL_SHAPE}")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="input dtype (default: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per row (compilation, autotuning)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per row (row 1: at most 3)")
    p.add_argument("--rows", default="1,2,3,4", help="comma-separated rows to run, from 1,2,3,4")
    p.add_argument("--markdown", help="also write the table to this file (default: print only)")
    args = p.parse_args(argv)
    device = cli.check_device(p, args.device)
    try:
        rows = sorted({int(r) for r in args.rows.split(",")})
    except ValueError:
        rows = []
    if not rows or not set(rows) <= set(ROWS) or 1 not in rows:
        p.error(f"--rows {args.rows!r}: a comma-separated subset of 1,2,3,4 that includes row 1 (the baseline)")
    if device.type == "cpu":
        # The fused kernel runs on CPU through Triton's interpreter, chosen before triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    leaves = inputs(shape, device, dtype)
    grad_out = torch.randn_like(leaves[0])
    scale = 1.0 / math.sqrt(shape["D"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {name}, torch {torch.__version__}, {dtype}, {shape}, causal, forward + backward")

    expected = forward_backward(library("reference"), leaves, grad_out, scale)
    results = {}
    for row in rows:
        fn = implementation(row, shape, device)
        error = relative_error(forward_backward(fn, leaves, grad_out, scale), expected)
        repeats = min(args.repeats, 3) if row == 1 else args.repeats
        ms = time_ms(fn, leaves, grad_out, scale, 0 if row == 1 else args.warmup, repeats)
        results[row] = (ms, error)
        print(f"  ({row}) {ROWS[row]}: {ms:.3f} ms, relative error {error:.1e}", flush=True)
    text = table(results)
    print()
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(f"{name}, torch {torch.__version__}, {dtype}, {shape}\n\n{text}\n")
    return results


if __name__ == "__main__":
    main()
