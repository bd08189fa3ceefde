"""Context parallelism on two GPUs over NCCL: bf16 on the fused kernel against a float32 reference.

Skipped without two CUDA GPUs. Run: ``pytest tests/test_context_parallel_gpu.py``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

WORLD = 2
B, HK, G, CHUNK, L, D = 1, 2, 4, 256, 8, 64  # T = 2 * WORLD * CHUNK = 1024

# case id -> (variant kind, backend): auto takes the split path where it runs the blocks, triton the fused kernel
CASES = {
    f"{kind}-{backend}": (kind, backend)
    for kind in ("causal", "full", "causal_document", "depth_window")
    for backend in ("auto", "triton")
}

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= WORLD and dist.is_nccl_available()),
    reason=f"needs {WORLD} CUDA GPUs and NCCL",
)


def _variant(kind: str, seq_len: int, device):
    import moda_flex

    # The middle document has more tokens in its second chunk than in its first: a flex block.
    ids = torch.tensor([0] * (CHUNK - 8) + [1] * (2 * CHUNK) + [2] * (seq_len - 3 * CHUNK + 8), device=device)
    return {
        "causal": lambda: "causal",
        "full": lambda: "full",
        "causal_document": lambda: moda_flex.causal() & moda_flex.document(ids),
        "depth_window": lambda: moda_flex.depth_window(4),
    }[kind]()


def _check_case(kind: str, backend: str, device) -> None:
    """Output, lse and five gradients within the bf16 tolerance of the float32 one-process reference."""
    from moda_flex import moda_attention
    from moda_flex.context_parallel import context_parallel_moda_attention, shard_sequence
    from moda_flex.testing import relative_error, tolerance

    T = 2 * WORLD * CHUNK
    generator = torch.Generator(device=device).manual_seed(0)  # the same global inputs on every rank
    shapes = {"q": (B, HK * G, T, D), "k": (B, HK, T, D), "v": (B, HK, T, D),
              "depth_k": (B, HK, T, L, D), "depth_v": (B, HK, T, L, D)}  # fmt: skip
    inputs = {n: torch.randn(s, generator=generator, device=device, dtype=torch.bfloat16) for n, s in shapes.items()}
    grad_out = torch.randn(B, HK * G, T, D, generator=generator, device=device)
    variant = _variant(kind, T, device)

    reference = {n: t.float().requires_grad_() for n, t in inputs.items()}
    out, lse = moda_attention(**reference, variant=variant, backend="reference", return_lse=True)
    out.backward(grad_out)
    local = {n: shard_sequence(t).requires_grad_() for n, t in inputs.items()}
    out_cp, lse_cp = context_parallel_moda_attention(**local, variant=variant, backend=backend, return_lse=True)
    out_cp.backward(shard_sequence(grad_out).to(out_cp.dtype))

    pairs = {"out": (out_cp, out), "lse": (lse_cp, lse)}
    pairs.update({f"grad {n}": (local[n].grad, reference[n].grad) for n in shapes})
    for name, (actual, expected) in pairs.items():
        error = relative_error(actual, shard_sequence(expected))
        assert error <= tolerance(torch.bfloat16), f"{name}: relative error {error:.2e}"


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=device)
    results = {"cases": {}}
    for case, args in CASES.items():
        try:
            _check_case(*args, device)
            results["cases"][case] = None
        except Exception:
            results["cases"][case] = traceback.format_exc()
            print(f"rank {rank}, case {case}:\n{results['cases'][case]}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from test_context_parallel import run_workers

    return run_workers(__file__, WORLD, tmp_path_factory.mktemp("context_parallel_gpu"), timeout_s=600)


@pytest.mark.parametrize("case", CASES)
def test_matches_float32_reference(ranks, case):
    for rank, seen in enumerate(ranks):
        assert seen["cases"][case] is None, f"rank {rank}:\n{seen['cases'][case]}"


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
