"""Every Triton kernel compiles for an H100 (sm_90), checked on a machine without a GPU.

The interpreter runs the kernels' Python but not Triton's compiler; this runs
the compiler (``tests/compile_sm90.py``, in processes of its own) over the
calls that reach each kernel's constexpr branches, both kernel backends and
the triton backend's Hopper path.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


# Processes that share the cases: each compile is single-threaded and takes a second or more without a cache.
PROCESSES = 2


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Each case's kernels, with their scalar 16-bit global loads, as ``tests/compile_sm90.py`` prints them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_sm90.py")
    runs = [subprocess.Popen([sys.executable, str(script), str(index), str(PROCESSES)], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for index in range(PROCESSES)]  # fmt: skip
    cases = {}
    for run in runs:
        stdout, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stdout + stderr[-4000:]
        cases.update((case["case"], case["kernels"]) for case in map(json.loads, stdout.splitlines()))
    return cases


def test_every_kernel_compiles_for_sm90(compiled):
    for case, kernels in compiled.items():
        backend = case.split()[0]
        expected = {"triton": {"forward_kernel", "dq_kernel"}, "hopper": {"forward_kernel", "dq_kernel", "dkdv_kernel"},
                    "split": set()}[backend]  # fmt: skip
        assert expected <= set(kernels), (case, kernels)
        if backend == "split":  # one design's backward, which also writes what the vendor's backward reads
            assert {"_depth_backward_kernel", "_depth_backward_token_kernel"} & set(kernels), (case, kernels)
    every = {kernel for kernels in compiled.values() for kernel in kernels}
    assert {"dkdv_kernel", "_sanitize_kv_kernel", *DEPTH_READERS} <= every, every


# The kernels that read depth slots: the fused kernels and both designs of the split path's.
DEPTH_READERS = ("forward_kernel", "dq_kernel", "_depth_forward_kernel", "_depth_backward_kernel",
                 "_depth_forward_token_kernel", "_depth_backward_token_kernel")  # fmt: skip


# Calls with 16-byte aligned depth slots; the split path's two designs (per token at G=4, tiles at G=8).
ALIGNED = {"triton": ["triton causal G=4 bf16"], "split": ["split causal G=4 bf16", "split causal G=8 bf16"]}


@pytest.mark.parametrize("backend", ["triton", "split"])
def test_depth_slots_load_in_vectors_where_aligned(compiled, backend):
    """Slot pointers come from an address table, so the kernels must be told they are 16-byte aligned: without
    that the compiler loads every depth element on its own (2-byte loads), at a third of the speed."""
    aligned = {kernel: loads for case in ALIGNED[backend] for kernel, loads in compiled[case].items()}
    unaligned = compiled[f"{backend} unaligned"]
    readers = [kernel for kernel in DEPTH_READERS if kernel in aligned]
    assert readers and all(aligned[kernel] == 0 for kernel in readers), aligned
    if backend == "split":  # slots 2 bytes off a boundary: element loads, the only safe ones
        unaligned_readers = [kernel for kernel in DEPTH_READERS if kernel in unaligned]
        assert unaligned_readers and all(unaligned[kernel] > 0 for kernel in unaligned_readers), unaligned
