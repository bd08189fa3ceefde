"""Every Triton kernel compiles for an H100 (sm_90), checked on a machine without a GPU.

The interpreter runs the kernels' Python but not Triton's compiler; this runs
the compiler (``tests/compile_sm90.py``, in a process of its own) over the
calls that reach each kernel's constexpr branches, both kernel backends.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_sm90.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    compiled = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    for case, kernels in compiled.items():
        backend = case.split()[0]
        expected = {"triton": {"forward_kernel", "dq_kernel"}, "split": {"_depth_forward_kernel"}}[backend]
        assert expected <= set(kernels.split()), (case, kernels)
    assert {"dkdv_kernel", "_depth_backward_kernel"} <= set(" ".join(compiled.values()).split())
