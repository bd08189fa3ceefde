"""A fair comparison of MoDA with its baseline at the paper's Table 6 shape: tuned learning rates, seeds, curves.

    python examples/compare_models.py --arms '*-post-L24' --max-minutes 8   # repeat until "nothing left to run"
    python examples/compare_models.py --report       # results/study.md and the plots, from results/study.json

Arms. A name says the model: ``baseline`` (sequence KV only), ``moda-attn``
(+ depth KV from the attention layers), ``moda`` (+ depth KV + FFN KV), then
the norm and the number of layers: ``moda-post-L24``. Every model has width
384 and 6 query / 2 KV heads (the paper's Table 6). The default arms are the
six 24-layer ones; ``--arms '*-L48'`` runs the six 48-layer ones (the paper's
Table 6 rows), and any name of that form (``moda-pre-L12``) is an arm.

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
and compile times already recorded for the arm on this device (with
inductor's cache kept between invocations, ``TORCHINDUCTOR_CACHE_DIR``, a
compile is much shorter than the recorded ones: say how long with
``--compile-minutes``). One arm's
runs reuse one compiled model, re-initialized for every run from a freshly
built model of the run's seed, so an arm compiles once per invocation.
``--compile-mode reduce-overhead`` replays each step from CUDA graphs (on an
H100 the Table 6 steps took 0.52-0.64x of the default mode's time; runs in
either mode are one experiment, and each records its mode).

Data: the largest text a Python installation holds without a network: the
pydoc topics and the standard library's sources, shuffled by document (fixed
seed) so that the validation tail looks like the rest (``--data FILE`` for
another text).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import random
import statistics
import sysconfig
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import cli
from gpt import GPT, GPTConfig
from study import (DEFAULT_ARMS, Arm, best_lr, find_run, load_results, lr_key, next_sweep_lr, parse_arms, report,
                   save_results)  # fmt: skip
from training import Batches, Schedule, Training, device_name, load_text, split

RESULTS = Path(__file__).resolve().parents[1] / "results" / "study.json"
# Before an arm has a recorded step time on a device: a compiled step on an H100 at 24 layers, 32 x 512 tokens.
GUESS_STEP_S = {"none": 0.036, "attn": 0.060, "attn+ffn": 0.085}
GUESS_COMPILE_S = {"none": 110.0, "attn": 170.0, "attn+ffn": 200.0}  # at 24 layers, from an H100's runs


CORPORA = ("stdlib", "installed")


def build_corpus(max_bytes: int, corpus: str = "stdlib") -> bytes:
    """pydoc topics + Python sources, shuffled by document, at most ``max_bytes``.

    ``"stdlib"``: the standard library's sources. They come with the Python
    build, not with what else is installed, so two machines with the same
    Python build the same corpus (the results file checks its hash).
    ``"installed"``: those and the installed packages' sources too (torch's
    among them: several times the bytes), for runs that would otherwise see
    the stdlib corpus many times; the same only where the same packages are
    installed.
    """
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}, got {corpus!r}")
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    sources = [path for path in sorted(stdlib.rglob("*.py")) if "site-packages" not in path.relative_to(stdlib).parts]
    if corpus == "installed":
        for root in sorted({paths["purelib"], paths["platlib"]}):
            sources += sorted(Path(root).rglob("*.py"))
    docs = [load_text(None)] + [path.read_bytes() for path in sources]
    random.Random(0).shuffle(docs)
    return b"\n\n".join(docs)[:max_bytes]


# ---- training -----------------------------------------------------------------------------------


class Trainer:
    """Runs of one arm on one compiled model: each run re-initializes it from a fresh model of its seed."""

    def __init__(self, arm: Arm, args, device: torch.device):
        self.arm, self.args, self.device = arm, args, device
        self.config = GPTConfig(n_embd=args.n_embd, n_head=args.n_head, n_kv_head=args.n_kv_head,
                                depth_kv=arm.depth_kv, norm=arm.norm, backend=args.backend,
                                block_size=args.block_size, n_layer=arm.n_layer)  # fmt: skip
        self.model = GPT(self.config).to(device)
        mode = None if args.compile_mode == "default" else args.compile_mode
        self.run = torch.compile(self.model, fullgraph=True, mode=mode) if args.compile else self.model
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
            "compile_mode": args.compile_mode,
            "dtype": "bfloat16" if device.type == "cuda" else "float32",
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        }  # fmt: skip
        self.fresh = False
        return record


def estimate_s(results: dict, arm: Arm, steps: int, device: str, compiled_here: bool, args) -> float:
    """Seconds a run will take: from this arm's recorded step and compile times on this device in this compile
    mode, else a guess."""
    runs = [r for r in results["runs"]
            if r["arm"] == arm.name and r["device"] == device and _mode_of(r) == args.compile_mode]  # fmt: skip
    scale = arm.n_layer / 24
    evals = steps // args.eval_interval + (steps % args.eval_interval > 0)
    if runs:
        seconds = statistics.median(r["step_ms"] for r in runs) / 1000 * steps
        seconds += statistics.median(r["eval_s"] for r in runs) * evals
    else:
        step_s = GUESS_STEP_S[arm.depth_kv] * scale * args.batch_size * args.block_size / (32 * 512)
        seconds = step_s * (steps + evals * args.eval_iters / 3)  # an eval batch is about a third of a step
    if not compiled_here and args.compile:
        if args.compile_minutes is not None:  # a warm compile cache makes the recorded ones too long
            seconds += 60 * args.compile_minutes
        else:
            overheads = [r["overhead_s"] for r in runs if r["compiled_here"]]
            seconds += max(overheads) if overheads else GUESS_COMPILE_S[arm.depth_kv] * scale
    return seconds


def _mode_of(run: dict) -> str | None:
    """A recorded run's compile mode (None: not compiled); runs recorded before modes were default-mode ones."""
    return run.get("compile_mode", "default" if run["compiled"] else None)


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
    cli.add_model_shape(p, n_embd=384, n_head=6, n_kv_head=2, block_size=512)  # layers: per arm
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the matrices")
    p.add_argument("--skip-timing", type=cli.at_least(0), default=10,
                   help="first steps of a run left out of its step time")
    p.add_argument("--max-minutes", type=float, default=None, help="stop before a run that would end past this")
    p.add_argument("--compile-minutes", type=float, default=None,
                   help="what --max-minutes takes an arm's compile to cost; default: its slowest recorded one on "
                        "this device (lower it when inductor's cache, TORCHINDUCTOR_CACHE_DIR, holds the arm)")
    p.add_argument("--results", type=Path, default=RESULTS, help="the study's JSON file (read, extended)")
    p.add_argument("--report-dir", type=Path, default=None,
                   help="the report and its plots, named after --results (study.json: study.md, study_curves.png, "
                        "study_lr.png); default: beside --results")  # fmt: skip
    p.add_argument("--data", default=None, help="a text file instead of the offline corpus")
    p.add_argument("--max-bytes", type=cli.at_least(1), default=200_000_000, help="the most corpus bytes to use")
    p.add_argument("--corpus", choices=CORPORA, default="stdlib",
                   help="the offline corpus: the standard library's sources, or the installed packages' too")
    cli.add_device(p)
    cli.add_backend(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile(model, fullgraph=True) (default: on CUDA)")
    p.add_argument("--compile-mode", choices=("default", "reduce-overhead"), default="default",
                   help="torch.compile's mode; reduce-overhead replays each step from CUDA graphs")
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
                      head_dim=config.head_dim, slots=1, dtype=dtype)  # fmt: skip
    if args.compile is None:
        args.compile = args.device.startswith("cuda")
    if args.compile_mode != "default" and not args.compile:
        p.error(f"--compile-mode {args.compile_mode} needs --compile")
    if not args.compile:
        args.compile_mode = None  # as runs record it: no mode without compilation
    if args.report_dir is None:
        args.report_dir = args.results.parent
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = load_results(args.results)
    if args.report:
        if not results["runs"]:
            raise SystemExit(f"{args.results}: no runs recorded yet")
        print(report(results, args.report_dir, args.results.stem))
        return results
    arms = parse_arms(args.arms)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    corpus = Path(args.data).read_bytes() if args.data else build_corpus(args.max_bytes, args.corpus)
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
