"""Data-parallel scaling of the example GPT: tokens/s on one GPU against N GPUs under DDP and FSDP2.

    python benchmarks/bench_data_parallel.py                       # Table 6 model, 1 vs 2 GPUs, DDP and FSDP2
    python benchmarks/bench_data_parallel.py --nproc 4 --steps 100 --out-dir results/dp
    python benchmarks/bench_data_parallel.py --device cpu --shape tiny --batch-size 4 --steps 4 \
        --skip-timing 1 --out-dir /tmp/dp                          # gloo on CPU: the whole run, in seconds

Each mode is one run of ``examples/train_gpt.py`` at the paper's Table 6
shape (24 layers, width 384, 6 query / 2 KV heads, post-norm, T=512, bf16,
compiled), training the baseline and MoDA (attention + FFN depth K/V) for
``--steps`` steps: ``single`` with ``python`` on one GPU, ``ddp`` and
``fsdp`` with ``torchrun --nproc-per-node N``. Every GPU gets ``--batch-size``
sequences per step (weak scaling: the global batch grows with N), so a mode's
``scaling`` is its tokens/s over N times the one-GPU tokens/s. Step times
leave out the first ``--skip-timing`` steps (compilation). Each run's own
table stays in ``<out-dir>/<mode>/results.md``; the combined table goes to
``<out-dir>/results.md``. ``--device cpu`` runs the same commands on CPU
processes over gloo (float32, not compiled unless ``--compile``), and
``--shape tiny`` a 2-layer model of width 32: a check that every mode runs
end to end, not a measurement.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "table6": ["--n-layer", "24", "--n-embd", "384", "--n-head", "6", "--n-kv-head", "2", "--norm", "post",
               "--block-size", "512"],
    "tiny": ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--n-kv-head", "1", "--norm", "post",
             "--block-size", "32"],
}  # fmt: skip
MODES = ("single", "ddp", "fsdp")


def command(mode: str, nproc: int, args, out: Path) -> list[str]:
    """The command line of one mode's training run."""
    flags = [*SHAPES[args.shape], "--depth-kv", args.arms, "--steps", str(args.steps),
             "--skip-timing", str(args.skip_timing), "--sample-tokens", "0", "--eval-iters", "4",
             "--device", args.device, "--out-dir", str(out), "--overwrite"]  # fmt: skip
    if args.compile is not None:
        flags.append("--compile" if args.compile else "--no-compile")
    script = str(ROOT / "examples" / "train_gpt.py")
    if mode == "single":
        return [sys.executable, script, *flags, "--batch-size", str(args.batch_size)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [*launcher, script, *flags, "--batch-size", str(args.batch_size * nproc), "--parallel", mode]


def read_table(path: Path) -> list[dict]:
    """The rows of a results.md written by train_gpt.py: name, tokens/s, step ms, peak MiB (found by header).

    On CPU the table has no peak memory ("n/a" here), and a timing taken while other processes held
    the CPU carries a "(disturbed)" mark after its number.
    """
    header, _, *lines = [[cell.strip() for cell in line.strip().strip("|").split("|")]
                         for line in path.read_text().splitlines() if line.startswith("|")]  # fmt: skip
    column = {name: header.index(name) for name in ("model", "tokens/s", "step (ms)")}
    peak = header.index("peak mem (MiB)") if "peak mem (MiB)" in header else None

    def number(cell: str) -> float:
        return float(cell.split()[0].replace(",", ""))

    return [
        {"name": cells[column["model"]], "tok_s": number(cells[column["tokens/s"]]),
         "step_ms": number(cells[column["step (ms)"]]), "peak_mib": "n/a" if peak is None else cells[peak]}
        for cells in lines
    ]  # fmt: skip


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda: NCCL; cpu: gloo processes")
    p.add_argument("--shape", choices=sorted(SHAPES), default="table6", help="the model: the paper's, or a tiny one")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: train_gpt's, on for cuda)")  # fmt: skip
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs on cuda) of the ddp and fsdp runs")
    p.add_argument("--modes", type=cli.choice_list(MODES), default=",".join(MODES),
                   help=f"comma-separated, from {', '.join(MODES)}; single comes first")  # fmt: skip
    p.add_argument("--arms", default="none,attn+ffn", help="train_gpt's --depth-kv: the models compared")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per GPU per step")
    p.add_argument("--steps", type=int, default=80, help="training steps per model")
    p.add_argument("--skip-timing", type=int, default=20, help="first steps left out of the timings (compilation)")
    p.add_argument("--out-dir", default="results/data_parallel", help="each run's folder and the combined table")
    args = p.parse_args(argv)
    if args.device == "cuda":
        cli.require_cuda(p, "bench_data_parallel.py --device cuda")
        if torch.cuda.device_count() < args.nproc:
            p.error(f"--nproc {args.nproc}: this machine has {torch.cuda.device_count()} CUDA device(s)")

    out = Path(args.out_dir)
    tables = {}
    for mode in args.modes:
        run_cmd = command(mode, args.nproc, args, out / mode)
        print("$ " + " ".join(run_cmd), flush=True)
        subprocess.run(run_cmd, check=True, cwd=ROOT)
        tables[mode] = read_table(out / mode / "results.md")

    single = {row["name"]: row for row in tables.get("single", [])}
    cuda = args.device == "cuda"
    device = torch.cuda.get_device_name() if cuda else "CPU (gloo)"
    block = SHAPES[args.shape][SHAPES[args.shape].index("--block-size") + 1]
    compiled = "compiled" if (cuda if args.compile is None else args.compile) else "eager"
    unit = "GPUs" if cuda else "processes"
    lines = [
        f"{device}, torch {torch.__version__}; {args.shape} model, {args.batch_size} x {block} tokens per process "
        f"per step, {'bf16' if cuda else 'float32'}, {compiled}, {args.steps} steps ({args.skip_timing} untimed)",
        "",
        f"| model | mode | {unit} | tokens/s | step (ms) | peak mem rank 0 (MiB) | scaling |",
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
