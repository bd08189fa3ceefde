"""Every Python block of the README runs as printed, in a fresh namespace, and prints what its comments say.

A line ``print(...)  # text`` promises that the block prints ``text``. A block
whose first line reads ``# name.py: torchrun ...`` runs as that file under
torchrun, with two processes.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks() -> list[tuple[str, str]]:
    """(the heading above it, the code) of every ```python block, in order."""
    blocks, heading, code = [], None, None
    for line in README.splitlines(keepends=True):
        if code is not None:
            if line.startswith("```"):
                blocks.append((heading, "".join(code)))
                code = None
            else:
                code.append(line)
        elif line.startswith("```python"):
            code = []
        elif line.startswith("#"):
            heading = line.strip("# \n")
    return blocks


BLOCKS = _blocks()


def _opening_commands() -> tuple[str, str]:
    """The README's opening commands, comments dropped: (the main job's, the tests')."""
    block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    main_job, tests = (line.split("#", 1)[0].strip() for line in block.splitlines())
    return main_job, tests


def _promised(code: str) -> list[str]:
    """What the block's ``print(...)  # text`` lines promise, in order."""
    return [line.split("# ", 1)[1] for line in code.splitlines() if line.strip().startswith("print(") and "# " in line]


def test_the_readme_has_its_python_blocks():
    assert len(BLOCKS) == len(re.findall(r"^```python$", README, flags=re.M)) >= 5


@pytest.mark.parametrize("heading, code", BLOCKS, ids=[f"{i}-{h}" for i, (h, _) in enumerate(BLOCKS)])
def test_block_runs_as_printed(heading, code, tmp_path, capsys):
    torchrun = re.match(r"# (\w+\.py): torchrun --nproc-per-node (\d+) \1\n", code)
    if torchrun:
        script = tmp_path / torchrun.group(1)
        script.write_text(code)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", torchrun.group(2),
             str(script)],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        printed = run.stdout.splitlines()
    else:
        namespace = {"__name__": "readme"}
        exec(compile(code, heading, "exec"), namespace)
        for name, value in namespace.items():  # a block that defines a test: run it, as pytest would
            if name.startswith("test_") and callable(value):
                value()
        printed = capsys.readouterr().out.splitlines()
    assert printed == _promised(code)


def test_ci_runs_the_readmes_test_command_as_printed():
    _, tests = _opening_commands()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == tests


def test_the_main_job_installs_what_the_tests_install():
    main_job, tests = _opening_commands()
    assert main_job.endswith("&& python examples/train_gpt.py") and tests.endswith("&& python -m pytest -q")
    assert main_job.rsplit("&&", 1)[0] == tests.rsplit("&&", 1)[0]
    assert '".[test,plot]"' in tests  # the examples need hypothesis and matplotlib
