"""compare_models.py's study: its arms, its results file (what has run, which learning rate to try next), its report.

The results file holds one experiment: a ``setup`` and a list of ``runs``,
each one training run's record (phase, arm, learning rate, seed, final and
curve of validation losses, timings). Everything here reads or extends that
dictionary; ``compare_models.py`` trains the runs it asks for.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
import statistics
from pathlib import Path

import torch

from seed_stats import format_mean_std, mean_std, paired_difference

DEFAULT_ARMS = [
    f"{model}-{norm}-L{n_layer}"
    for n_layer, norm in ((24, "post"), (24, "pre"), (48, "post"), (48, "pre"))
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
    several_devices = len({r["device"] for r in results["runs"]}) > 1
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
        step_cell = f"{statistics.fmean(r['step_ms'] for r in runs):.1f}"
        if several_devices:  # step times compare only on one device
            step_cell += " (" + ", ".join(sorted({r["device"].removeprefix("NVIDIA ") for r in runs})) + ")"
        tried = sorted(sweep_losses(results, name))
        lr_cell = f"{runs[0]['lr']:.3g}" + (" (edge of the sweep)" if runs[0]["lr"] in (tried[0], tried[-1]) else "")
        lines.append(
            f"| {name} | {arm.n_layer} | {arm.norm} | {depth} | {runs[0]['params_m']:.2f} | {lr_cell} | "
            f"{len(runs)} | {runs[0]['tokens'] / 1e6:.1f}M | {loss_cell} | {diff} | {reading} | {paper_cell} | "
            f"{step_cell} |"
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


def report(results: dict, out_dir: Path, stem: str = "study") -> str:
    """The study as Markdown (also written to ``<out_dir>/<stem>.md``), with its plots beside it
    (:func:`plot_study`)."""
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
    (out_dir / f"{stem}.md").write_text(text + "\n")
    plot_study(results, out_dir, stem)
    return text


def plot_study(results: dict, out_dir: Path, stem: str = "study") -> None:
    """``<stem>_curves.png``: val loss against tokens, mean ± std over seeds per arm; ``<stem>_lr.png``: the
    sweep."""
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
    fig.savefig(out_dir / f"{stem}_curves.png", dpi=120)

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
    fig.savefig(out_dir / f"{stem}_lr.png", dpi=120)
    print(f"plots: {out_dir / f'{stem}_curves.png'}, {out_dir / f'{stem}_lr.png'}")
