"""Data-parallel scaling of the example GPT: tokens/s on one GPU against N GPUs under DDP and FSDP2.

    python benchmarks/bench_data_parallel.py                       # Table 6 model, 1 vs 2 GPUs, DDP and FSDP2
    python benchmarks/bench_data_parallel.py --nproc 4 --steps 100 --out-dir results/dp

Each mode is one run of ``examples/train_gpt.py`` at the paper's Table 6
shape (24 layers, width 384, 6 query / 2 KV heads, post-norm, T=512, bf16,
compiled), training the baseline and MoDA (attention + FFN depth K/V) for
``--steps`` steps: ``single`` with ``python`` on one GPU, ``ddp`` and
``fsdp`` with ``torchrun --nproc-per-node N``. Every GPU gets ``--batch-size``
sequences per step (weak scaling: the global batch grows with N), so a mode's
``scaling`` is its tokens/s over N times the one-GPU tokens/s. Step times
leave out the first ``--skip-timing`` steps (compilation). Each run's own
table stays in ``<out-dir>/<mode>/results.md``; the combined table goes to
``<out-dir>/results.md``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["--n-layer", "24", "--n-embd", "384", "--n-head", "6", "--n-kv-head", "2", "--norm", "post",
         "--block-size", "512"]  # fmt: skip
MODES = ("single", "ddp", "fsdp")


def command(mode: str, nproc: int, args, out: Path) -> list[str]:
    """The command line of one mode's training run."""
    flags = [*SHAPE, "--depth-kv", args.arms, "--steps", str(args.steps), "--skip-timing", str(args.skip_timing),
             "--sample-tokens", "0", "--eval-iters", "4", "--device", "cuda", "--out-dir", str(out),
             "--overwrite"]  # fmt: skip
    script = str(ROOT / "examples" / "train_gpt.py")
    if mode == "single":
        return [sys.executable, script, *flags, "--batch-size", str(args.batch_size)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [*launcher, script, *flags, "--batch-size", str(args.batch_size * nproc), "--parallel", mode]


def read_table(path: Path) -> list[dict]:
    """The rows of a results.md written by train_gpt.py: name, tokens/s, step ms, peak MiB (found by header)."""
    header, _, *lines = [[cell.strip() for cell in line.strip().strip("|").split("|")]
                         for line in path.read_text().splitlines() if line.startswith("|")]  # fmt: skip
    column = {name: header.index(name) for name in ("model", "tokens/s", "step (ms)", "peak mem (MiB)")}
    return [
        {"name": cells[column["model"]], "tok_s": float(cells[column["tokens/s"]].replace(",", "")),
         "step_ms": float(cells[column["step (ms)"]]), "peak_mib": cells[column["peak mem (MiB)"]]}
        for cells in lines
    ]  # fmt: skip


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--nproc", type=int, default=2, help="GPUs of the ddp and fsdp runs")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}; single comes first")
    p.add_argument("--arms", default="none,attn+ffn", help="train_gpt's --depth-kv: the models compared")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per GPU per step")
    p.add_argument("--steps", type=int, default=80, help="training steps per model")
    p.add_argument("--skip-timing", type=int, default=20, help="first steps left out of the timings (compilation)")
    p.add_argument("--out-dir", default="results/data_parallel", help="each run's folder and the combined table")
    args = p.parse_args(argv)
    cli.require_cuda(p, "bench_data_parallel.py")
    if torch.cuda.device_count() < args.nproc:
        p.error(f"--nproc {args.nproc}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        p.error(f"--modes {args.modes!r}: choose from {MODES}")

    out = Path(args.out_dir)
    tables = {}
    for mode in modes:
        run_cmd = command(mode, args.nproc, args, out / mode)
        print("$ " + " ".join(run_cmd), flush=True)
        subprocess.run(run_cmd, check=True, cwd=ROOT)
        tables[mode] = read_table(out / mode / "results.md")

    single = {row["name"]: row for row in tables.get("single", [])}
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; Table 6 model, {args.batch_size} x 512 tokens "
        f"per GPU per step, bf16, compiled, {args.steps} steps ({args.skip_timing} untimed)",
        "",
        "| model | mode | GPUs | tokens/s | step (ms) | peak mem rank 0 (MiB) | scaling |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, rows in tables.items():
        gpus = 1 if mode == "single" else args.nproc
        for row in rows:
            base = single.get(row["name"])
            scaling = f"{row['tok_s'] / (gpus * base['tok_s']):.2f}" if base else "-"
            lines.append(f"| {row['name']} | {mode} | {gpus} | {row['tok_s']:,.0f} | {row['step_ms']:.1f} | "
                         f"{row['peak_mib']} | {scaling} |")  # fmt: skip
    text = "\n".join(lines)
    print()
    print(text)
    (out / "results.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
