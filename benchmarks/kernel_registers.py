"""Registers and spills of the depth kernels on an H100 (sm_90), compiled on a machine without a GPU.

A kernel capped at a register count (the per-token backward's 128) spills
what does not fit to local memory, which costs time no profile names. This
compiles each kernel as a call reaches it, through the compile-only driver of
``tests/compile_sm90.py`` (no kernel runs), and assembles its PTX with the
``ptxas`` that Triton's wheel ships (``-v``: registers, spill stores and
loads in bytes a thread). The calls are a Table 6 layer's layout
(6 query / 2 KV heads unless ``--groups`` says, D=64, bf16, by default L=23, the mean of a Table 6
step with FFN entries): each forward, then each depth backward.

The local compiler is Triton's on this machine, which may differ from the
GPU's; compare rows of one run.

Usage::

    python benchmarks/kernel_registers.py
    python benchmarks/kernel_registers.py --slots 47
    python benchmarks/kernel_registers.py --slots 12 --groups 8   # the split path's Tensor Core tiles design
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402

# The kernels whose PTX is assembled: the split path's depth kernels of either design (per-token at G <= 4,
# Tensor Core tiles above), the fused kernels' forward and dQ.
KERNELS = ("_depth_forward_token_kernel", "_depth_backward_token_kernel", "_depth_forward_kernel",
           "_depth_backward_kernel", "forward_kernel", "dq_kernel")


def record_ptx(ptx: dict) -> None:
    """Make every launch compile only, keeping the PTX of each kernel of :data:`KERNELS` in ``ptx``."""
    from triton.runtime.jit import JITFunction

    launch = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        if self.fn.__name__ in KERNELS:
            ptx[self.fn.__name__] = kernel.asm["ptx"]
        return kernel

    JITFunction.run = run


def calls(slots: int, groups: int = 3):
    """(backend, form, run): the forward and each depth backward form of a Table 6 layer's layout with
    ``slots`` entries (``groups`` query heads a KV head), on the split path and on the fused kernel
    (``capture``'s functions off a capture)."""
    import torch

    from moda_flex import variants
    from moda_flex.backends import capture
    from moda_flex.backends.split import ops
    from moda_flex.testing import MoDAShape, make_inputs

    q, k, v, dk, dv = make_inputs(MoDAShape(1, 2 * groups, 2, 64, 64, slots, 64), dtype=torch.bfloat16,
                                  depth_entries=True, requires_grad=False).values()  # fmt: skip
    inputs = ops.Inputs(q, k, v, list(dk), list(dv))
    opts = ops.call_options(q, k, slots, variants.causal(), 0.125)
    yield "split", "forward", lambda: ops._forward(*inputs, opts)
    split_out, split_lse = ops._forward(*inputs, opts)
    split_grads = ops.Grads(torch.randn_like(split_out), None, split_out, split_lse)
    yield "split", "plain", lambda: ops.backward_in_op_layouts(split_grads, inputs, opts)
    yield "fused", "forward", lambda: capture._forward(inputs, opts)
    out, lse = capture._forward(inputs, opts)
    grads = ops.Grads(torch.randn_like(out), None, out, lse)
    yield "fused", "plain", lambda: capture._fused_backward(grads, inputs, opts)


def assemble(ptx: str) -> dict:
    """Registers and spill bytes of ``ptx`` for sm_90a, by the first of Triton's ptxas builds that takes its
    PTX version, and its machine code's counts (:func:`opcodes`; static: a loop's body counts once)."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        for name in ("ptxas", "ptxas-blackwell"):
            done = subprocess.run([str(tools / name), "-arch=sm_90a", "-v", str(source), "-o", str(source) + ".o"],
                                  capture_output=True, text=True)  # fmt: skip
            if done.returncode == 0:
                log = done.stdout + done.stderr
                numbers = {key: re.search(pattern, log) for key, pattern in (
                    ("registers", r"Used (\d+) registers"), ("spill stores", r"(\d+) bytes spill stores"),
                    ("spill loads", r"(\d+) bytes spill loads"))}  # fmt: skip
                sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(source) + ".o"], capture_output=True,
                                      text=True, check=True).stdout  # fmt: skip
                return {key: int(m.group(1)) if m else 0 for key, m in numbers.items()} | opcodes(sass)
    raise RuntimeError(f"no ptxas under {tools} assembles this PTX:\n{done.stderr}")


def opcodes(sass: str) -> dict:
    """Instructions, the longest loop's body, barriers and shared memory loads and stores (what a change of
    layout between a reduction and its use costs) in ``sass``, ``nvdisasm -c``'s listing: a loop is a branch
    back to a label above it, its body what lies between."""
    names, labels, longest = [], {}, 0
    for line in sass.splitlines():
        if label := re.match(r"^(\.L_x_\d+):", line):
            labels[label.group(1)] = len(names)
        elif op := re.match(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line):
            names.append(op.group(1))
            target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
            if target and target.group(1) in labels:  # a branch back: the end of a loop
                longest = max(longest, len(names) - labels[target.group(1)])
    return {"instructions": len(names), "longest loop": longest, "barriers": names.count("BAR"),
            "shared accesses": sum(name in ("LDS", "STS") for name in names)}  # fmt: skip


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--slots", type=cli.at_least(1), default=23,
                   help="L, the depth entries of the calls (the mean of a Table 6 step with FFN entries)")
    p.add_argument("--groups", type=cli.at_least(1), default=3,
                   help="G, query heads a KV head (the split path's tiles design from 5)")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # the kernels are imported as compiled ones
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import compile_sm90  # imports the kernels, then sets the interpreter again for the support checks
    import triton
    from triton.runtime import driver

    driver.set_active(compile_sm90.CompileOnly())
    ptx: dict = {}
    record_ptx(ptx)
    compile_sm90.split_takes_any_float()
    print(f"Triton {triton.__version__}, sm_90a, a Table 6 layer's layout at G={args.groups} (D=64, bf16, "
          f"L={args.slots})\n")
    print("| backend | form | kernel | registers | spill stores (B) | spill loads (B) | instructions | longest loop "
          "| barriers | shared accesses |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for backend, form, run in calls(args.slots, args.groups):
        ptx.clear()
        run()
        for kernel, source in ptx.items():
            r = assemble(source)
            print(f"| {backend} | {form} | `{kernel}` | {r['registers']} | {r['spill stores']} | {r['spill loads']} | "
                  f"{r['instructions']} | {r['longest loop']} | {r['barriers']} | {r['shared accesses']} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
