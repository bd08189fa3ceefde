"""Context parallelism: two gloo processes against the one-process reference, and bad input on every rank.

One run of 2 and one of 3 worker processes (this file run as a script) runs every case and
writes what each rank saw to a JSON file; the tests read those files. Shapes
are tiny (T=16 or 24, D=8, float64 on the reference backend, float32 on
triton under the interpreter) so that a run finishes in seconds on two CPU cores.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

WORLDS = (2, 3)  # 2: the next and the previous rank are the same one; 3: they differ
CHUNK, HEAD_DIM = 4, 8  # T = 2 * world * CHUNK
TIMEOUT_S = 120  # a hang fails the tests instead of stalling them

# case id -> (variant kind, B, Hk, G, L, backend)
CASES = {
    "causal-B1-Hk1-G1-L0": ("causal", 1, 1, 1, 0, "reference"),
    "causal-B2-Hk2-G2-L3": ("causal", 2, 2, 2, 3, "reference"),
    "full-B1-Hk1-G2-L3": ("full", 1, 1, 2, 3, "reference"),
    "causal_document-B2-Hk1-G2-L3": ("causal_document", 2, 1, 2, 3, "reference"),
    "causal_document-B1-Hk1-G2-L2-flex": ("causal_document", 1, 1, 2, 2, "flex"),
    "causal-B1-Hk1-G2-L3-triton": ("causal", 1, 1, 2, 3, "triton"),
    "causal_document_chunk_aligned-B1-Hk1-G2-L2-triton": ("causal_document_chunk_aligned", 1, 1, 2, 2, "triton"),
    "causal-B1-Hk1-G2-L3-split": ("causal", 1, 1, 2, 3, "split"),
    "depth_window-B1-Hk2-G2-L3-split": ("depth_window", 1, 2, 2, 3, "split"),
    "full_document_per_row-B2-Hk2-G1-L0": ("full_document_per_row", 2, 2, 1, 0, "reference"),
    "depth_window-B1-Hk1-G2-L3": ("depth_window", 1, 1, 2, 3, "reference"),
    "depth_only-B1-Hk1-G1-L3": ("depth_only", 1, 1, 1, 3, "reference"),
    "depth_only_empty_rows-B1-Hk1-G2-L0": ("depth_only", 1, 1, 2, 0, "reference"),
}

# case id -> (exception type on every rank, text the message contains on the rank that failed)
BAD_INPUTS = {
    "odd_local_length": ("ValueError", "divisible by 2 * world"),
    "shards_differ_across_ranks": ("ValueError", "same shape"),
    "one_rank_bad_depth": ("ValueError", "depth_k must have shape"),
    "sliding_window": ("NotImplementedError", "sliding_window"),
    "chunk_depth": ("NotImplementedError", "chunk_depth"),
    "document_ids_wrong_length": ("ValueError", "doc_ids must have shape"),
    "document_ids_not_contiguous": ("ValueError", "contiguous"),
    "shard_length_not_divisible": ("ValueError", "divisible by 2 * world_size"),
}

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)
KERNEL_BACKENDS = ("triton", "split")  # Triton kernels: under TRITON_INTERPRET=1 on CPU, float32


def _backend_missing(backend: str) -> bool:
    """A kernel backend this install cannot run: no triton package, or a backend name not registered."""
    from moda_flex import backends

    return backend in KERNEL_BACKENDS and (importlib.util.find_spec("triton") is None or backend not in backends.NAMES)


# -- the workers ----------------------------------------------------------------


def _variant(kind: str, batch: int, seq_len: int):
    """A variant over the global sequence; documents cross chunk borders, some taller than wide.

    ``causal_document_chunk_aligned`` has none taller than wide (CHUNK = 4):
    every block has a structure, so triton runs them all.
    """
    import moda_flex

    ids = torch.tensor([0] * 5 + [1] * 9 + [2] * (seq_len - 14))
    per_row = torch.stack([ids, torch.tensor([0] * 2 + [1] * 3 + [2] * (seq_len - 5))])[:batch]
    aligned = torch.tensor([0] * 6 + [1] * 2 + [2] * (seq_len - 8))
    return {
        "causal": lambda: "causal",
        "full": lambda: "full",
        "causal_document": lambda: moda_flex.causal() & moda_flex.document(ids),
        "causal_document_chunk_aligned": lambda: moda_flex.causal() & moda_flex.document(aligned),
        "full_document_per_row": lambda: moda_flex.full() & moda_flex.document(per_row),
        "depth_window": lambda: moda_flex.depth_window(2),
        "depth_only": moda_flex.depth_only,
    }[kind]()


def _check_case(kind, batch, kv_heads, groups, slots, backend) -> list[int]:
    """Context-parallel MoDA against the one-process reference: out, lse, five gradients.

    float64 inputs (float32 on the kernel backends, which have no float64). FlexAttention
    has no backward on CPU: with ``backend="flex"`` only out and lse.

    Returns:
        [block forwards during the ring's forward, block forwards during its backward].
    """
    from moda_flex import moda_attention
    from moda_flex.context_parallel import context_parallel_moda_attention, gather_sequence, shard_sequence

    torch.manual_seed(0)  # the same global inputs on every rank
    B, Hk, T, D = batch, kv_heads, 2 * dist.get_world_size() * CHUNK, HEAD_DIM
    Hq = Hk * groups
    shapes = {"q": (B, Hq, T, D), "k": (B, Hk, T, D), "v": (B, Hk, T, D),
              "depth_k": (B, Hk, T, slots, D), "depth_v": (B, Hk, T, slots, D)}  # fmt: skip
    grads = backend != "flex"
    dtype = torch.float32 if backend in KERNEL_BACKENDS else torch.float64
    inputs = {name: torch.randn(shape, dtype=torch.float64, requires_grad=grads) for name, shape in shapes.items()}
    grad_out = torch.randn(B, Hq, T, D, dtype=torch.float64)
    grad_lse = torch.randn(B, Hq, T, dtype=torch.float64)
    variant = _variant(kind, batch, T)

    out, lse = moda_attention(**inputs, variant=variant, backend="reference", return_lse=True)
    local = {name: shard_sequence(t.detach()).to(dtype).requires_grad_(grads) for name, t in inputs.items()}
    with _counting_block_forwards() as calls:
        out_cp, lse_cp = context_parallel_moda_attention(**local, variant=variant, backend=backend, return_lse=True)
        counts = [len(calls)]
        if grads:
            torch.autograd.backward(
                [out_cp, lse_cp], [shard_sequence(grad_out).to(dtype), shard_sequence(grad_lse).float()]
            )
        counts.append(len(calls) - counts[0])

    # The lse crosses the ring in float32 (what moda_attention returns): float32-sized errors.
    close = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out_cp, shard_sequence(out).to(dtype), **close)
    torch.testing.assert_close(lse_cp, shard_sequence(lse), **close)
    torch.testing.assert_close(gather_sequence(out_cp.detach()), out.to(dtype), **close)
    if not grads:
        return counts
    torch.autograd.backward([out, lse], [grad_out, grad_lse.float()])
    for name, t in inputs.items():
        expected = shard_sequence(t.grad).to(dtype)
        torch.testing.assert_close(local[name].grad, expected, msg=lambda m: f"grad {name}: {m}", **close)
    return counts


@contextlib.contextmanager
def _counting_block_forwards():
    """Count the forwards of attention blocks on reference, triton and split while inside: yields the calls."""
    from moda_flex.backends import reference

    calls = []
    targets = [(reference, "_attention")]  # the reference's forward, under reference_attention
    if not _backend_missing("triton"):
        from moda_flex.backends.triton import ops

        targets.append((ops, "_run_forward"))  # the forward kernel's launch, eager or compiled
    if not _backend_missing("split"):
        from moda_flex.backends.split import ops as split_ops

        targets.append((split_ops, "_forward"))  # the split op's forward, vendor and depth kernels

    def counted(name, original):
        def call(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        return call

    originals = [(module, name, getattr(module, name)) for module, name in targets]
    for module, name, original in originals:
        setattr(module, name, counted(name, original))
    try:
        yield calls
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def _check_gather() -> None:
    """shard_sequence then gather_sequence is the identity; gradients sum over the ranks that used the tensor."""
    from moda_flex.context_parallel import gather_sequence, shard_sequence

    world = dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(2, 3, 2 * world * CHUNK, 2, dtype=torch.float64)
    weight = torch.randn_like(x)
    part = shard_sequence(x).requires_grad_()
    gathered = gather_sequence(part)
    torch.testing.assert_close(gathered, x, rtol=0, atol=0)
    (gathered * weight).sum().backward()
    torch.testing.assert_close(part.grad, world * shard_sequence(weight))


def _bad_input(case: str, rank: int, world: int) -> None:
    """Make the call of one bad-input case; it must raise."""
    import moda_flex
    from moda_flex.context_parallel import context_parallel_moda_attention, shard_sequence

    def inputs(tokens=8, depth_tokens=None, slots=2):
        q, k, v = (torch.randn(1, 2, tokens, HEAD_DIM, dtype=torch.float64) for _ in range(3))
        depth = torch.randn(1, 2, depth_tokens or tokens, slots, HEAD_DIM, dtype=torch.float64)
        return q, k, v, depth, depth

    ids = torch.tensor([0] * 8 + [1] * 8 * (world - 1))
    calls = {
        "odd_local_length": lambda: context_parallel_moda_attention(*inputs(tokens=7)),
        "shards_differ_across_ranks": lambda: context_parallel_moda_attention(*inputs(tokens=8 if rank == 0 else 6)),
        "one_rank_bad_depth": lambda: context_parallel_moda_attention(*inputs(depth_tokens=8 if rank == 0 else 4)),
        "sliding_window": lambda: context_parallel_moda_attention(*inputs(), variant=moda_flex.sliding_window(4)),
        "chunk_depth": lambda: context_parallel_moda_attention(*inputs(), variant=moda_flex.chunk_depth(2)),
        "document_ids_wrong_length": lambda: context_parallel_moda_attention(
            *inputs(), variant=moda_flex.causal() & moda_flex.document(ids[:12])
        ),
        "document_ids_not_contiguous": lambda: context_parallel_moda_attention(
            *inputs(), variant=moda_flex.causal() & moda_flex.document(ids.roll(4))
        ),
        "shard_length_not_divisible": lambda: shard_sequence(torch.zeros(1, 1, 10, HEAD_DIM)),
    }
    calls[case]()


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Run every case on this rank and write {case: None or the error} to out_dir/rank{rank}.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {"cases": {}, "block_forwards": {}, "bad_inputs": {}}
    for case, args in CASES.items():
        if _backend_missing(args[-1]):
            continue
        try:
            results["block_forwards"][case] = _check_case(*args)
            results["cases"][case] = None
        except Exception:
            results["cases"][case] = traceback.format_exc()
            # Also now: a rank that failed halfway leaves the others waiting, and the log must say why.
            print(f"rank {rank}, case {case}:\n{results['cases'][case]}", file=sys.stderr, flush=True)
    for case in BAD_INPUTS:
        try:
            _bad_input(case, rank, world)
            results["bad_inputs"][case] = None
        except Exception as error:
            results["bad_inputs"][case] = [type(error).__name__, str(error)]
    try:
        _check_gather()
        results["gather"] = None
    except Exception:
        results["gather"] = traceback.format_exc()
    # The group still works after the rejected calls: nothing was left half-sent.
    try:
        _check_case("causal", 1, 1, 2, 1, "reference")
        results["after_errors"] = None
    except Exception:
        results["after_errors"] = traceback.format_exc()
    # Every rank done before any tears the group down: a rank whose peer closed its connections first aborts.
    dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


# -- the tests ------------------------------------------------------------------


def run_workers(script: str, world: int, tmp: Path, timeout_s: float = TIMEOUT_S) -> list[dict]:
    """Run ``python script rank world init_file tmp`` for every rank; return what each wrote to tmp/rank{r}.json."""
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(rank), str(world), str(tmp / "init"), str(tmp)],
            env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for rank in range(world)
    ]
    try:
        logs = [proc.communicate(timeout=timeout_s)[0] for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        logs = "\n".join(f"rank {rank}:\n{proc.communicate()[0]}" for rank, proc in enumerate(procs))
        pytest.fail(f"the context-parallel workers did not finish in {timeout_s} s (a hang):\n{logs}")
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{log}"
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda world: f"world{world}")
def ranks(request, tmp_path_factory):
    """What each rank of one run with ``world`` processes saw: a list of result dicts."""
    world = request.param
    return run_workers(__file__, world, tmp_path_factory.mktemp(f"context_parallel_world{world}"))


def _needs_backend(case: str) -> None:
    if _backend_missing(CASES[case][-1]):
        pytest.skip(f"backend {CASES[case][-1]!r} needs the triton package and its registration")


@pytest.mark.parametrize("case", CASES)
def test_matches_one_process_reference(ranks, case):
    _needs_backend(case)
    for rank, seen in enumerate(ranks):
        assert seen["cases"][case] is None, f"rank {rank}:\n{seen['cases'][case]}"


# flex takes no given lse: its blocks run forward again in the backward.
@pytest.mark.parametrize("case", [case for case, args in CASES.items() if args[-1] in ("reference", "triton", "split")])
def test_backward_runs_no_block_forward(ranks, case):
    """The backward differentiates each block from the merged (out, lse): it runs no block's forward again."""
    _needs_backend(case)
    for rank, seen in enumerate(ranks):
        assert seen["cases"][case] is None, f"rank {rank}:\n{seen['cases'][case]}"
        forward, backward = seen["block_forwards"][case]
        assert forward > 0, f"rank {rank}: the counter saw none of the ring's block forwards"
        assert backward == 0, f"rank {rank}: the backward ran {backward} block forwards (the forward ran {forward})"


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_on_every_rank(ranks, case):
    kind, text = BAD_INPUTS[case]
    raised = [seen["bad_inputs"][case] for seen in ranks]
    assert all(r is not None for r in raised), f"some rank did not raise: {raised}"
    assert [r[0] for r in raised] == [kind] * len(ranks), raised
    assert any(text in r[1] for r in raised), raised


def test_gather_sequence_inverts_shard_sequence(ranks):
    for rank, seen in enumerate(ranks):
        assert seen["gather"] is None, f"rank {rank}:\n{seen['gather']}"


def test_group_still_works_after_rejected_calls(ranks):
    for rank, seen in enumerate(ranks):
        assert seen["after_errors"] is None, f"rank {rank}:\n{seen['after_errors']}"


@pytest.mark.parametrize(
    "method, backend",
    [("merged_lse", "reference"), ("merged_lse", "triton"), ("merged_lse", "split"), ("recomputed", "reference")],
)
def test_block_backwards_sum_to_the_one_call_gradients(method, backend):
    """In one process: a call split into two key blocks, each differentiated alone, gives the call's gradients.

    ``merged_lse`` is the backward of blocks on ``backend`` through ``backends.merged_backward``
    (float64 on reference, float32 on the kernels); ``recomputed`` the one for blocks on flex, here
    run on reference because FlexAttention has no backward on CPU.
    """
    import moda_flex
    from moda_flex import context_parallel as cp

    if _backend_missing(backend):
        pytest.skip(f"backend {backend!r} needs the triton package and its registration")
    torch.manual_seed(0)
    C, L = CHUNK, 3
    dtype = torch.float32 if backend in KERNEL_BACKENDS else torch.float64
    q = torch.randn(1, 2, C, HEAD_DIM, dtype=dtype)  # queries at positions C .. 2C - 1
    k, v = (torch.randn(1, 1, 2 * C, HEAD_DIM, dtype=dtype) for _ in range(2))
    depth_k, depth_v = (torch.randn(1, 1, C, L, HEAD_DIM, dtype=dtype) for _ in range(2))
    grad_out, grad_lse = torch.randn_like(q), torch.randn(1, 2, C, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, depth_k, depth_v)]
    out, lse = moda_flex.moda_attention(*leaves, backend="reference", return_lse=True)
    torch.autograd.backward([out, lse], [grad_out, grad_lse.float()])

    out, lse = out.detach(), lse.detach().to(dtype)
    rows = cp._Rows(out, lse, grad_out, grad_lse, dtype, ("cpu", False, torch.bfloat16))
    ring = cp._Ring(group=None, rank=0, world=1, steps=[], scale=HEAD_DIM**-0.5, backend=backend)
    rows_all = slice(0, C)
    blocks = [cp._Block(cp._ALL, rows_all, slice(0, C), cp._FULL, depth=False),  # keys before the queries
              cp._Block(cp._ALL, rows_all, slice(C, 2 * C), moda_flex.causal(), depth=True)]  # fmt: skip
    kv = torch.stack([k, v])
    grads = [torch.zeros_like(t) for t in (q, kv, depth_k, depth_v)]
    for block in blocks:
        inputs = cp._block_inputs(block, q, kv, depth_k, depth_v)
        if method == "merged_lse":
            block_grads = cp._block_backward(block, inputs, rows, ring)
        else:
            block_grads = cp._recomputed_block_backward(block, inputs, rows, ring)
        grads[0] += block_grads[0]
        grads[1][:, :, :, block.cols] += torch.stack(block_grads[1:3])
        if block.depth:
            grads[2] += block_grads[3]
            grads[3] += block_grads[4]
    expected = [leaves[0].grad, torch.stack([leaves[1].grad, leaves[2].grad]), leaves[3].grad, leaves[4].grad]
    close = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for name, actual, want in zip(["q", "k and v", "depth_k", "depth_v"], grads, expected):
        torch.testing.assert_close(actual, want, msg=lambda m: f"grad {name}: {m}", **close)


def test_reaches_the_kernels_only_through_the_policy():
    """context_parallel.py imports no module under ``moda_flex.backends`` but the policy itself, and names
    none through it (``backends.split``, ...): the kernels are reached through ``moda_attention`` and the
    policy's functions. Imports inside functions count."""
    import ast
    import pkgutil

    import moda_flex.backends
    from moda_flex import context_parallel

    below = {info.name for info in pkgutil.iter_modules(moda_flex.backends.__path__)}  # reference, split, ...
    path = Path(context_parallel.__file__)
    reaches = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # Relative to the package: level 1 is moda_flex.
            base = "moda_flex" if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            modules = [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "backends":
            modules = [f"moda_flex.backends.{node.attr}"]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[:2] == ["moda_flex", "backends"] and len(parts) > 2 and parts[2] in below:
                reaches.append(f"line {node.lineno}: {module}")
    assert not reaches, f"{path.name} reaches below the policy: {reaches}"


def test_zigzag_positions_balance_causal_work():
    from moda_flex.context_parallel import zigzag_positions

    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    parts = [zigzag_positions(24, 3, rank) for rank in range(3)]
    assert sorted(torch.cat(parts).tolist()) == list(range(24))
    # Causal keys seen by each rank's queries: the same for all.
    assert len({int((p + 1).sum()) for p in parts}) == 1
    with pytest.raises(ValueError, match="divisible"):
        zigzag_positions(10, 3, 0)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
