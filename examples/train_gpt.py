"""Train byte-level GPTs with and without MoDA on the same data, and compare them.

    python examples/train_gpt.py                     # baseline vs MoDA, about a minute on 2 CPU cores
    python examples/train_gpt.py --depth-kv attn+ffn --norm pre,post --steps 2000
    python examples/train_gpt.py --data input.txt --n-layer 12 --n-embd 256 --device cuda
    torchrun --nproc-per-node 2 examples/train_gpt.py --parallel ddp --device cuda    # or --parallel fsdp

``--depth-kv`` and ``--norm`` take comma-separated lists: every combination
is trained in turn, from the same seed on the same batches, and a table of
validation loss, parameters and speed is printed at the end. The default is
pre-norm, which trains faster at this small size; the paper sees MoDA's
largest gain with post-norm in deep models (``--norm post``). The default data
is the text of the standard library's ``pydoc_data.topics`` (about 0.46 MB of
English, offline), read as bytes.

Each run saves ``<out-dir>/<name>.pt`` (loadable with ``torch.load(path,
weights_only=True)``) and the table goes to ``<out-dir>/results.md``. The
default ``<out-dir>`` is named after the data and the model shape
(``out/pydoc-4x128`` for the default run), so that runs of other shapes keep
their own files; files of an earlier run are never replaced silently: the
run stops before training unless ``--overwrite`` is given. Progress is a bar
with the time left on a terminal, plain lines in a log, and after the first
timed steps the run prints how long it will take.

Under ``torchrun``, ``--parallel ddp`` (DistributedDataParallel) or
``--parallel fsdp`` (FSDP2, ``fully_shard`` per block) trains each model on
all processes: every rank draws the same global batch of ``--batch-size``
from the one generator and takes its slice, so the data, the loss and the
updates are those of one process. Rank 0 prints and saves.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

import cli
from comparison import format_table, loss_config, noise_note, plot_curves, seed_table, timing_note
from gpt import GPT, GPTConfig, printable
from progress import Progress, format_duration
from training import (PYDOC, UNDISTURBED_SHARE, VAL_FRACTION, Batches, CPUClock, Schedule, Training, device_name,
                      join, load_text, parallelize, save_checkpoint, split)  # fmt: skip

from moda_flex.nn import DEPTH_KV, NORMS

PARALLEL = ("none", "ddp", "fsdp")
ESTIMATE_AFTER = 5  # timed steps before the run's length is estimated


def model_config(args, depth_kv: str, norm: str) -> GPTConfig:
    """The model of one configuration: the shape flags, with this ``depth_kv`` and ``norm``."""
    return GPTConfig(
        n_embd=args.n_embd,
        n_head=args.n_head,
        n_kv_head=args.n_kv_head,
        depth_kv=depth_kv,
        norm=norm,
        backend=args.backend,
        block_size=args.block_size,
        n_layer=args.n_layer,
    )


def run_name(depth_kv: str, norm: str) -> str:
    return {"none": "baseline", "attn": "moda-attn", "attn+ffn": "moda"}[depth_kv] + f"-{norm}"


def share_text(share: float, threads: int) -> str:
    """``"CPU 97% of 2 threads"``, or ``"CPU 45% of 2 threads, disturbed by other processes"``."""
    text = f"CPU {100 * share:.0f}% of {threads} thread{'s' if threads > 1 else ''}"
    return text + (", disturbed by other processes" if share < UNDISTURBED_SHARE else "")


def announce_estimate(progress: Progress, name: str, clock: CPUClock, steps_left: int, steps: int, later_runs: int):
    """One line, after the first timed steps: how long this model and the runs after it will take."""
    step_s = clock.wall / clock.steps
    line = f"  estimate: {format_duration(step_s * steps_left)} more for {name}"
    if later_runs:
        line += f", about {format_duration(step_s * steps * later_runs)} for the {later_runs} run(s) after it"
    line += f" ({1000 * step_s:.0f} ms/step so far"
    if clock.share is not None:
        line += "; " + share_text(clock.share, clock.threads)
    progress.note(line + ")")


def train_one(config: GPTConfig, name: str, seed: int, data: Batches, args, later_runs: int = 0) -> dict:
    """Train one model from ``seed``; save its checkpoint; return its row of the comparison table.

    ``later_runs``: how many models the run trains after this one, for the estimate.
    """
    device, ranks = data.device, data.ranks
    torch.manual_seed(seed)
    model = GPT(config).to(device)
    num_params = model.num_params()  # before FSDP2 replaces the parameters by their shards
    run = parallelize(model, args.parallel, args.compile, device)
    use_bf16 = args.dtype == "bfloat16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    training = Training(run, model, data, Schedule(args.lr, args.warmup, args.steps), seed=seed,
                        weight_decay=args.weight_decay, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
                        skip_timing=args.skip_timing, autocast=autocast)  # fmt: skip

    compiled = ", compiled" if args.compile else ""
    parallel = f", {args.parallel} on {ranks.world} processes" if ranks.world > 1 else ""
    ranks.say(f"== {name}: {num_params / 1e6:.2f}M parameters, depth_kv={config.depth_kv}, norm={config.norm}"
              f"{compiled}{parallel}")  # fmt: skip
    # Ranks other than 0 keep their progress to themselves.
    progress = Progress(args.steps, label="  train", every=args.log_interval,
                        stream=sys.stdout if ranks.main else io.StringIO())  # fmt: skip
    clock = training.clock
    for step in training:
        # Once: every step after the skipped ones is timed, so the count passes ESTIMATE_AFTER at one step.
        if clock.steps == ESTIMATE_AFTER and step.done < args.steps:
            announce_estimate(progress, name, clock, args.steps - step.done, args.steps, later_runs)
        speed = [f"{data.tokens_per_step * clock.steps / clock.wall:,.0f} tok/s"] if clock.steps else []
        progress.update(step.done, f"loss {step.loss:.4f}", *speed)
    progress.close()
    val_loss = training.curve[-1]["val_loss"]
    peak_mb = training.peak_mb
    step_ms = 1000 * clock.wall / clock.steps if clock.steps else None
    line = f"  val loss {val_loss:.4f} nats/byte"
    if step_ms is not None:
        line += f" | {step_ms:.1f} ms/step"
    if peak_mb is not None:
        line += f" | peak {peak_mb:,.0f} MiB"
    if clock.share is not None:
        line += " | " + share_text(clock.share, clock.threads)
    ranks.say(line)

    save_checkpoint(model, Path(args.out_dir) / f"{name}.pt", ranks, step=args.steps, val_loss=val_loss)
    if args.sample_tokens > 0:
        # Every rank samples: an FSDP2 forward gathers parameters from all of them. Decoding runs eagerly
        # (FSDP2's blocks are compiled in place for training; a graph per decoding length is not worth it).
        prompt = data.val[: args.block_size // 4].view(1, -1).to(device)
        model.eval()
        with autocast, torch.compiler.set_stance("force_eager"):
            out = model.generate(prompt, args.sample_tokens, temperature=0.8, top_k=50)
        text = printable(bytes(out[0, prompt.shape[1] :].tolist()))
        ranks.say("  sample: " + text.replace("\n", "\n          "))
    return {
        "name": name,
        "norm": config.norm,
        "params_m": num_params / 1e6,
        "val_loss": val_loss,
        "tok_s": data.tokens_per_step * clock.steps / clock.wall if clock.steps else None,
        "step_ms": step_ms,
        "peak_mb": peak_mb,
        "cpu_share": clock.share,
        "threads": clock.threads,
        "seed": seed,
        "curve": training.curve,
    }


def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--data", default=None, help="a text file, read as bytes (default: the stdlib's pydoc topics)")
    p.add_argument("--depth-kv", default="none,attn+ffn",
                   help=f"comma-separated, from {DEPTH_KV}: none is the baseline, attn+ffn the paper's MoDA")
    p.add_argument("--norm", default="pre", help=f"comma-separated, from {NORMS}")
    cli.add_model_shape(p, n_layer=4, n_embd=128, n_head=4, n_kv_head=2, block_size=128)
    p.add_argument("--batch-size", type=cli.at_least(1), default=8, help="sequences per step, over all processes")
    p.add_argument("--steps", type=cli.at_least(1), default=400, help="training steps per model")
    p.add_argument("--lr", type=cli.positive_float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=cli.at_least(0), default=30, help="steps of linear warmup before the cosine decay")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the matrices")
    p.add_argument("--eval-iters", type=cli.at_least(1), default=20, help="validation batches for the final loss")
    p.add_argument("--log-interval", type=cli.at_least(1), default=None,
                   help="steps between progress lines in a log (default: a tenth of --steps; a terminal gets a bar)")
    p.add_argument("--skip-timing", type=cli.at_least(0), default=3,
                   help="first steps left out of the timings (a run of no more steps reports no timing)")
    p.add_argument("--sample-tokens", type=cli.at_least(0), default=120,
                   help="bytes to sample after training (0: none)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the weights and the batches")
    p.add_argument("--seeds", type=cli.int_list, default=None,
                   help="comma-separated seeds: train every model once per seed, report mean ± std (default: --seed)")
    p.add_argument("--eval-interval", type=cli.at_least(1), default=100,
                   help="steps between points of the validation curve")
    cli.add_device(p, "; under torchrun: cuda")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="bf16 runs under autocast (default: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    cli.add_backend(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile(model, fullgraph=True) for training (default: on CUDA; --no-compile to opt out)")
    p.add_argument("--parallel", choices=PARALLEL, default="none",
                   help="data parallelism under torchrun: DDP, or FSDP2's fully_shard")  # fmt: skip
    p.add_argument("--threads", type=cli.at_least(1), default=None,
                   help="CPU threads for torch (default: the cores this process may use, shared among local ranks)")
    p.add_argument("--out-dir", default=None,
                   help="checkpoints and results.md (default: out/<data>-<n_layer>x<n_embd>, e.g. out/pydoc-4x128)")
    p.add_argument("--overwrite", action="store_true", help="replace the files of an earlier run in --out-dir")
    args = p.parse_args(argv)
    args.depth_kv = args.depth_kv.split(",")
    args.norm = args.norm.split(",")
    args.seeds = args.seeds or [args.seed]
    for flag, values, allowed in (("--depth-kv", args.depth_kv, DEPTH_KV), ("--norm", args.norm, NORMS)):
        for value in values:
            if value not in allowed:
                p.error(f"{flag}: {value!r} is not one of {allowed}")
    device = cli.check_device(p, args.device)
    try:
        configs = [model_config(args, depth_kv, norm) for norm in args.norm for depth_kv in args.depth_kv]
    except ValueError as error:  # the shape flags do not make a model (--n-embd 100 --n-head 3)
        p.error(str(error))
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    for config in configs:
        cli.check_backend(p, args.backend, device, n_head=config.n_head, n_kv_head=config.n_kv_head,
                          head_dim=config.head_dim, slots=config.depth_slots,
                          dtype=getattr(torch, args.dtype))  # fmt: skip
    check_data(p, args)
    if args.compile is None:
        args.compile = args.device.startswith("cuda")
    if args.out_dir is None:
        data = Path(args.data).stem if args.data is not None else "pydoc"
        args.out_dir = str(Path("out") / f"{data}-{args.n_layer}x{args.n_embd}")
    earlier = [path for path in output_paths(args) if path.exists()]
    if earlier and not args.overwrite:
        verb = "exists" if len(earlier) == 1 else "exist"
        p.error(f"{', '.join(map(str, earlier))} {verb} from an earlier run: pass --overwrite to replace, or "
                f"--out-dir for another folder")  # fmt: skip
    check_parallel(p, args)
    return args


def check_data(p: argparse.ArgumentParser, args) -> None:
    """Usage errors of ``--data``: a file that is missing, or too short to give windows of ``--block-size``."""
    if args.data is None:
        return
    path = Path(args.data)
    if not path.is_file():
        p.error(f"--data {args.data}: no such file")
    size = path.stat().st_size
    if int(size * VAL_FRACTION) < args.block_size + 2:
        p.error(f"--data {args.data}: {size:,} bytes is too short for --block-size {args.block_size}: the last "
                f"{VAL_FRACTION:.0%}, held out for validation, must be longer than a block")  # fmt: skip


def output_paths(args) -> list[Path]:
    """The files a run writes: one checkpoint per configuration and the table."""
    out = Path(args.out_dir)
    names = [run_name(depth_kv, norm) for norm in args.norm for depth_kv in args.depth_kv]
    return [out / f"{name}.pt" for name in names] + [out / "results.md"]


def check_parallel(p: argparse.ArgumentParser, args) -> None:
    """Usage errors of ``--parallel``, raised on every rank before any collective (so nothing hangs).

    Under torchrun, ``--device cuda`` becomes the rank's own GPU.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if args.parallel == "none":
        if launched > 1:
            p.error(f"{launched} processes were launched, but --parallel is none: pass --parallel ddp or fsdp")
        return
    if not dist.is_initialized() and "RANK" not in os.environ:
        p.error(f"--parallel {args.parallel} runs under torchrun: "
                f"torchrun --nproc-per-node N examples/train_gpt.py --parallel {args.parallel}")  # fmt: skip
    world = dist.get_world_size() if dist.is_initialized() else launched
    if args.batch_size % world:
        p.error(f"--batch-size {args.batch_size} (the global batch) must be divisible by the {world} processes")
    if args.device == "cuda":
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        cli.check_device(p, args.device)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    ranks = join(args.parallel, args.device)
    device = torch.device(args.device)
    if device.type == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(ranks.world)))
        torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // local))
    train, val = split(load_text(args.data))
    data = Batches(train, val, args.batch_size, args.block_size, device, ranks)
    n = torch.get_num_threads()
    threads = f", {n} thread{'s' if n > 1 else ''}" if device.type == "cpu" else ""
    ranks.say(f"data: {args.data or PYDOC}, one token per byte: {len(train):,} train and {len(val):,} validation "
              f"bytes; losses in nats per byte")  # fmt: skip
    ranks.say(f"device: {device_name(device)}{threads}, torch {torch.__version__}; writing to {args.out_dir}")
    configs = [(norm, depth_kv) for norm in args.norm for depth_kv in args.depth_kv]
    rows = []
    runs = [(seed, norm, depth_kv) for seed in args.seeds for norm, depth_kv in configs]
    for i, (seed, norm, depth_kv) in enumerate(runs):
        model = run_name(depth_kv, norm)
        name = model if len(args.seeds) == 1 else f"{model}-seed{seed}"
        row = train_one(model_config(args, depth_kv, norm), name, seed, data, args, later_runs=len(runs) - i - 1)
        rows.append({**row, "model": model})
    table = format_table(rows)
    note = timing_note(rows)
    if note is not None:
        table += "\n\n" + note
    ranks.say()
    ranks.say(table)
    if len(args.seeds) > 1:
        table += "\n\n" + seed_table(rows)
        ranks.say()
        ranks.say(seed_table(rows))
    else:
        ranks.say()
        ranks.say(noise_note(args))
    if ranks.main:
        out = Path(args.out_dir)
        (out / "results.md").write_text(table + "\n")
        record = {"command": "python examples/train_gpt.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "config": loss_config(args), "seeds": args.seeds, "threads": args.threads,
                  "device": device_name(device), "torch": torch.__version__,
                  "rows": [{k: None if v != v else v for k, v in r.items()} for r in rows]}  # NaN is not JSON; fmt: skip
        (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
        plot_curves(rows, out / "curves.png")
    return rows


if __name__ == "__main__":
    main()
