"""A fair comparison of MoDA with its baseline at the paper's Table 6 shape: tuned learning rates, seeds, curves.

    python examples/compare_models.py --arms '*-post-L24' --max-minutes 8   # repeat until "nothing left to run"
    python examples/compare_models.py --report       # results/study.md and the plots, from results/study.json

Arms. A name says the model: ``baseline`` (sequence KV only), ``moda-attn``
(+ depth KV from the attention layers), ``moda`` (+ depth KV + FFN KV), then
the norm and the number of layers: ``moda-post-L24``. Every model has width
384 and 6 query / 2 KV heads (the paper's Table 6). The default arms are the
six 24-layer ones; ``--arms '*-L48'`` adds the three 48-layer post-norm ones,
and any name of that form (``moda-pre-L12``) is an arm.

Phases (``--phase all``, the default, runs both, arm by arm). ``sweep``:
each arm at log-spaced learning rates (``--lrs``, a factor of 2 apart),
``--sweep-steps`` steps, seed 0; where the best rate is at the edge of those
tried, the next rate beyond it is added (``--extend`` times at most per
side). ``final``: each arm at its own best sweep rate for ``--final-steps``
steps, once per seed of ``--seeds`` (not seed 0, so that the final losses do
not inherit the luck that made a rate win the sweep). Every run warms up
linearly over a tenth of its steps and then decays on a cosine to a tenth of
its rate (train_gpt's schedule), uses AdamW (0.9, 0.95), weight decay 0.1,
gradient clipping 1.0 and bf16 autocast on CUDA, and is evaluated every
``--eval-interval`` steps on the same validation batches. The runs of one
seed see the same batches in the same order in every arm, so the report
compares arms paired by seed.

Budget. By default a sweep run is 300 steps of 32 x 512 tokens (4.9M
tokens) and a final run 900 (14.7M). On an H100, where a compiled 24-layer
step takes about 36 ms (baseline), 61 ms (moda-attn) and 85 ms (moda) and a
compilation about a minute and a half, one 24-layer arm's four sweep runs and
three final runs take about 4, 6 and 8 minutes; 48 layers take about twice
that.

Resuming. Every finished run is appended to ``--results`` (default
``results/study.json``) at once; a run already recorded there is skipped, so
the same command can be repeated until it reports nothing left to run. The
file holds one experiment: its ``setup`` (shape, batch, steps, corpus hash,
...) must match the command's, or the command stops. ``--max-minutes`` stops
cleanly before a run that would end past that time, estimated from the step
and compile times already recorded for the arm on this device. One arm's
runs reuse one compiled model, re-initialized for every run from a freshly
built model of the run's seed, so an arm compiles once per invocation.

Data: the largest text a Python installation holds without a network: the
pydoc topics and the standard library's sources, shuffled by document (fixed
seed) so that the validation tail looks like the rest (``--data FILE`` for
another text).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import json
import math
import os
import random
import re
import statistics
import sysconfig
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import cli
from gpt import GPT, GPTConfig
from seed_stats import format_mean_std, mean_std, paired_difference
from training import Batches, Schedule, Training, device_name, load_text, split

RESULTS = Path(__file__).resolve().parents[1] / "results" / "study.json"
DEFAULT_ARMS = [
    f"{model}-{norm}-L{n_layer}"
    for n_layer, norm in ((24, "post"), (24, "pre"), (48, "post"))
    for model in ("baseline", "moda-attn", "moda")
]
ARM = re.compile(r"(baseline|moda-attn|moda)-(pre|post)-L(\d+)")
DEPTH_KV = {"baseline": "none", "moda-attn": "attn", "moda": "attn+ffn"}
# The paper's Table 6 (FineWeb-Edu validation loss, width 384, 6/2 heads), by (layers, norm, depth_kv).
PAPER = {
    (48, "pre", "none"): 3.3800, (48, "post", "none"): 3.4062, (48, "pre", "attn"): 3.3759,
    (48, "post", "attn"): 3.3653, (48, "pre", "attn+ffn"): 3.3656, (48, "post", "attn+ffn"): 3.3484,
    (24, "post", "none"): 3.4740, (24, "post", "attn"): 3.4537, (24, "post", "attn+ffn"): 3.4338,
}  # fmt: skip
# Before an arm has a recorded step time on a device: a compiled step on an H100 at 24 layers, 32 x 512 tokens.
GUESS_STEP_S = {"none": 0.036, "attn": 0.060, "attn+ffn": 0.085}
GUESS_COMPILE_S = 90.0  # at 24 layers


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    n_layer: int
    norm: str
    depth_kv: str


def parse_arms(spec: str) -> list[Arm]:
    """Comma-separated arm names, or patterns (``*-L24``) matched against the default arms."""
    names = []
    for item in spec.split(","):
        matched = fnmatch.filter(DEFAULT_ARMS, item) if any(c in item for c in "*?[") else [item]
        if not matched:
            raise SystemExit(f"--arms: {item!r} matches none of {DEFAULT_ARMS}")
        names += [name for name in matched if name not in names]
    arms = []
    for name in names:
        m = ARM.fullmatch(name)
        if m is None:
            raise SystemExit(f"--arms: {name!r} is not <baseline|moda-attn|moda>-<pre|post>-L<layers>")
        arms.append(Arm(name, int(m[3]), m[2], DEPTH_KV[m[1]]))
    return arms


def build_corpus(max_bytes: int) -> bytes:
    """pydoc topics + the standard library's sources, shuffled by document, at most ``max_bytes``.

    Both come with the Python build, not with what else is installed, so two
    machines with the same Python build the same corpus (the results file
    checks its hash).
    """
    docs = [load_text(None)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" not in path.relative_to(stdlib).parts:
            docs.append(path.read_bytes())
    random.Random(0).shuffle(docs)
    return b"\n\n".join(docs)[:max_bytes]


# ---- the results file -------------------------------------------------------------------------------


def load_results(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"setup": None, "runs": []}


def save_results(path: Path, results: dict) -> None:
    """Write through a temporary file, so that a run killed mid-write leaves the previous file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, path)


def lr_key(lr: float) -> float:
    """Learning rates as recorded: three significant digits, so that 1e-3 * 2 / 2 is 1e-3 again."""
    return float(f"{lr:.3g}")


def find_run(results: dict, phase: str, arm: str, lr: float, seed: int) -> dict | None:
    for run in results["runs"]:
        if (run["phase"], run["arm"], run["lr"], run["seed"]) == (phase, arm, lr_key(lr), seed):
            return run
    return None


def sweep_losses(results: dict, arm: str) -> dict[float, float]:
    """{lr: final val loss} of an arm's sweep; a diverged run counts as infinitely bad."""
    return {
        r["lr"]: math.inf if r["val_loss"] is None else r["val_loss"]
        for r in results["runs"]
        if r["phase"] == "sweep" and r["arm"] == arm
    }


def best_lr(results: dict, arm: str) -> float | None:
    losses = sweep_losses(results, arm)
    finite = {lr: loss for lr, loss in losses.items() if math.isfinite(loss)}
    return min(finite, key=finite.get) if finite else None


def next_sweep_lr(results: dict, arm: str, grid: list[float], extend: int) -> float | None:
    """The next rate the sweep of ``arm`` needs, or None when it is complete.

    First the grid; then, while the best rate is the lowest (highest) tried,
    the rate one grid factor below (above) it, at most ``extend`` beyond the grid.
    """
    losses = sweep_losses(results, arm)
    for lr in grid:
        if lr_key(lr) not in losses:
            return lr
    factor = grid[1] / grid[0] if len(grid) > 1 else 2.0
    tried = sorted(losses)
    best = best_lr(results, arm)
    if (best is None or best == tried[0]) and sum(lr < min(grid) for lr in tried) < extend:
        return lr_key(tried[0] / factor)
    if best == tried[-1] and sum(lr > max(grid) for lr in tried) < extend:
        return lr_key(tried[-1] * factor)
    return None


# ---- training -----------------------------------------------------------------------------------


class Trainer:
    """Runs of one arm on one compiled model: each run re-initializes it from a fresh model of its seed."""

    def __init__(self, arm: Arm, args, device: torch.device):
        self.arm, self.args, self.device = arm, args, device
        self.config = GPTConfig(n_embd=args.n_embd, n_head=args.n_head, n_kv_head=args.n_kv_head,
                                depth_kv=arm.depth_kv, norm=arm.norm, backend=args.backend,
                                block_size=args.block_size, n_layer=arm.n_layer)  # fmt: skip
        self.model = GPT(self.config).to(device)
        self.run = torch.compile(self.model, fullgraph=True) if args.compile else self.model
        self.fresh = True  # the next run's first step compiles

    def train(self, phase: str, lr: float, seed: int, steps: int, data: Batches) -> dict:
        args, device, model = self.args, self.device, self.model
        torch.manual_seed(seed)
        model.load_state_dict(GPT(self.config).state_dict())  # in place: the compiled graphs stay valid
        schedule = Schedule(lr, warmup=max(1, steps // 10), steps=steps)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
        training = Training(self.run, model, data, schedule, seed=seed, weight_decay=args.weight_decay,
                            eval_interval=args.eval_interval, eval_iters=args.eval_iters, skip_timing=args.skip_timing,
                            autocast=autocast, stop_if_diverged=True)  # fmt: skip
        started = time.perf_counter()
        for step in training:
            if step.val_loss is not None:
                print(f"\r  {self.arm.name} lr {lr:.3g} seed {seed}: step {step.done}/{steps} | "
                      f"val {step.val_loss:.4f}", end="", flush=True)  # fmt: skip
        print()
        wall_s = time.perf_counter() - started
        laps, eval_times, curve = training.clock.laps, training.eval_times, training.curve
        step_s = statistics.fmean(laps[args.skip_timing :] or laps)  # the first steps compile and autotune
        eval_s = statistics.median(eval_times[1:] or eval_times) if eval_times else 0.0
        record = {
            "phase": phase, "arm": self.arm.name, "n_layer": self.arm.n_layer, "norm": self.arm.norm,
            "depth_kv": self.arm.depth_kv, "config": dataclasses.asdict(self.config), "lr": lr_key(lr), "seed": seed,
            "steps": steps,
            "tokens": data.tokens_per_step * steps, "warmup": schedule.warmup,
            "val_loss": None if training.diverged else curve[-1]["val_loss"], "diverged": training.diverged,
            "curve": curve,
            "step_ms": 1000 * step_s, "eval_s": eval_s, "wall_s": wall_s,
            # what the steps and evaluations do not explain: compilation, in the first run of a compiled model
            "overhead_s": wall_s - step_s * len(laps) - eval_s * len(eval_times), "compiled_here": self.fresh,
            "peak_mb": training.peak_mb, "params_m": model.num_params() / 1e6, "device": device_name(device),
            "torch": torch.__version__, "backend": args.backend, "compiled": args.compile,
            "dtype": "bfloat16" if device.type == "cuda" else "float32",
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        }  # fmt: skip
        self.fresh = False
        return record


def estimate_s(results: dict, arm: Arm, steps: int, device: str, compiled_here: bool, args) -> float:
    """Seconds a run will take: from this arm's recorded step and compile times on this device, else a guess."""
    runs = [r for r in results["runs"] if r["arm"] == arm.name and r["device"] == device]
    scale = arm.n_layer / 24
    evals = steps // args.eval_interval + (steps % args.eval_interval > 0)
    if runs:
        seconds = statistics.median(r["step_ms"] for r in runs) / 1000 * steps
        seconds += statistics.median(r["eval_s"] for r in runs) * evals
    else:
        step_s = GUESS_STEP_S[arm.depth_kv] * scale * args.batch_size * args.block_size / (32 * 512)
        seconds = step_s * (steps + evals * args.eval_iters / 3)  # an eval batch is about a third of a step
    if not compiled_here and args.compile:
        overheads = [r["overhead_s"] for r in runs if r["compiled_here"]]
        seconds += max(overheads) if overheads else GUESS_COMPILE_S * scale
    return seconds


def next_run(arm: Arm, phases: tuple[str, ...], results: dict, args) -> tuple[str, float, int] | None:
    """The next run ``arm`` needs in ``phases``, as (phase, lr, seed), or None when there is none."""
    sweep_lr = next_sweep_lr(results, arm.name, args.lrs, args.extend)
    if "sweep" in phases and sweep_lr is not None:
        return "sweep", sweep_lr, args.sweep_seed
    if "final" not in phases:
        return None
    if sweep_lr is not None:
        print(f"{arm.name}: its sweep is not complete; run --phase sweep first")
        return None
    lr = best_lr(results, arm.name)
    if lr is None:
        print(f"{arm.name}: every sweep run diverged; extend --lrs downwards")
        return None
    for seed in args.seeds:
        if find_run(results, "final", arm.name, lr, seed) is None:
            return "final", lr, seed
    return None


def run_arm(arm: Arm, phases: tuple[str, ...], results: dict, data: Batches, args, started: float) -> bool:
    """Every run ``arm`` still needs in ``phases``, on one compiled model; False when stopped by --max-minutes."""
    device = data.device
    trainer = None
    while (todo := next_run(arm, phases, results, args)) is not None:
        phase, lr, seed = todo
        steps = args.sweep_steps if phase == "sweep" else args.final_steps
        if args.max_minutes is not None:
            elapsed = time.perf_counter() - started
            need = estimate_s(results, arm, steps, device_name(device), trainer is not None, args)
            if elapsed + need > 60 * args.max_minutes:
                print(f"stopping: {phase} {arm.name} lr {lr:.3g} seed {seed} needs about {need / 60:.1f} min and "
                      f"{elapsed / 60:.1f} of --max-minutes {args.max_minutes:g} are used; run the same command "
                      "again to go on")  # fmt: skip
                return False
        if trainer is None:
            torch.compiler.reset()  # the previous arm's graphs would count towards this one's recompile limit
            trainer = Trainer(arm, args, device)
        record = trainer.train(phase, lr, seed, steps, data)
        results["runs"].append(record)
        save_results(args.results, results)
        loss = "diverged" if record["diverged"] else f"{record['val_loss']:.4f}"
        print(f"  recorded {phase} {arm.name} lr {lr:.3g} seed {seed}: val {loss}, "
              f"{record['step_ms']:.1f} ms/step, {record['wall_s']:.0f} s")  # fmt: skip
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return True


# ---- the report ---------------------------------------------------------------------------------


def arm_of(record: dict) -> Arm:
    return Arm(record["arm"], record["n_layer"], record["norm"], record["depth_kv"])


def baseline_name(arm: Arm) -> str:
    return f"baseline-{arm.norm}-L{arm.n_layer}"


def final_runs(results: dict) -> dict[str, list[dict]]:
    """Each arm's final runs at its current best sweep rate, in the order of the default arms."""
    by_arm: dict[str, list[dict]] = {}
    for r in results["runs"]:
        if r["phase"] == "final" and r["lr"] == best_lr(results, r["arm"]):
            by_arm.setdefault(r["arm"], []).append(r)
    order = {name: i for i, name in enumerate(DEFAULT_ARMS)}
    return dict(sorted(by_arm.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))


def report_table(results: dict) -> str:
    """The Markdown table of the final runs: mean ± std over seeds, and each MoDA arm against its baseline."""
    lines = [
        "| arm | layers | norm | depth KV | params (M) | lr | seeds | tokens | val loss | minus baseline "
        "(paired by seed) | reading | paper: val loss (minus baseline) | step (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    finals = final_runs(results)
    for name, runs in finals.items():
        arm = arm_of(runs[0])
        losses = {r["seed"]: r["val_loss"] for r in runs if not r["diverged"]}
        loss_cell = format_mean_std(*mean_std(list(losses.values())))
        if len(losses) < len(runs):
            loss_cell += f" ({len(runs) - len(losses)} of {len(runs)} diverged)"
        diff, reading = "-", "-"
        base_runs = finals.get(baseline_name(arm))
        if base_runs is not None and name != baseline_name(arm):
            base = {r["seed"]: r["val_loss"] for r in base_runs if not r["diverged"]}
            d = paired_difference(losses, base)
            diff = f"{format_mean_std(d.mean, d.std, signed=True)} (95%: ± {d.half_width:.4f})"
            reading = d.verdict()
        paper = PAPER.get((arm.n_layer, arm.norm, arm.depth_kv))
        paper_base = PAPER.get((arm.n_layer, arm.norm, "none"))
        paper_cell = "-"
        if paper is not None:
            paper_cell = f"{paper:.4f}" + (f" ({paper - paper_base:+.4f})" if arm.depth_kv != "none" else "")
        depth = {"none": "-", "attn": "attn", "attn+ffn": "attn+ffn"}[arm.depth_kv]
        step_ms = statistics.fmean(r["step_ms"] for r in runs)
        tried = sorted(sweep_losses(results, name))
        lr_cell = f"{runs[0]['lr']:.3g}" + (" (edge of the sweep)" if runs[0]["lr"] in (tried[0], tried[-1]) else "")
        lines.append(
            f"| {name} | {arm.n_layer} | {arm.norm} | {depth} | {runs[0]['params_m']:.2f} | {lr_cell} | "
            f"{len(runs)} | {runs[0]['tokens'] / 1e6:.1f}M | {loss_cell} | {diff} | {reading} | {paper_cell} | "
            f"{step_ms:.1f} |"
        )
    return "\n".join(lines)


def sweep_table(results: dict) -> str:
    """Final val loss of every sweep run, arm by learning rate; in bold the rate of the arm's final runs,
    in italics the best so far of an arm with none yet."""
    arms = list(dict.fromkeys(r["arm"] for r in results["runs"] if r["phase"] == "sweep"))
    order = {name: i for i, name in enumerate(DEFAULT_ARMS)}
    arms.sort(key=lambda name: (order.get(name, len(order)), name))
    lrs = sorted({r["lr"] for r in results["runs"] if r["phase"] == "sweep"})
    lines = ["| arm | " + " | ".join(f"lr {lr:.3g}" for lr in lrs) + " |", "|---|" + "---|" * len(lrs)]
    finals = final_runs(results)
    for arm in arms:
        losses = sweep_losses(results, arm)
        best = best_lr(results, arm)
        mark = "**" if arm in finals else "_"
        cells = []
        for lr in lrs:
            if lr not in losses:
                cells.append("")
            elif not math.isfinite(losses[lr]):
                cells.append("diverged")
            else:
                cells.append(f"{mark}{losses[lr]:.4f}{mark}" if lr == best else f"{losses[lr]:.4f}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(results: dict, out_dir: Path) -> str:
    """The study as Markdown (also written to ``<out_dir>/study.md``), with its plots beside it."""
    runs = results["runs"]
    setup = results["setup"] or {}
    devices = sorted({r["device"] for r in runs})
    versions = sorted({r["torch"] for r in runs})
    finals = final_runs(results)
    seeds = sorted({r["seed"] for rs in finals.values() for r in rs})
    sweep_steps = sorted({r["steps"] for r in runs if r["phase"] == "sweep"})
    header = (
        f"device: {', '.join(devices) or '-'}; torch {', '.join(versions) or '-'}; "
        f"width {setup.get('n_embd')}, {setup.get('n_head')} query / {setup.get('n_kv_head')} KV heads; "
        f"{setup.get('batch_size')} x {setup.get('block_size')} tokens per step; "
        f"corpus {setup.get('corpus_bytes', 0) / 1e6:.1f} MB (sha256 {setup.get('corpus_sha256', '-')}); "
        f"sweep: {', '.join(map(str, sweep_steps)) or '-'} steps, seed {setup.get('sweep_seed')}; "
        f"final: seeds {', '.join(map(str, seeds)) or '-'}"
    )
    text = "\n\n".join([
        header,
        "Final runs, each arm at its own best learning rate from the sweep:",
        report_table(results),
        "Learning-rate sweep (final val loss, one seed; bold: the rate of the final runs; "
        "italics: the best so far of an arm whose final runs have not run yet):",
        sweep_table(results),
    ])  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "study.md").write_text(text + "\n")
    plot_study(results, out_dir)
    return text


def plot_study(results: dict, out_dir: Path) -> None:
    """``study_curves.png``: val loss against tokens, mean ± std over seeds per arm; ``study_lr.png``: the sweep."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("(no matplotlib: no plots; pip install matplotlib)")
        return
    finals = final_runs(results)
    sweeps = [r for r in results["runs"] if r["phase"] == "sweep"]
    groups = list(dict.fromkeys(f"{arm_of(r).norm}-L{arm_of(r).n_layer}" for r in results["runs"]))
    colours = {"none": "C0", "attn": "C1", "attn+ffn": "C2"}
    if not groups:
        return

    fig = Figure(figsize=(5 * len(groups), 4), layout="constrained")
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, group in zip(axes, groups):
        for name, runs in finals.items():
            arm = arm_of(runs[0])
            if f"{arm.norm}-L{arm.n_layer}" != group or any(r["diverged"] for r in runs):
                continue
            tokens = [p["tokens"] for p in runs[0]["curve"]]
            curves = torch.tensor([[p["val_loss"] for p in r["curve"]] for r in runs])  # (seeds, points)
            mean = curves.mean(0)
            std = curves.std(0) if len(runs) > 1 else torch.zeros_like(mean)
            label = f"{name} (lr {runs[0]['lr']:.3g}, {len(runs)} seeds)"
            ax.plot(tokens, mean, color=colours[arm.depth_kv], label=label)
            ax.fill_between(tokens, mean - std, mean + std, color=colours[arm.depth_kv], alpha=0.25)
        ax.set_title(group)
        ax.set_xlabel("tokens")
        ax.set_ylabel("validation loss (mean ± std over seeds)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.savefig(out_dir / "study_curves.png", dpi=120)

    fig = Figure(figsize=(5 * len(groups), 4), layout="constrained")
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, group in zip(axes, groups):
        for name in dict.fromkeys(r["arm"] for r in sweeps):
            arm = arm_of(next(r for r in sweeps if r["arm"] == name))
            if f"{arm.norm}-L{arm.n_layer}" != group:
                continue
            losses = sorted(sweep_losses(results, name).items())
            finite = [(lr, loss) for lr, loss in losses if math.isfinite(loss)]
            colour = colours[arm.depth_kv]
            ax.plot([lr for lr, _ in finite], [loss for _, loss in finite], "o-", color=colour, label=name)
            best = best_lr(results, name)
            if best is not None:
                ax.plot([best], [dict(finite)[best]], "*", color=colour, markersize=14)
            for lr, loss in losses:
                if not math.isfinite(loss):
                    ax.axvline(lr, color=colour, linestyle=":", linewidth=1)  # diverged at this rate
        ax.set_xscale("log")
        tried = sorted({r["lr"] for r in sweeps if f"{arm_of(r).norm}-L{arm_of(r).n_layer}" == group})
        ax.set_xticks(tried, [f"{lr:.3g}" for lr in tried], minor=False)
        ax.set_xticks([], minor=True)
        ax.set_title(f"{group}: sweep (star: chosen; dotted: diverged)")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("final validation loss")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.savefig(out_dir / "study_lr.png", dpi=120)
    print(f"plots: {out_dir / 'study_curves.png'}, {out_dir / 'study_lr.png'}")


# ---- the command --------------------------------------------------------------------------------


def setup_of(args, corpus: bytes) -> dict:
    """What every run of one results file shares."""
    keys = ("n_embd", "n_head", "n_kv_head", "batch_size", "block_size", "sweep_steps", "final_steps",
            "sweep_seed", "eval_interval", "eval_iters", "weight_decay")  # fmt: skip
    return {**{k: getattr(args, k) for k in keys}, "corpus_bytes": len(corpus),
            "corpus_sha256": hashlib.sha256(corpus).hexdigest()[:16]}  # fmt: skip


def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--phase", choices=("sweep", "final", "all"), default="all",
                   help="sweep: learning rates; final: seeds at each arm's best rate; all: both, in that order")
    p.add_argument("--report", action="store_true", help="print the tables and write the plots from --results")
    p.add_argument("--arms", default="*-L24", help=f"comma-separated names or patterns; default arms {DEFAULT_ARMS}")
    p.add_argument("--lrs", default="2.5e-4,5e-4,1e-3,2e-3", help="the sweep's grid, log-spaced")
    p.add_argument("--extend", type=cli.at_least(0), default=2,
                   help="rates tried beyond each edge of the grid, at most")
    p.add_argument("--seeds", type=cli.int_list, default="1,2,3", help="seeds of the final runs")
    p.add_argument("--sweep-seed", type=int, default=0, help="seed of the sweep's runs")
    p.add_argument("--sweep-steps", type=cli.at_least(1), default=300, help="steps of a sweep run")
    p.add_argument("--final-steps", type=cli.at_least(1), default=900, help="steps of a final run")
    p.add_argument("--eval-interval", type=cli.at_least(1), default=100,
                   help="steps between points of the validation curve")
    p.add_argument("--eval-iters", type=cli.at_least(1), default=32, help="validation batches per point of the curve")
    p.add_argument("--batch-size", type=cli.at_least(1), default=32, help="sequences per step")
    p.add_argument("--block-size", type=cli.at_least(1), default=512, help="context length in bytes")
    p.add_argument("--n-embd", type=cli.at_least(1), default=384, help="model width")
    p.add_argument("--n-head", type=cli.at_least(1), default=6, help="query heads")
    p.add_argument("--n-kv-head", type=cli.at_least(1), default=2, help="key/value heads")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the matrices")
    p.add_argument("--skip-timing", type=cli.at_least(0), default=10,
                   help="first steps of a run left out of its step time")
    p.add_argument("--max-minutes", type=float, default=None, help="stop before a run that would end past this")
    p.add_argument("--results", type=Path, default=RESULTS, help="the study's JSON file (read, extended)")
    p.add_argument("--report-dir", type=Path, default=None, help="study.md and the plots (default: beside --results)")
    p.add_argument("--data", default=None, help="a text file instead of the offline corpus")
    p.add_argument("--max-bytes", type=cli.at_least(1), default=200_000_000, help="the most corpus bytes to use")
    cli.add_device(p)
    cli.add_backend(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile(model, fullgraph=True) (default: on CUDA)")
    p.add_argument("--threads", type=cli.at_least(1), default=len(os.sched_getaffinity(0)),
                   help="CPU threads for torch")
    args = p.parse_args(argv)
    device = cli.check_device(p, args.device)
    try:
        args.lrs = sorted(lr_key(cli.positive_float(lr)) for lr in args.lrs.split(","))
    except argparse.ArgumentTypeError as error:
        p.error(f"--lrs {args.lrs}: {error}")
    if args.data is not None and not Path(args.data).is_file():
        p.error(f"--data {args.data}: no such file")
    try:
        config = GPTConfig(n_embd=args.n_embd, n_head=args.n_head, n_kv_head=args.n_kv_head)
    except ValueError as error:
        p.error(str(error))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what the runs' autocast gives attention
    cli.check_backend(p, args.backend, device, n_head=config.n_head, n_kv_head=config.n_kv_head,
                      head_dim=config.n_embd // config.n_head, slots=1, dtype=dtype)  # fmt: skip
    if args.compile is None:
        args.compile = args.device.startswith("cuda")
    if args.report_dir is None:
        args.report_dir = args.results.parent
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = load_results(args.results)
    if args.report:
        if not results["runs"]:
            raise SystemExit(f"{args.results}: no runs recorded yet")
        print(report(results, args.report_dir))
        return results
    arms = parse_arms(args.arms)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    corpus = Path(args.data).read_bytes() if args.data else build_corpus(args.max_bytes)
    setup = setup_of(args, corpus)
    if results["setup"] is None:
        results["setup"] = setup
    elif results["setup"] != setup:
        differ = {k: (results["setup"].get(k), v) for k, v in setup.items() if results["setup"].get(k) != v}
        raise SystemExit(f"{args.results} holds another experiment (recorded, asked): {differ}; "
                         "pass the same settings, or another --results file")  # fmt: skip
    data = Batches(*split(corpus), args.batch_size, args.block_size, device)
    print(f"corpus: {len(corpus) / 1e6:.1f} MB; device: {device_name(device)}; "
          f"arms: {', '.join(a.name for a in arms)}")  # fmt: skip
    phases = ("sweep", "final") if args.phase == "all" else (args.phase,)
    for arm in arms:  # arm by arm, so that one compiled model serves all of an arm's runs
        if not run_arm(arm, phases, results, data, args, started):
            return results
    print(f"nothing left to run for --phase {args.phase} --arms {args.arms}")
    return results


if __name__ == "__main__":
    main()
