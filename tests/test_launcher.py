"""``moda_flex.backends.launcher``: which launches reuse a binary through its own launcher, and with what.

The kernel here is a stand-in for a ``@triton.jit`` function that records
each launch Triton makes and each launch through the binary's launcher, so
the rules run on CPU; the GPU tests run the real kernels through it.
"""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from triton import knobs  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from moda_flex.backends import launcher  # noqa: E402

CUDA = torch.device("cuda")
STREAM = 77


class _Param:
    def __init__(self, name, default=None, has_default=False):
        self.name, self.default, self.has_default = name, default, has_default


class Binary:
    function, packed_metadata = "function", "packed"

    def __init__(self, runs):
        self.runs = runs

    def launch_metadata(self, grid, stream, *values):
        return ("metadata", grid, stream)

    def run(self, *args):
        self.runs.append(args)


class Kernel(JITFunction):
    """``kernel(X, n, FLAG=False)``: Triton's launches in ``triton_launches``, the binary's in ``binary_runs``."""

    def __init__(self):  # noqa: D107 (no JIT compilation: nothing of JITFunction's own state is used)
        self.arg_names = ["X", "n", "FLAG"]
        self.params = [_Param("X"), _Param("n"), _Param("FLAG", False, True)]
        self.triton_launches, self.binary_runs = [], []

    def __getitem__(self, grid):
        def run(**arguments):
            self.triton_launches.append((grid, arguments))
            return Binary(self.binary_runs)

        return run

    def __hash__(self):
        return id(self)


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(launcher, "_current_device_and_stream", lambda: (0, STREAM))
    return Kernel()


def test_a_launch_of_a_kind_seen_before_runs_the_binary_with_every_argument_in_order(kernel):
    x = torch.zeros(8)
    launcher.launch(kernel, (3, 2), CUDA, n=5, X=x)
    assert len(kernel.triton_launches) == 1 and not kernel.binary_runs
    y = torch.ones(8)  # another tensor of the same kind
    launcher.launch(kernel, (4,), CUDA, n=5, X=y)
    assert len(kernel.triton_launches) == 1
    (run,) = kernel.binary_runs
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)  # Triton's own, as its launch passes
    assert run[:9] == (4, 1, 1, STREAM, "function", "packed", ("metadata", (4, 1, 1), STREAM), *hooks)
    assert run[9] is y and run[10:] == (5, False)  # in the kernel's order, the default filled in


@dataclasses.dataclass
class Descriptor:
    base: torch.Tensor
    shape: list
    block_shape: list


def _kinds():
    x = torch.zeros(8)
    yield "an int of another value", dict(X=x, n=6)
    yield "a bool where an int was", dict(X=x, n=True)
    yield "a float where an int was", dict(X=x, n=5.0)
    yield "another dtype", dict(X=x.half(), n=5)
    yield "an address not 16-byte aligned", dict(X=x[1:], n=5)
    yield "a constexpr of another value", dict(X=x, n=5, FLAG=True)


@pytest.mark.parametrize("name, arguments", list(_kinds()), ids=[name for name, _ in _kinds()])
def test_a_launch_of_another_kind_goes_through_triton(kernel, name, arguments):
    launcher.launch(kernel, (1,), CUDA, X=torch.zeros(8), n=5)
    launcher.launch(kernel, (1,), CUDA, **arguments)
    assert len(kernel.triton_launches) == 2 and not kernel.binary_runs
    launcher.launch(kernel, (1,), CUDA, **arguments)  # now a kind seen before
    assert len(kernel.triton_launches) == 2 and len(kernel.binary_runs) == 1


def test_a_tuple_is_keyed_by_its_elements_and_their_types(kernel):
    for n in [(5, 1), (5.0, 1), (5, True), (5.0, 1)]:  # strides: tuples of ints; the last a kind seen before
        launcher.launch(kernel, (1,), CUDA, X=torch.zeros(8), n=n)
    assert len(kernel.triton_launches) == 3 and len(kernel.binary_runs) == 1


def test_a_descriptor_is_keyed_by_its_base_and_fields(kernel):
    x = torch.zeros(64)
    launcher.launch(kernel, (1,), CUDA, X=Descriptor(x, [64], [16]), n=1)
    launcher.launch(kernel, (1,), CUDA, X=Descriptor(torch.ones(64), [64], [16]), n=1)
    assert len(kernel.triton_launches) == 1 and len(kernel.binary_runs) == 1
    launcher.launch(kernel, (1,), CUDA, X=Descriptor(x, [64], [32]), n=1)
    assert len(kernel.triton_launches) == 2


@pytest.mark.parametrize("n", [object(), (1, object()), Descriptor(torch.zeros(64), [64], object())],
                         ids=["unknown kind", "in a tuple", "in a descriptor"])  # fmt: skip
def test_an_argument_keyed_by_nothing_always_goes_through_triton(kernel, n):
    for _ in range(2):
        launcher.launch(kernel, (1,), CUDA, X=torch.zeros(8), n=n)
    assert len(kernel.triton_launches) == 2 and not kernel.binary_runs


def test_a_kernel_keeps_a_bounded_number_of_binaries(kernel, monkeypatch):
    """Sizes are keyed by value: calls whose sizes keep changing must not grow the binaries without end."""
    monkeypatch.setattr(launcher, "_MOST_KINDS", 4)
    for n in range(10):
        launcher.launch(kernel, (1,), CUDA, X=torch.zeros(8), n=n)
    assert 0 < len(launcher._binaries(kernel).unfixed.binaries) <= 4
    launcher.launch(kernel, (1,), CUDA, X=torch.zeros(8), n=9)  # the latest is still kept
    assert len(kernel.binary_runs) == 1


def test_calls_off_cuda_and_other_kernels_always_go_through_triton(kernel):
    for _ in range(2):
        launcher.launch(kernel, (1,), torch.device("cpu"), X=torch.zeros(8), n=5)
    assert len(kernel.triton_launches) == 2 and not kernel.binary_runs

    launches = []

    class StandIn:  # a test's stand-in for a kernel: not a JITFunction
        def __getitem__(self, grid):
            return lambda **arguments: launches.append(grid)

    for _ in range(2):
        launcher.launch(StandIn(), (1,), CUDA, X=torch.zeros(8))
    assert launches == [(1,), (1,)]


def test_a_fixed_launch_keys_only_the_other_arguments_and_binds_both_in_order(kernel):
    fixed = launcher.Fixed((3,), dict(n=5))
    x = torch.zeros(8)
    launcher.launch_fixed(kernel, fixed, CUDA, X=x)
    assert kernel.triton_launches == [((3,), dict(n=5, X=x))]
    y = torch.ones(8)
    launcher.launch_fixed(kernel, fixed, CUDA, X=y)
    (run,) = kernel.binary_runs
    assert run[:3] == (3, 1, 1) and run[9] is y and run[10:] == (5, False)
    launcher.launch_fixed(kernel, fixed, CUDA, X=y.half())  # another kind of the bound tensor
    assert len(kernel.triton_launches) == 2
    other = launcher.Fixed((3,), dict(n=6))  # another layout: its own binaries
    launcher.launch_fixed(kernel, other, CUDA, X=y)
    assert len(kernel.triton_launches) == 3 and len(kernel.binary_runs) == 1


def test_a_fixed_launch_off_cuda_goes_through_triton_with_both_parts(kernel):
    fixed = launcher.Fixed((2, 2), dict(n=5, FLAG=True))
    x = torch.zeros(8)
    for _ in range(2):
        launcher.launch_fixed(kernel, fixed, torch.device("cpu"), X=x)
    assert kernel.triton_launches == [((2, 2), dict(n=5, FLAG=True, X=x))] * 2 and not kernel.binary_runs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_kernel_through_its_binary_computes_what_triton_launches():
    """On a GPU: a kernel's later launches go through its binary, in the current stream, a graph's capture
    included, and compute what Triton's own launch does; a misaligned view takes another binary."""
    import triton
    import triton.language as tl

    @triton.jit
    def scaled_add(X, Y, OUT, n, scale, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x, y = tl.load(X + offsets, mask=mask), tl.load(Y + offsets, mask=mask)
        tl.store(OUT + offsets, x * scale + y, mask=mask)

    device = torch.device("cuda")

    def run(x, y, scale):
        out = torch.empty_like(x)
        launcher.launch(scaled_add, (triton.cdiv(x.numel(), 128),), device, X=x, Y=y, OUT=out, n=x.numel(),
                        scale=scale, BLOCK=128)  # fmt: skip
        return out

    def by_triton(x, y, scale):  # Triton's own launch (its fused multiply-add rounds unlike x * scale + y)
        out = torch.empty_like(x)
        scaled_add[(triton.cdiv(x.numel(), 128),)](x, y, out, x.numel(), scale, BLOCK=128)
        return out

    x, y = torch.randn(2, 1000, device=device).unbind(0)
    for scale in (2.0, 3.0, 3.0):  # the first launch compiles; the others run the binary
        torch.testing.assert_close(run(x, y, scale), by_triton(x, y, scale), rtol=0, atol=0)
    binaries = launcher._binaries(scaled_add).unfixed.binaries
    assert len(binaries) == 2  # two scales, one binary each (keyed by value), the third call a hit
    x1, y1 = torch.randn(2, 1001, device=device)[:, 1:].unbind(0)  # 4 bytes past an aligned address
    torch.testing.assert_close(run(x1, y1, 3.0), by_triton(x1, y1, 3.0), rtol=0, atol=0)
    assert len(binaries) == 3
    graph, static = torch.cuda.CUDAGraph(), torch.zeros_like(x)
    with torch.cuda.graph(graph):
        static.copy_(run(x, y, 3.0))
    x.mul_(-1)
    graph.replay()
    torch.testing.assert_close(static, by_triton(x, y, 3.0), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "split"])
def test_a_kernel_backends_calls_through_their_binaries_match_the_reference(backend, monkeypatch):
    """On a GPU: the second call of a layout launches every kernel through its binary, and still computes
    MoDA (the first call, through Triton, is checked alike)."""
    from moda_flex.testing import MoDAShape, assert_matches_reference, make_inputs

    runs = []
    run_binary = launcher.run_binary
    monkeypatch.setattr(launcher, "run_binary", lambda *args: runs.append(args) or run_binary(*args))
    inputs = make_inputs(MoDAShape(2, 6, 2, 70, 70, 5, 64), device="cuda", dtype=torch.bfloat16, seed=3)
    for _ in range(2):
        runs.clear()
        assert_matches_reference(inputs, backend=backend, variant="causal")
    assert len(runs) >= (3 if backend == "triton" else 4)  # forward, and the backward's launches
