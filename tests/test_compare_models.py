"""The comparison study: resuming, the learning-rate sweep's edges, the report; train_gpt's curves and seeds."""

import json
import math

import pytest
import torch

import comparison
import compare_models
import study
import train_gpt

TINY = ["--device", "cpu", "--n-embd", "16", "--n-head", "2", "--n-kv-head", "1", "--batch-size", "2",
        "--block-size", "16", "--sweep-steps", "4", "--final-steps", "5", "--eval-interval", "2", "--eval-iters", "1",
        "--skip-timing", "1", "--threads", "1", "--lrs", "1e-3,2e-3", "--extend", "0",
        "--arms", "baseline-post-L2,moda-attn-post-L2", "--seeds", "1,2"]  # fmt: skip


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return path


def test_the_study_resumes_where_it_stopped(tmp_path, data, capsys):
    flags = ["--data", str(data), "--results", str(tmp_path / "study.json"), *TINY]
    compare_models.main([*flags, "--max-minutes", "0"])  # stops before the first run, cleanly
    assert "stopping" in capsys.readouterr().out
    assert not (tmp_path / "study.json").exists()

    results = compare_models.main([*flags, "--phase", "sweep"])
    sweep = [(r["arm"], r["lr"], r["seed"]) for r in results["runs"]]
    assert sweep == [(arm, lr, 0) for arm in ("baseline-post-L2", "moda-attn-post-L2") for lr in (1e-3, 2e-3)]

    results = compare_models.main([*flags, "--phase", "all"])  # the sweep is recorded: only the final runs
    runs = results["runs"]
    assert len(runs) == 8 and [r["phase"] for r in runs] == ["sweep"] * 4 + ["final"] * 4
    for r in runs[4:]:
        assert r["lr"] == study.best_lr(results, r["arm"]) and r["seed"] in (1, 2)
    capsys.readouterr()
    again = compare_models.main(flags)
    assert again["runs"] == runs and "nothing left to run" in capsys.readouterr().out

    on_disk = json.loads((tmp_path / "study.json").read_text())
    assert on_disk == again
    for r in on_disk["runs"]:
        assert [p["tokens"] for p in r["curve"]] == [32 * s for s in ((2, 4) if r["phase"] == "sweep" else (2, 4, 5))]
        assert r["curve"][-1]["val_loss"] == r["val_loss"] and r["tokens"] == 32 * r["steps"]
        assert {"device", "torch", "step_ms", "params_m", "warmup"} <= r.keys()
    assert on_disk["setup"]["corpus_bytes"] == len(data.read_bytes())

    with pytest.raises(SystemExit, match="another experiment"):
        compare_models.main([*flags, "--final-steps", "6"])

    compare_models.main([*flags, "--report"])
    text = (tmp_path / "study.md").read_text()
    assert "| moda-attn-post-L2 | 2 | post | attn |" in text and "| baseline-post-L2 |" in text


def test_every_step_and_evaluation_begins_a_cuda_graph_step(tmp_path, data, monkeypatch):
    """Under ``--compile-mode reduce-overhead`` a replay may overwrite the last call's outputs: the loop marks a
    new step before every training step and every validation batch (a no-op without CUDA graphs)."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    flags = ["--data", str(data), "--results", str(tmp_path / "study.json"), *TINY]
    results = compare_models.main([*flags, "--phase", "sweep", "--arms", "moda-attn-post-L2", "--lrs", "1e-3"])
    (run,) = results["runs"]
    assert len(marks) == run["steps"] + len(run["curve"])  # one eval batch a point (--eval-iters 1)
    assert run["compile_mode"] is None  # not compiled on CPU


def test_a_compile_is_estimated_from_the_slowest_recorded_one_unless_given(tmp_path, data):
    arm = study.parse_arms("moda-post-L24")[0]
    runs = [dict(_record("sweep", arm.name, 1e-3, 0, 1.5, steps=100), overhead_s=s, compiled_here=True,
                 compile_mode="default") for s in (300.0, 40.0)]  # fmt: skip
    results = {"runs": runs}
    args = compare_models.parse_args(["--data", str(data), *TINY, "--compile", "--eval-interval", "50"])
    device = runs[0]["device"]
    compiled = compare_models.estimate_s(results, arm, 100, device, True, args)
    assert compiled == pytest.approx(0.04 * 100 + 0.1 * 2)  # the median step and evaluation times
    assert compare_models.estimate_s(results, arm, 100, device, False, args) == pytest.approx(compiled + 300)
    args.compile_minutes = 0.5
    assert compare_models.estimate_s(results, arm, 100, device, False, args) == pytest.approx(compiled + 30)


def test_a_compile_mode_needs_compile(tmp_path, data):
    flags = ["--data", str(data), "--results", str(tmp_path / "study.json"), *TINY]
    with pytest.raises(SystemExit):
        compare_models.parse_args([*flags, "--no-compile", "--compile-mode", "reduce-overhead"])


def _record(phase, arm, lr, seed, loss, steps=900):
    a = study.parse_arms(arm)[0]
    curve = None if loss is None else [{"tokens": 1000 * s, "val_loss": loss + 1.0 / s, "train_loss": loss} for s in (1, 2)]
    return {"phase": phase, "arm": arm, "n_layer": a.n_layer, "norm": a.norm, "depth_kv": a.depth_kv, "lr": lr,
            "seed": seed, "steps": steps, "tokens": steps * 16384, "warmup": 10, "val_loss": None if loss is None else curve[-1]["val_loss"],
            "diverged": loss is None, "curve": curve or [], "step_ms": 40.0, "eval_s": 0.1, "wall_s": 5.0,
            "overhead_s": 1.0, "compiled_here": False, "peak_mb": 100.0, "params_m": 37.87,
            "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "backend": "auto", "compiled": True,
            "dtype": "bfloat16", "finished": "2025-01-01 00:00:00"}  # fmt: skip


def test_the_report_from_a_fixture(tmp_path):
    base, moda = "baseline-post-L24", "moda-post-L24"
    runs = [_record("sweep", base, lr, 0, loss) for lr, loss in ((2.5e-4, 1.9), (5e-4, 1.8), (1e-3, None))]
    runs += [_record("sweep", moda, lr, 0, loss) for lr, loss in ((2.5e-4, 1.7), (5e-4, 1.5), (1e-3, 1.6))]
    runs += [_record("final", base, 5e-4, s, loss) for s, loss in ((1, 1.70), (2, 1.72), (3, 1.71))]
    runs += [_record("final", moda, 5e-4, s, loss) for s, loss in ((1, 1.50), (2, 1.51), (3, 1.50))]
    runs += [_record("final", moda, 2.5e-4, 1, 1.9)]  # at a rate no longer the best: not reported
    attn = "moda-attn-post-L24"  # best at the edge of its sweep, and one final run diverged
    runs += [_record("sweep", attn, lr, 0, loss) for lr, loss in ((5e-4, 1.8), (1e-3, 1.6))]
    runs += [_record("final", attn, 1e-3, s, loss) for s, loss in ((1, 1.60), (2, None), (3, 1.62))]
    setup = {"n_embd": 384, "n_head": 6, "n_kv_head": 2, "batch_size": 32, "block_size": 512, "sweep_seed": 0,
             "corpus_bytes": 12_900_000, "corpus_sha256": "0123456789abcdef"}  # fmt: skip
    text = study.report({"setup": setup, "runs": runs}, tmp_path)

    table = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")]
    rows = {cells[0][2:]: cells for cells in table if len(cells) == 13}  # the final runs, not the sweep
    assert rows[base][5:9] == ["0.0005", "3", "14.7M", "2.2100 ± 0.0100"]
    assert rows[moda][8:11] == ["2.0033 ± 0.0058", "-0.2067 ± 0.0058 (95%: ± 0.0143)", "better, beyond seed noise"]
    assert rows[moda][11] == "3.4338 (-0.0402)"  # the paper's Table 6, 24 layers, post-norm
    assert rows[attn][5] == "0.001 (edge of the sweep)" and rows[attn][8] == "2.1100 ± 0.0141 (1 of 3 diverged)"
    assert rows[attn][9].startswith("-0.0950 ± 0.0071 (95%: ± 0.0635)") and rows[attn][10] == "better, beyond seed noise"
    assert "| baseline-post-L24 | 2.4000 | **2.3000** | diverged |" in text
    assert "NVIDIA H100 80GB HBM3" in text and "final: seeds 1, 2, 3" in text
    assert rows[base][12] == "40.0 |"  # one device: the step time alone

    for r in runs:  # an arm that ran on another device: every step time says where
        r["device"] = "NVIDIA H200" if r["arm"] == moda else r["device"]
    rows = {cells[0][2:]: cells for cells in (line.split(" | ") for line in study.report_table({"runs": runs}).splitlines())}
    assert rows[moda][12] == "40.0 (H200) |" and rows[base][12] == "40.0 (H100 80GB HBM3) |"
    pytest.importorskip("matplotlib")
    for png in ("study_curves.png", "study_lr.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_report_is_named_after_its_results_file(tmp_path, capsys):
    """Two studies in one folder (study.json, study_long.json): each report writes its own files only."""
    runs = [_record("sweep", "baseline-pre-L24", 5e-4, 0, 1.8), _record("final", "baseline-pre-L24", 5e-4, 1, 1.7)]
    study.save_results(tmp_path / "study_long.json", {"setup": {}, "runs": runs})
    (tmp_path / "study.md").write_text("the other study")
    compare_models.main(["--report", "--results", str(tmp_path / "study_long.json")])
    assert "baseline-pre-L24" in (tmp_path / "study_long.md").read_text()
    assert (tmp_path / "study.md").read_text() == "the other study"
    if "no matplotlib" not in capsys.readouterr().out:
        assert {p.name for p in tmp_path.glob("*.png")} == {"study_long_curves.png", "study_long_lr.png"}


def test_the_sweep_extends_past_a_winning_edge():
    grid = [1e-3, 2e-3]

    def results(losses):
        return {"runs": [_record("sweep", "moda-post-L24", lr, 0, loss) for lr, loss in losses.items()]}

    assert study.next_sweep_lr(results({1e-3: 2.0}), "moda-post-L24", grid, 2) == 2e-3
    assert study.next_sweep_lr(results({1e-3: 2.0, 2e-3: 2.1}), "moda-post-L24", grid, 2) == 5e-4
    assert study.next_sweep_lr(results({1e-3: 2.0, 2e-3: 1.9}), "moda-post-L24", grid, 2) == 4e-3
    assert study.next_sweep_lr(results({1e-3: 2.0, 2e-3: 1.9}), "moda-post-L24", grid, 0) is None
    bracketed = {5e-4: 2.2, 1e-3: 2.0, 2e-3: 2.1}
    assert study.next_sweep_lr(results(bracketed), "moda-post-L24", grid, 2) is None
    falling = results({2.5e-4: 1.0, 5e-4: 2, 1e-3: 3, 2e-3: 4})  # two rates below the grid already
    assert study.next_sweep_lr(falling, "moda-post-L24", grid, 2) is None
    assert study.next_sweep_lr(falling, "moda-post-L24", grid, 3) == 1.25e-4
    assert study.next_sweep_lr(results({1e-3: None, 2e-3: None}), "moda-post-L24", grid, 1) == 5e-4
    assert study.best_lr(results({1e-3: None, 2e-3: None}), "moda-post-L24") is None


def test_arms_by_name_and_pattern():
    assert [a.name for a in study.parse_arms("*-L24")] == study.DEFAULT_ARMS[:6]
    table6_l48 = {(a.norm, a.depth_kv) for a in study.parse_arms("*-L48")}
    assert table6_l48 == {(norm, kv) for norm in ("pre", "post") for kv in ("none", "attn", "attn+ffn")}
    arm = study.parse_arms("moda-attn-pre-L12")[0]
    assert (arm.n_layer, arm.norm, arm.depth_kv) == (12, "pre", "attn")
    for bad in ("moda-sandwich-L24", "*-L96"):
        with pytest.raises(SystemExit):
            study.parse_arms(bad)


def test_train_gpt_curve_and_seeds(tmp_path, data, capsys):
    rows = train_gpt.main(
        ["--data", str(data), "--depth-kv", "none,attn", "--norm", "post", "--n-layer", "2", "--n-embd", "16",
         "--n-head", "2", "--n-kv-head", "1", "--block-size", "16", "--batch-size", "2", "--steps", "5",
         "--eval-interval", "2", "--skip-timing", "1", "--warmup", "2", "--eval-iters", "1", "--sample-tokens", "0",
         "--threads", "1", "--seeds", "1,2", "--out-dir", str(tmp_path / "out")]
    )  # fmt: skip
    assert [(r["model"], r["seed"]) for r in rows] == [("baseline-post", 1), ("moda-attn-post", 1),
                                                       ("baseline-post", 2), ("moda-attn-post", 2)]  # fmt: skip
    for r in rows:
        assert [p["tokens"] for p in r["curve"]] == [64, 128, 160]  # every 2 steps of 2 x 16 tokens, and the end
        assert r["curve"][-1]["val_loss"] == r["val_loss"] and all(math.isfinite(p["train_loss"]) for p in r["curve"])
    out = capsys.readouterr().out
    assert "| moda-attn-post | 2 |" in out
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    assert record["seeds"] == [1, 2] and record["config"]["n_layer"] == 2 and len(record["rows"]) == 4
    pytest.importorskip("matplotlib")
    assert (tmp_path / "out" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_default_run_has_its_seeds_on_record(tmp_path):
    """The default configuration's seed spread is recorded, so that one default run can say what it means."""
    recorded = json.loads(comparison.CPU_MAIN_JOB.read_text())
    defaults = train_gpt.parse_args(["--out-dir", str(tmp_path)])  # the defaults, whatever an earlier run left
    assert recorded["config"] == comparison.loss_config(defaults)
    assert len(recorded["seeds"]) >= 3
    assert comparison.seed_table(recorded["rows"]) in comparison.noise_note(defaults)


def test_the_installed_corpus_adds_the_packages_sources(tmp_path, monkeypatch):
    """``--corpus installed``: the stdlib corpus's documents and each installed package's source, shuffled alike
    on every build; site-packages inside the stdlib folder count only as installed packages."""
    stdlib, packages = tmp_path / "lib", tmp_path / "lib" / "site-packages"
    packages.mkdir(parents=True)
    (stdlib / "os_like.py").write_bytes(b"STDLIB_SOURCE")
    (packages / "torch_like.py").write_bytes(b"PACKAGE_SOURCE")
    paths = {"stdlib": str(stdlib), "purelib": str(packages), "platlib": str(packages)}
    monkeypatch.setattr(compare_models.sysconfig, "get_paths", lambda: paths)
    stdlib_only = compare_models.build_corpus(10**9)
    installed = compare_models.build_corpus(10**9, "installed")
    assert b"STDLIB_SOURCE" in stdlib_only and b"PACKAGE_SOURCE" not in stdlib_only
    assert b"STDLIB_SOURCE" in installed and installed.count(b"PACKAGE_SOURCE") == 1
    assert len(installed) == len(stdlib_only) + len(b"PACKAGE_SOURCE\n\n")
    assert compare_models.build_corpus(10**9, "installed") == installed
    assert compare_models.build_corpus(20, "installed") == installed[:20]
    with pytest.raises(ValueError, match="corpus must be one of"):
        compare_models.build_corpus(10, "web")
