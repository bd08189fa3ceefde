"""Every Triton kernel compiles for an H100 (sm_90), checked on a machine without a GPU.

The interpreter runs the kernels' Python but not Triton's compiler; this runs
the compiler (``tests/compile_sm90.py``, in processes of its own) over the
calls that reach each kernel's constexpr branches, both kernel backends and
the triton backend's Hopper path.
"""

import pytest

import sm90_processes

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Each case's kernels, with their scalar 16-bit global loads, as ``tests/compile_sm90.py`` prints them
    (run in processes of their own: :mod:`sm90_processes`)."""
    return sm90_processes.results()


def test_every_kernel_compiles_for_sm80(compiled):
    """The generic path, which an A100 runs: the fused kernels and both designs of the split path's."""
    a100 = {case: kernels for case, kernels in compiled.items() if case.startswith("sm80 ")}
    every = {kernel for kernels in a100.values() for kernel in kernels}
    assert len(a100) == 4 and {"forward_kernel", "dq_kernel", "dkdv_kernel", *DEPTH_READERS} <= every, a100


def test_every_kernel_compiles_for_sm90(compiled):
    for case, kernels in compiled.items():
        if case.startswith("sm80 "):
            continue
        backend = case.split()[0]
        expected = {"triton": {"forward_kernel", "dq_kernel"}, "hopper": {"forward_kernel", "dq_kernel", "dkdv_kernel"},
                    "split": set()}[backend]  # fmt: skip
        assert expected <= set(kernels), (case, kernels)
        if backend == "split":  # one design's backward
            assert {"_depth_backward_kernel", "_depth_backward_token_kernel"} & set(kernels), (case, kernels)
    every = {kernel for kernels in compiled.values() for kernel in kernels}
    assert {"dkdv_kernel", *DEPTH_READERS} <= every, every


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
