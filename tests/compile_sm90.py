"""Compile every Triton kernel for an H100 (sm_90), and the generic path's for an A100 (sm_80), without a GPU.

The interpreter runs a kernel's Python, so it never meets what Triton's
compiler refuses: two returns of different types, a keyword the kernel does
not take, a constexpr branch that does not type-check. This script sets a
driver in front of Triton whose launches compile and do not run, for compute
capability 9.0, then calls ``moda_attention`` forward and backward for each
case: every launch compiles its kernel to a cubin with the ptxas that Triton's
wheel ships. Outputs are never read (no kernel runs).

Run by ``tests/test_kernels_compile.py`` in processes of its own: the kernels
must be imported with ``TRITON_INTERPRET`` unset. ``python compile_sm90.py
INDEX COUNT [ARCH]`` compiles every COUNT-th case from INDEX, so that COUNT processes
share the cases, for compute capability ARCH (90, or 80: the cases of
:data:`A100_CASES`, without the Hopper path). Prints one JSON line per case, ``{"case": name, "kernels":
{kernel: scalar 16-bit global loads in its PTX}}``, and exits non-zero at the
first failure.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import moda_flex.backends.split.kernels  # noqa: E402,F401  (decorated as compiled kernels, not interpreted)
import moda_flex.backends.triton.kernels  # noqa: E402,F401
from moda_flex import moda_attention, scores, variants  # noqa: E402
from moda_flex.backends import split  # noqa: E402
from moda_flex.backends.triton import configs, triton_attention  # noqa: E402
from moda_flex.testing import MoDAShape, make_inputs  # noqa: E402

# The kernels are imported as compiled ones; the support checks, read per call, take CPU tensors under this.
os.environ["TRITON_INTERPRET"] = "1"

# The target a process compiles for (main's ARCH): an H100, or an A100.
TARGET = GPUTarget("cuda", 90, 32)
# The A100's cases: every kernel of the generic path, either design of the split path's depth kernels.
A100_CASES = ("triton causal G=4 bf16", "split causal G=4 bf16", "split causal G=8 bf16", "triton softcap & bias")


class CompileOnly(DriverBase):
    """A driver for a GPU that is not there: the current target is :data:`TARGET`, device 0, stream 0."""

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty):
        return "void*"

    def get_current_target(self):
        return TARGET

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("nothing runs here")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compile_launches(compiled: dict) -> None:
    """Make every kernel launch compile only (``warmup``), recording in ``compiled`` each kernel's count of
    scalar 16-bit global loads (a tile the compiler could not load in vectors)."""
    launch = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        # every kernel is launched through its flat wrapper (moda_flex.backends.flat), which inlines it
        compiled[self.fn.__name__.removesuffix("_flat")] = len(re.findall(r"\bld\.global(?:\.\w+)*\.b16\b", kernel.asm["ptx"]))
        return kernel

    JITFunction.run = run


def split_takes_any_float() -> None:
    """Let the split path take fp16/bf16 on CPU, as it does on CUDA (its CPU sequence part computes them)."""
    check = split.unsupported_reason

    def unsupported_reason(q, k, variant):
        return check(q.float() if q.is_floating_point() else q, k, variant)

    split.unsupported_reason = unsupported_reason


def _inputs(B, Hq, Hk, Tq, Tk, L, D, dtype, entries=False, unaligned=False):
    """:func:`moda_flex.testing.make_inputs`' five tensors; with ``unaligned`` a depth slab whose slots sit 2 bytes
    off a 16-byte boundary."""
    q, k, v, dk, dv = make_inputs(MoDAShape(B, Hq, Hk, Tq, Tk, L, D), dtype=dtype, depth_entries=entries).values()
    if unaligned:
        dk, dv = (torch.randn(B, Hk, Tq, L * D + 1, dtype=dtype)[..., 1:].view(B, Hk, Tq, L, D).requires_grad_()
                  for _ in range(2))  # fmt: skip
    return q, k, v, dk, dv


def cases():
    """(name, backend, inputs, variant, return_lse): the kernels' constexpr branches that calls reach."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    docs = torch.tensor([[0] * 20 + [1] * 12])
    bias = torch.zeros(3, requires_grad=True)
    for backend in ("triton", "split"):
        yield f"{backend} causal G=4 bf16", backend, _inputs(1, 8, 2, 32, 32, 3, 64, bf16), "causal", False
        if backend == "split":  # the split path's tile design; the fused kernels take G=8 in "depth_window lse"
            yield "split causal G=8 bf16", backend, _inputs(1, 16, 2, 32, 32, 3, 64, bf16), "causal", False
        yield f"{backend} full G=3 fp16", backend, _inputs(2, 6, 2, 32, 32, 3, 64, fp16), "full", False
        yield f"{backend} entries G=1", backend, _inputs(1, 2, 2, 32, 32, 3, 64, bf16, entries=True), "causal", False
        yield f"{backend} depth_window lse", backend, _inputs(1, 8, 1, 32, 32, 3, 128, bf16), \
            variants.depth_window(2), True
        yield f"{backend} depth_only", backend, _inputs(1, 4, 2, 32, 32, 3, 64, bf16), variants.depth_only(), False
        yield f"{backend} L=0", backend, _inputs(1, 4, 2, 32, 32, 0, 64, bf16), "causal", False
        yield f"{backend} unaligned", backend, _inputs(1, 4, 2, 32, 32, 3, 64, bf16, unaligned=True), "causal", False
    yield "split D=128 G=2", "split", _inputs(1, 4, 2, 32, 32, 3, 128, bf16), "causal", False
    yield "triton fp32", "triton", _inputs(1, 4, 2, 32, 32, 3, 64, fp32), "causal", False
    yield "triton D=48 Tq<Tk", "triton", _inputs(1, 4, 2, 17, 32, 3, 48, bf16), "causal", True
    yield "triton window", "triton", _inputs(1, 4, 2, 32, 32, 3, 64, bf16), variants.sliding_window(5), False
    yield "triton documents", "triton", _inputs(1, 4, 2, 32, 32, 3, 64, bf16), variants.document(docs), False
    yield "triton softcap & bias", "triton", _inputs(1, 4, 2, 32, 32, 3, 64, bf16), \
        variants.causal() & (scores.softcap(20.0) & scores.depth_bias(bias)), False


def hopper_cases():
    """(name, inputs, variant, DQ_ATOMIC): the triton backend's Hopper path (tensor descriptors), which
    ``MODA_FLEX_TRITON_PATH=hopper`` selects, with dQ from its kernel or added by the dK/dV kernel."""
    for dq_atomic in (0, 1):
        yield f"hopper causal G=4 DQ_ATOMIC={dq_atomic}", _inputs(1, 8, 2, 37, 37, 5, 64, torch.bfloat16), \
            variants.causal(), dq_atomic
        yield f"hopper decode G=2 DQ_ATOMIC={dq_atomic}", _inputs(1, 4, 2, 1, 29, 3, 32, torch.bfloat16), \
            variants.full(), dq_atomic


def _backward(result) -> None:
    out, lse = result if isinstance(result, tuple) else (result, None)
    (out.float().sum() + (lse.sum() if lse is not None else 0)).backward()


def launches():
    """(name, call) for every case, in order: ``call()`` makes the case's launches, forward and backward."""
    for name, backend, (q, k, v, dk, dv), variant, return_lse in cases():
        yield name, functools.partial(_attention_backward, q, k, v, dk, dv, variant, backend, return_lse)
    for name, (q, k, v, dk, dv), variant, dq_atomic in hopper_cases():
        yield name, functools.partial(_hopper_backward, q, k, v, dk, dv, variant, dq_atomic)


def _attention_backward(q, k, v, dk, dv, variant, backend, return_lse) -> None:
    _backward(moda_attention(q, k, v, dk, dv, variant=variant, backend=backend, return_lse=return_lse))


def _hopper_backward(q, k, v, dk, dv, variant, dq_atomic) -> None:
    def config(kernel, default):
        return {**default, "DQ_ATOMIC": dq_atomic} if kernel == "dkdv" else default

    os.environ[configs.PATH_ENV] = "hopper"
    try:
        _backward(triton_attention(q, k, v, dk, dv, variant, q.shape[-1] ** -0.5, config=config))
    finally:
        os.environ.pop(configs.PATH_ENV)


def main(argv: list[str]) -> int:
    """Compile every case, or with arguments ``INDEX COUNT [ARCH]`` every COUNT-th one from INDEX (one of COUNT
    processes that share the cases) for compute capability ARCH; an A100's names start with ``sm80``."""
    global TARGET
    index, count, arch = (*map(int, argv), 90)[:3] if argv else (0, 1, 90)
    TARGET = GPUTarget("cuda", arch, 32)
    driver.set_active(CompileOnly())
    compiled: dict = {}
    compile_launches(compiled)
    split_takes_any_float()
    cases_here = launches() if arch == 90 else ((f"sm80 {name}", call) for name, call in launches()
                                                 if name in A100_CASES)
    for name, call in itertools.islice(cases_here, index, None, count):
        compiled.clear()
        call()
        print(json.dumps({"case": name, "kernels": compiled}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
