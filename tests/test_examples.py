"""The examples and benchmarks: the GPT's cached decoding, a tiny training run, the heatmaps from its
checkpoint, a custom variant, every command line's help and usage errors, timings that other processes disturbed,
progress output, the kernel ablation."""

import importlib
import io
import json
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ablation
import comparison
import custom_variant
import gpt
import train_gpt
import visualize_attention
from gpt import GPT, GPTConfig, load_checkpoint
from progress import Progress, format_duration
from training import CPUClock

from moda_flex.nn import KVCache

ROOT = Path(__file__).resolve().parents[1]


def _model(depth_kv, norm, rope=True):
    torch.manual_seed(0)
    config = GPTConfig(
        n_embd=16, n_head=4, n_kv_head=2, depth_kv=depth_kv, norm=norm, rope=rope, vocab_size=32, block_size=16, n_layer=3
    )
    return GPT(config).double().eval()


@pytest.mark.parametrize(
    "depth_kv,norm,rope",
    [("none", "pre", True), ("attn", "post", True), ("attn+ffn", "post", True), ("attn+ffn", "pre", False)],
    ids=["baseline-pre", "attn-post", "ffn-post", "ffn-pre-wpe"],
)
def test_cached_decoding_gives_the_full_forward_logits(depth_kv, norm, rope):
    model = _model(depth_kv, norm, rope)
    idx = torch.randint(0, 32, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(idx)
        caches = [KVCache(idx.shape[1]) for _ in model.blocks]
        steps = [model(idx[:, :5], caches=caches)[0]]
        steps += [model(idx[:, t : t + 1], caches=caches)[0] for t in range(5, idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)

    prompt = idx[:, :4]
    torch.manual_seed(2)
    cached = model.generate(prompt, 8, top_k=1)
    torch.manual_seed(2)
    uncached = model.generate(prompt, 8, top_k=1, use_cache=False)
    assert torch.equal(cached, uncached)
    assert cached.shape == (2, 12)


def test_train_compare_checkpoint_and_heatmaps(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    rows = train_gpt.main(
        ["--data", str(data), "--depth-kv", "none,attn,attn+ffn", "--norm", "post", "--n-layer", "2",
         "--n-embd", "16", "--n-head", "2", "--n-kv-head", "1", "--block-size", "16", "--batch-size", "4",
         "--steps", "7", "--skip-timing", "1", "--warmup", "2", "--eval-iters", "2", "--sample-tokens", "8",
         "--threads", "1", "--out-dir", str(tmp_path / "out")]
    )  # fmt: skip
    assert [r["name"] for r in rows] == ["baseline-post", "moda-attn-post", "moda-post"]
    assert rows[0]["params_m"] == rows[1]["params_m"] < rows[2]["params_m"]  # only FFN KV adds weights
    assert all(0 < r["val_loss"] < 10 for r in rows)
    table = (tmp_path / "out" / "results.md").read_text()
    out = capsys.readouterr().out
    assert "| moda-post |" in table and table in out
    assert f"data: {data}, one token per byte" in out and "val loss (nats/byte)" in table
    assert "\r" not in out  # not a terminal: plain progress lines
    assert out.count("  train 7/7 100%") == 3 and out.count("  estimate: ") == 3
    assert "for the 2 run(s) after it" in out

    ckpt = tmp_path / "out" / "moda-post.pt"
    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint["config"]["depth_kv"] == "attn+ffn"
    model = load_checkpoint(str(ckpt))
    idx = torch.randint(0, 256, (1, 6))
    maps = visualize_attention.attention_maps(model, idx)
    assert [m.shape for m in maps] == [(2, 6, 6), (2, 6, 6 + 2)]
    torch.testing.assert_close(maps[1].sum(-1), torch.ones(2, 6))

    pytest.importorskip("matplotlib")
    paths = visualize_attention.main(["--ckpt", str(ckpt), "--data", str(data), "--tokens", "12",
                                      "--block-tokens", "128"])  # fmt: skip
    assert [path.name for path in paths] == ["moda-post-attention.png", "moda-post-mask.png", "moda-post-block-mask.png"]
    for png in paths:
        assert png.parent == ckpt.parent and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.splitlines()[-3:] == [f"wrote {path}" for path in paths]


def _mixed_model_maps():
    """A 3-layer attn+ffn config (layers read 0, 2, 4 depth entries) and its maps, random weights that sum to 1."""
    config = GPTConfig(n_embd=16, n_head=4, n_kv_head=2, n_layer=3, depth_kv="attn+ffn")
    T = 5
    generator = torch.Generator().manual_seed(0)
    maps = [torch.rand(4, T, T + slots, generator=generator).softmax(-1) for slots in (0, 2, 4)]  # (Hq, T, T + L)
    return config, maps


def test_depth_writers_name_layer_and_kind():
    config, _ = _mixed_model_maps()
    expected = ["layer 0 attn", "layer 0 FFN", "layer 1 attn", "layer 1 FFN"]
    assert visualize_attention.depth_writers(config, 4) == expected
    attn_only = GPTConfig(n_embd=16, n_head=4, n_kv_head=2, n_layer=3, depth_kv="attn")
    assert visualize_attention.depth_writers(attn_only, 2) == ["layer 0 attn", "layer 1 attn"]


def test_depth_writers_follow_the_stream_a_model_writes():
    """Each label names the entry the model really appended: the last layer's entries, by the object written."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_embd=16, n_head=4, n_kv_head=2, n_layer=3, depth_kv="attn+ffn", vocab_size=32,
                          block_size=8)).eval()  # fmt: skip
    written, read = {}, []

    def keep(label):
        def hook(module, args, output):
            stream = output[1] if isinstance(output, tuple) else output
            written[label] = stream.keys[-1]

        return hook

    hooks = []
    for i, block in enumerate(model.blocks[:-1]):
        hooks += [block.attn.register_forward_hook(keep(f"layer {i} attn")),
                  block.ffn_kv.register_forward_hook(keep(f"layer {i} FFN"))]  # fmt: skip
    hooks.append(model.blocks[-1].attn.register_forward_pre_hook(lambda module, args: read.extend(args[1].keys)))
    with torch.no_grad():
        model(torch.randint(0, 32, (1, 6)))
    for hook in hooks:
        hook.remove()
    labels = visualize_attention.depth_writers(model.config, len(read))
    assert [written[label] is entry for label, entry in zip(labels, read)] == [True] * 4


def test_attention_picture_names_entries_heads_and_colour_scale():
    pytest.importorskip("matplotlib")
    config, maps = _mixed_model_maps()
    figure = visualize_attention.plot_attention(maps, config, n_layers=3, n_heads=2)
    assert figure.get_suptitle().splitlines()[1:] == [
        "rows: query heads 0-1 of 4; columns: layers 0, 1, 2 of 3",
        "colour: sqrt(attention weight), the colourbar in weights",
    ]
    panels = [ax for ax in figure.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels[:3:2]] == ["layer 0, head 0\n5 keys, no depth entries yet",
                                                      "layer 2, head 0\n5 keys | 4 depth entries"]  # fmt: skip
    figure.canvas.draw()
    last = panels[-1]  # layer 2, head 1: the bottom row carries the labels
    labels = [t.get_text() for t in last.get_xticklabels()]
    assert labels[-4:] == ["layer 0 attn", "layer 0 FFN", "layer 1 attn", "layer 1 FFN"]
    # One unit per column, keys and depth entries alike: a plain image of T + L columns.
    assert [ax.get_images()[0].get_array().shape for ax in panels[-3:]] == [(5, 5), (5, 7), (5, 9)]
    assert all(ax.get_xlim() == (-0.5, ax.get_images()[0].get_array().shape[1] - 0.5) for ax in panels)
    colourbar = [ax for ax in figure.axes if ax.get_ylabel().startswith("attention weight")]
    assert colourbar[0].get_ylabel() == "attention weight (colour: sqrt(weight))"


def test_folded_mask_matches_the_paper():
    # The mask of visualize_attention's picture: query groups folded into rows, every token's depth.
    T, G, L = 3, 2, 2
    config = GPTConfig(n_embd=16, n_head=4, n_kv_head=2, n_layer=2, depth_kv="attn+ffn")  # G = 2, L = 2
    elements, _ = visualize_attention.mask_views(config, mask_tokens=T, block_tokens=128)
    mask = elements.dense()
    assert mask.shape == (G * T, T + T * L)
    for r in range(G * T):
        for k in range(T):
            assert mask[r, k] == (r // G >= k)  # grouped causal mask
        for j in range(T * L):
            assert mask[r, T + j] == (r // G == j // L)  # base-time depth mask


def test_bad_flags_are_rejected():
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--depth-kv", "none,ffn"])
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--norm", "sandwich"])


def test_custom_variant_reads_attention_slots_and_matches_flex(capsys):
    variant = custom_variant.attention_slots_only()
    depth = variant.depth_predicate(5)(0, 0, torch.tensor(3), torch.tensor([[3], [2]]), torch.arange(5))
    assert depth.tolist() == [[True, False, True, False, True], [False] * 5]
    custom_variant.main(["--examples", "3"])
    out = capsys.readouterr().out
    assert "attention_slots_only" in out and "|█·█·█·" in out and "on 3 random shapes" in out


def test_custom_variant_learns_its_depth_bias(capsys):
    custom_variant.check_learned_bias(examples=3)
    bias = custom_variant.train_bias(steps=12)
    assert int(bias.argmax()) == 2 and "loss" in capsys.readouterr().out


# What an example needs beyond the core install: (module, the extra of pyproject.toml that brings it). The others
# run with the core install alone (matplotlib, where they draw, is optional: they say so and skip the picture).
NEEDS_EXTRA = {
    "examples/custom_variant.py": ("hypothesis", "test"),
    "examples/visualize_attention.py": ("matplotlib", "plot"),
}


def _extras() -> dict:
    """pyproject.toml's extras: {extra: [module, ...]} (a requirement's name, its markers left off)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {extra: [re.split(r"[;<>=\[ ]", req)[0] for req in reqs] for extra, reqs in optional.items()}


def _example_scripts() -> list[str]:
    """Every example that is a command line."""
    return sorted(f"examples/{path.name}" for path in (ROOT / "examples").glob("*.py")
                  if 'if __name__ == "__main__":' in path.read_text())  # fmt: skip


def test_every_example_helps_with_the_core_install_alone():
    """Where no extra is installed, every example still imports and prints its --help (exit 0)."""
    blocked = sorted({module for modules in _extras().values() for module in modules})
    child = (
        "import json, runpy, sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None  # as where it is not installed\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "codes = {}\n"
        f"for script in {_example_scripts()!r}:\n"
        "    sys.argv = [script, '--help']\n"
        "    try:\n"
        "        runpy.run_path(script, run_name='__main__')\n"
        "    except SystemExit as exit:\n"
        "        codes[script] = exit.code\n"
        "    except Exception as error:\n"
        "        codes[script] = repr(error)\n"
        "print(json.dumps(codes))\n"
    )
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    codes = json.loads(result.stdout.splitlines()[-1])
    assert codes == {script: 0 for script in _example_scripts()}


@pytest.mark.parametrize("script", NEEDS_EXTRA)
def test_an_example_that_needs_an_extra_says_which(script, monkeypatch, capsys):
    module, extra = NEEDS_EXTRA[script]
    assert module in _extras()[extra]
    assert _run_cli(script, ["--help"], monkeypatch) == 0
    assert f'from the {extra} extra (pip install -e ".[{extra}]")' in " ".join(capsys.readouterr().out.split())
    monkeypatch.setitem(sys.modules, module, None)  # as where it is not installed
    args = {"examples/visualize_attention.py": ["--ckpt", "x.pt"]}.get(script, [])
    last = _one_line_usage_error(script, args, monkeypatch, capsys)
    assert last.endswith(f'needs {module}, from the {extra} extra: pip install -e ".[{extra}]" '
                         f"(or pip install {module})")  # fmt: skip


def test_the_main_job_install_brings_every_extra_an_example_needs():
    (main_job,) = [line for line in (ROOT / "README.md").read_text().splitlines() if "# main job" in line]
    installed = re.search(r'pip install -e "\.\[([\w,]+)\]"', main_job).group(1).split(",")
    assert {extra for _, extra in NEEDS_EXTRA.values()} <= set(installed)


# Every command line: --help exits 0 and gives each option a description and a default.
SCRIPTS = [
    "examples/gpt.py", "examples/train_gpt.py", "examples/visualize_attention.py", "examples/custom_variant.py",
    "examples/compare_models.py", "benchmarks/ablation.py", "benchmarks/bench_context_parallel.py",
    "benchmarks/flex_block_mask.py", "benchmarks/bench_data_parallel.py", "benchmarks/bench_hopper.py",
    "benchmarks/bench_flex.py", "benchmarks/bench_score.py", "benchmarks/kernel_registers.py", "benchmarks/suite.py",
    "moda_flex.visualize",
]  # fmt: skip
WITH_DEVICE = ["examples/gpt.py", "examples/train_gpt.py", "examples/compare_models.py", "benchmarks/ablation.py",
               "benchmarks/bench_context_parallel.py", "benchmarks/flex_block_mask.py",
               "benchmarks/bench_hopper.py"]  # fmt: skip
CUDA_ONLY = ["benchmarks/bench_data_parallel.py", "benchmarks/suite.py"]


def _run_cli(script: str, args: list[str], monkeypatch) -> int:
    """Run a script under the checkout as ``python script args`` would (a module: its main); the exit code."""
    with pytest.raises(SystemExit) as exit_info:
        if script.endswith(".py"):
            path = ROOT / script
            monkeypatch.setattr(sys, "argv", [str(path), *args])
            monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])  # what python does for a script
            runpy.run_path(str(path), run_name="__main__")
        else:
            importlib.import_module(script).main(args)
    return exit_info.value.code


def _option_entries(help_text: str) -> list[str]:
    """The help of each option and positional argument, one string per entry (``-h`` left out)."""
    entries, section = [], False
    for line in help_text.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            section = line in ("options:", "optional arguments:", "positional arguments:")
        elif section and line.startswith("  ") and not line.startswith("   "):
            entries.append(line.strip())
        elif section and line.strip():
            entries[-1] += "  " + line.strip()  # the name may stand alone on its line
    return [entry for entry in entries if not entry.startswith("-h")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_every_option_with_a_default(script, monkeypatch, capsys):
    assert _run_cli(script, ["--help"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    entries = _option_entries(out)
    assert entries
    for entry in entries:
        name, _, description = entry.partition("  ")
        assert description.strip(), f"{script}: {name} has no description"
        assert "default" in description, f"{script}: {entry!r} does not say its default"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("script", WITH_DEVICE + CUDA_ONLY)
def test_cuda_on_a_machine_without_it_is_a_usage_error(script, monkeypatch, capsys):
    args = ["--device", "cuda"] if script in WITH_DEVICE else []
    assert _run_cli(script, args, monkeypatch) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "no CUDA device is available" in err or "needs a CUDA GPU" in err


def test_gpt_cli_describes_and_samples(capsys):
    sample = gpt.main(["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--n-kv-head", "1", "--tokens", "5",
                       "--prompt", "ab"])  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("GPT: 2 layers, width 32, 2 query / 1 KV heads") and "untrained" in out
    assert sample.startswith("ab") and sample in out


def test_progress_in_a_log_is_plain_lines():
    stream = io.StringIO()  # not a terminal
    progress = Progress(20, label="  train", stream=stream, every=5)
    for step in range(20):
        progress.update(step + 1, f"loss {1.0 / (step + 1):.3f}")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [line.split()[1] for line in lines] == ["5/20", "10/20", "15/20", "20/20"]
    assert lines[1].endswith("left") and "100%" in lines[-1] and "left" not in lines[-1]


def test_progress_on_a_terminal_is_one_bar():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = Progress(3, label="  train", stream=stream)
    for step in range(3):
        progress.update(step + 1, "loss 1.0")
    text = stream.getvalue()
    assert text.startswith("\r  train [") and text.endswith("\n") and text.count("\n") == 1
    assert "3/3 100%" in text.splitlines()[-1].split("\r")[-1]


@pytest.mark.parametrize("seconds, text", [(5.4, "5s"), (65, "1m05s"), (3725, "1h02m")])
def test_durations_read_like_a_clock(seconds, text):
    assert format_duration(seconds) == text


def test_runs_write_to_a_folder_of_their_shape_and_never_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "input.txt").write_text("x" * 2000)
    assert train_gpt.parse_args([]).out_dir == str(Path("out") / "pydoc-4x128")
    assert train_gpt.parse_args(["--n-layer", "8"]).out_dir == str(Path("out") / "pydoc-8x128")
    assert train_gpt.parse_args(["--data", "input.txt"]).out_dir == str(Path("out") / "input-4x128")
    (tmp_path / "out" / "pydoc-4x128").mkdir(parents=True)
    (tmp_path / "out" / "pydoc-4x128" / "moda-pre.pt").write_bytes(b"")
    with pytest.raises(SystemExit):
        train_gpt.parse_args([])
    assert "moda-pre.pt exists from an earlier run: pass --overwrite" in capsys.readouterr().err
    assert train_gpt.parse_args(["--overwrite"]).overwrite


def test_ablation_rows_compute_moda(capsys):
    # On a GPU, triton and flex run their fp32 products as TF32; on CPU (Triton's interpreter) they are exact.
    device, tolerance = ("cuda", 5e-3) if torch.cuda.is_available() else ("cpu", 1e-4)
    results = ablation.main(["--device", device, "--dtype", "float32", "--quick", "--warmup", "0", "--repeats", "1"])
    assert sorted(results) == [1, 2, 3, 4]
    for row, (ms, error) in results.items():
        assert ms > 0 and error < tolerance, (row, error)
    table = capsys.readouterr().out
    assert "| (4) | + group-aware (moda_attention triton) |" in table and "| 1.460 |" in table


def _row(name, step_ms, share, seed=1):
    return {"name": name, "norm": "pre", "seed": seed, "params_m": 1.0, "val_loss": 1.5, "tok_s": 1000.0,
            "step_ms": step_ms, "peak_mb": None, "cpu_share": share, "threads": 2}  # fmt: skip


def test_disturbed_timings_are_flagged_not_reported():
    quiet = [_row("baseline-pre", 80.0, 0.97), _row("moda-pre", 120.0, 0.95)]
    table = comparison.format_table(quiet)
    assert "| moda-pre | 1.00 | 1.5000 | 1,000 | 120.0 | 1.50x | 95% of 2 |" in table
    assert "disturbed" not in table and comparison.timing_note(quiet) is None

    shaken = [_row("baseline-pre", 80.0, 0.97), _row("moda-pre", 400.0, 0.45)]
    table = comparison.format_table(shaken)
    assert "| moda-pre | 1.00 | 1.5000 | 1,000 (disturbed) | 400.0 (disturbed) | (disturbed) | 45% of 2 |" in table
    assert "x |" not in table.splitlines()[-1]  # no ratio for a disturbed row
    assert "while moda-pre trained" in comparison.timing_note(shaken)

    seeds = [_row("baseline-pre-seed1", 80.0, 0.97), _row("moda-pre-seed1", 120.0, 0.95),
             _row("baseline-pre-seed2", 100.0, 0.97, seed=2), _row("moda-pre-seed2", 120.0, 0.95, seed=2)]  # fmt: skip
    assert [line.split(" | ")[5] for line in comparison.format_table(seeds).splitlines()[2:]] == [
        "1.00x", "1.50x", "1.00x", "1.20x"]  # each model against the baseline of its own seed


def test_cpu_clock_tells_waiting_from_working(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    waiting = CPUClock(torch.device("cpu"))
    waiting.start()
    time.sleep(0.2)  # wall time passes, as when other processes hold the cores
    waiting.stop()
    assert waiting.share < 0.2 and waiting.disturbed

    working = CPUClock(torch.device("cpu"))
    working.start()
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    working.stop()
    # The share itself depends on this machine's load; what the clock counted does not.
    assert working.cpu >= 0.2 > waiting.cpu and working.steps == 1
    assert working.share == pytest.approx(working.cpu / working.wall)
    assert CPUClock(torch.device("cuda")).share is None  # the host waits for a GPU: no measure there


def test_a_run_too_short_to_time_reports_no_timing(tmp_path, capsys):
    rows = train_gpt.main(["--steps", "2", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--n-kv-head", "1",
                           "--block-size", "16", "--batch-size", "2", "--eval-iters", "1", "--sample-tokens", "0",
                           "--threads", "1", "--out-dir", str(tmp_path)])  # fmt: skip
    assert [r["step_ms"] for r in rows] == [None, None]
    table = (tmp_path / "results.md").read_text()
    assert table.splitlines()[0] == "| model | params (M) | val loss (nats/byte) |"
    assert "tok/s" not in capsys.readouterr().out


# What each script can check before it starts ends in one line and exit status 2, never a traceback.
USAGE_ERRORS = [
    ("examples/gpt.py", ["--backend", "bogus"], "argument --backend: invalid choice: 'bogus'"),
    ("examples/gpt.py", ["--n-embd", "100", "--n-head", "3"], "need n_embd % n_head == 0"),
    ("examples/gpt.py", ["--temperature", "0"], "argument --temperature: must be a finite number > 0, got 0"),
    ("examples/train_gpt.py", ["--backend", "bogus"], "argument --backend: invalid choice: 'bogus'"),
    ("examples/train_gpt.py", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("examples/train_gpt.py", ["--lr", "0"], "argument --lr: must be a finite number > 0, got 0"),
    ("examples/train_gpt.py", ["--seeds", "1,two"], "argument --seeds: '1,two' is not a comma-separated list"),
    ("examples/train_gpt.py", ["--n-embd", "100", "--n-head", "3"], "need n_embd % n_head == 0"),
    ("examples/train_gpt.py", ["--data", "no-such-file.txt"], "--data no-such-file.txt: no such file"),
    ("examples/compare_models.py", ["--lrs", "1e-3,fast"], "--lrs 1e-3,fast: 'fast' is not a number"),
    ("examples/visualize_attention.py", ["--ckpt", "x.pt", "--tokens", "0"], "argument --tokens: must be >= 1"),
    ("examples/custom_variant.py", ["--examples", "0"], "argument --examples: must be >= 1, got 0"),
    # a comma-separated choice list, checked before the GPU is asked for
    ("benchmarks/suite.py", ["--arms", "attn,bogus"], "argument --arms: 'bogus' is not one of attn, attn+ffn"),
]  # fmt: skip


def _one_line_usage_error(script, args, monkeypatch, capsys) -> str:
    assert _run_cli(script, args, monkeypatch) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith(f"{Path(script).name}: error: ")
    return last


@pytest.mark.parametrize("script, args, message", USAGE_ERRORS, ids=[f"{s}-{a[0]}" for s, a, _ in USAGE_ERRORS])
def test_options_out_of_range_are_usage_errors(script, args, message, monkeypatch, capsys):
    assert message in _one_line_usage_error(script, args, monkeypatch, capsys)


def test_data_too_short_for_a_block_is_a_usage_error(tmp_path, monkeypatch, capsys):
    data = tmp_path / "short.txt"
    data.write_text("x" * 1000)  # 100 validation bytes
    last = _one_line_usage_error("examples/train_gpt.py", ["--data", str(data)], monkeypatch, capsys)
    assert "1,000 bytes is too short for --block-size 128" in last


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("backend", ["triton", "split"])
@pytest.mark.parametrize("script", ["examples/gpt.py", "examples/train_gpt.py", "examples/compare_models.py"])
def test_a_fused_backend_without_cuda_is_a_usage_error(script, backend, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' interpreter would run the kernels on CPU
    last = _one_line_usage_error(script, ["--backend", backend], monkeypatch, capsys)
    assert f"--backend {backend}: " in last and "needs CUDA" in last
    assert last.endswith("(--backend auto picks one that can)")
