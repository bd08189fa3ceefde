"""The processes of ``tests/compile_sm90.py`` that ``tests/test_kernels_compile.py`` reads.

Compiling every kernel for sm_90 keeps a core busy for a minute or more per
process. ``conftest.py`` starts the processes as soon as a session has
collected that module, so they run beside the tests before it rather than
after them; the module's fixture takes their output, starting them itself
if nothing did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MODULE = "test_kernels_compile.py"
# Processes that share the cases: each compile is single-threaded and takes a second or more without a cache.
PROCESSES = 2

_running: list[subprocess.Popen] = []


def start() -> None:
    """Start the processes, once a session."""
    if _running:
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_sm90.py")
    arguments = [(str(index), str(PROCESSES), "90") for index in range(PROCESSES)] + [("0", "1", "80")]
    _running.extend(subprocess.Popen([sys.executable, str(script), *args], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                    for args in arguments)  # fmt: skip


def results() -> dict:
    """Each case's kernels, with their scalar 16-bit global loads, as ``compile_sm90.py`` prints them."""
    start()
    cases = {}
    for run in _running:
        stdout, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stdout + stderr[-4000:]
        cases.update((case["case"], case["kernels"]) for case in map(json.loads, stdout.splitlines()))
    return cases


def stop() -> None:
    """Kill the processes still running."""
    for run in _running:
        if run.poll() is None:
            run.kill()
            run.communicate()
