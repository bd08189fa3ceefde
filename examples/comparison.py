"""train_gpt.py's comparison of its runs: the table, what the step times are worth, the seeds, the curves.

A row is what ``train_gpt.train_one`` returns: the model's name, norm and
seed, its parameters, validation loss and curve, and the timings it measured.
"""

from __future__ import annotations

import json
from pathlib import Path

from seed_stats import format_mean_std, mean_std, paired_difference
from training import UNDISTURBED_SHARE


def disturbed(row: dict) -> bool:
    return row["cpu_share"] is not None and row["cpu_share"] < UNDISTURBED_SHARE


def format_table(rows: list[dict]) -> str:
    """A Markdown table of the runs; step time and memory relative to the baseline of the same norm and seed.

    The columns are those the runs measured: step times unless no step was
    timed, the CPU share on a CPU, memory on CUDA. A step time that other
    processes disturbed reads "(disturbed)", and so does its ratio.
    """
    timed = all(r["step_ms"] is not None for r in rows)
    on_cpu = all(r["cpu_share"] is not None for r in rows)
    on_cuda = all(r["peak_mb"] is not None for r in rows)
    header = ["model", "params (M)", "val loss (nats/byte)"]
    header += ["tokens/s", "step (ms)", "step vs baseline"] if timed else []
    header += ["CPU share"] if on_cpu else []
    header += ["peak mem (MiB)", "mem vs baseline"] if on_cuda else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    baselines = {(r["norm"], r["seed"]): r for r in rows if r["name"].startswith("baseline")}
    for r in rows:
        first = baselines.get((r["norm"], r["seed"]), rows[0])
        cells = [r["name"], f"{r['params_m']:.2f}", f"{r['val_loss']:.4f}"]
        if timed:
            mark = " (disturbed)" if disturbed(r) else ""
            ratio = "(disturbed)" if disturbed(r) or disturbed(first) else f"{r['step_ms'] / first['step_ms']:.2f}x"
            cells += [f"{r['tok_s']:,.0f}{mark}", f"{r['step_ms']:.1f}{mark}", ratio]
        if on_cpu:
            cells.append(f"{100 * r['cpu_share']:.0f}% of {r['threads']}")
        if on_cuda:
            cells += [f"{r['peak_mb']:.0f}", f"{r['peak_mb'] / first['peak_mb']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def timing_note(rows: list[dict]) -> str | None:
    """What the table's step times are worth: a warning when other processes disturbed them, else nothing."""
    shaken = [r["name"] for r in rows if disturbed(r)]
    if not shaken:
        return None
    return (f"Other processes took CPU time while {', '.join(shaken)} trained (CPU share under "
            f"{100 * UNDISTURBED_SHARE:.0f}%): those step times measure the load on this machine, not the model. "
            "Run again when the machine is idle to compare speed; the losses do not depend on it.")


# The arguments that change what a run computes; results recorded under other values describe another experiment.
LOSS_ARGS = ("data", "depth_kv", "norm", "n_layer", "n_embd", "n_head", "n_kv_head", "block_size", "batch_size",
             "steps", "lr", "warmup", "weight_decay", "eval_iters", "dtype")  # fmt: skip
# Seeds of the default run measured on a 2-core CPU (written by --seeds, see README "Training and comparing").
CPU_MAIN_JOB = Path(__file__).resolve().parents[1] / "results" / "cpu_main_job.json"


def loss_config(args) -> dict:
    return {key: getattr(args, key) for key in LOSS_ARGS}


def seed_table(rows: list[dict]) -> str:
    """Each model's val loss, mean ± std over seeds, and its difference from the baseline of its norm, paired by seed."""
    losses: dict[str, dict[int, float]] = {}
    for r in rows:
        losses.setdefault(r["model"], {})[r["seed"]] = r["val_loss"]
    lines = [
        "| model | seeds | val loss | minus baseline (paired by seed) | 95% interval | reading |",
        "|---|---|---|---|---|---|",
    ]
    for model, by_seed in losses.items():
        baseline = losses.get("baseline-" + model.rsplit("-", 1)[1])
        cells = ["-", "-", "-"]
        if baseline is not None and baseline is not by_seed:
            d = paired_difference(by_seed, baseline)
            cells = [format_mean_std(d.mean, d.std, signed=True), f"± {d.half_width:.4f}", d.verdict()]
        lines.append(f"| {model} | {len(by_seed)} | {format_mean_std(*mean_std(list(by_seed.values())))} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


def noise_note(args) -> str:
    """What one seed's differences mean: the seed spread recorded for this very configuration, or how to measure it."""
    if CPU_MAIN_JOB.exists():
        recorded = json.loads(CPU_MAIN_JOB.read_text())
        if recorded["config"] == loss_config(args):
            seeds = ",".join(map(str, recorded["seeds"]))
            return (f"One seed cannot tell a difference from seed noise. Over seeds {seeds} this configuration gave "
                    f"({recorded['device']}, results/cpu_main_job.json):\n\n{seed_table(recorded['rows'])}\n\n"
                    f"(--seeds {seeds} measures it again.)")  # fmt: skip
    return "One seed shows little: --seeds 1,2,3 trains each model three times and tells a difference from seed noise."


def plot_curves(rows: list[dict], path: Path) -> None:
    """Validation loss (solid) and mean training loss (dotted) against tokens, one colour per model."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("(no matplotlib: no curves.png)")
        return
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    colours = {}
    for r in rows:
        label = None if r["model"] in colours else r["model"]  # one legend entry per model, not per seed
        colour = colours.setdefault(r["model"], f"C{len(colours)}")
        tokens = [p["tokens"] for p in r["curve"]]
        ax.plot(tokens, [p["val_loss"] for p in r["curve"]], "o-", color=colour, label=label, markersize=3)
        ax.plot(tokens, [p["train_loss"] for p in r["curve"]], ":", color=colour, linewidth=1)
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    ax.set_title("solid: validation; dotted: training (mean since the previous point)", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    print(f"curves: {path}")
