"""examples/train_gpt.py under DDP and FSDP2: two gloo processes on CPU give the one-process step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parallel_worker
import train_gpt
from training import Ranks

ROOT = Path(__file__).resolve().parents[1]

WORLD = 2
TIMEOUT_S = 150  # a hang fails instead of stalling the suite


def _flags(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--data", str(data), "--depth-kv", "attn+ffn", "--norm", "post", "--n-layer", "2", "--n-embd", "16",
            "--n-head", "2", "--n-kv-head", "1", "--block-size", "16", "--batch-size", "4", "--steps", "2",
            "--skip-timing", "0", "--warmup", "1", "--eval-iters", "2", "--sample-tokens", "4", "--lr", "1e-2",
            "--out-dir", str(out), *extra]  # fmt: skip


def _spawn(tmp_path: Path, grads: str, flags: list[str]) -> list[subprocess.CompletedProcess]:
    """Run WORLD worker processes to the end (they import the examples by name); returns each one's result."""
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "parallel_worker.py"), str(store), grads, *flags],
            env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1",
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "examples"), os.environ.get("PYTHONPATH")]))},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        for rank in range(WORLD)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    return results


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return path


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_parallel_step_equals_one_process(mode, data, tmp_path):
    grads_path = tmp_path / "grads.pt"
    results = _spawn(tmp_path, str(grads_path), _flags(data, tmp_path / mode, "--parallel", mode))
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    assert "moda-post" in results[0].stdout and results[1].stdout == ""  # rank 0 alone prints

    # The first step's loss and every gradient, against one process on the whole batch.
    torch.set_num_threads(1)
    one = tmp_path / "one"
    loss, grads = parallel_worker.first_gradients(_flags(data, one), Ranks())
    parallel = torch.load(grads_path, weights_only=True)
    assert parallel["loss"] == pytest.approx(loss, rel=1e-5)
    assert parallel["grads"].keys() == grads.keys()
    assert all(grad is not None for grad in grads.values())  # DDP's default check: no parameter without one
    for name, grad in grads.items():
        torch.testing.assert_close(parallel["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)

    # Two whole training steps: the saved weights and the validation loss.
    [row] = train_gpt.main(_flags(data, one))
    saved = torch.load(tmp_path / mode / "moda-post.pt", weights_only=True)
    expected = torch.load(one / "moda-post.pt", weights_only=True)
    assert saved["val_loss"] == pytest.approx(row["val_loss"], rel=1e-5)
    assert saved["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        torch.testing.assert_close(saved["model"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_batch_not_divisible_by_the_processes_stops_every_rank(data, tmp_path):
    results = _spawn(tmp_path, "", _flags(data, tmp_path / "out", "--parallel", "ddp", "--batch-size", "3"))
    for result in results:
        assert result.returncode == 2
        assert "--batch-size 3 (the global batch) must be divisible by the 2 processes" in result.stderr
    assert not (tmp_path / "out").exists()


def test_parallel_needs_torchrun():
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--parallel", "ddp"])
