"""The README's runnable code blocks run as printed."""

import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _blocks(heading: str) -> list[str]:
    """The ```python blocks of the section under ``heading`` (up to the next heading)."""
    section = README.split(heading + "\n", 1)[1]
    section = re.split(r"^#{2,3} ", section, maxsplit=1, flags=re.M)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize("heading", ["## In a nanoGPT model", "### Beside SDPA: depth K/V in your own model"])
def test_model_snippets_run(heading, capsys):
    [code] = _blocks(heading)
    exec(compile(code, heading, "exec"), {})
    printed = capsys.readouterr().out
    expected = [line.split("# ")[-1] for line in code.splitlines() if line.startswith("print(")]
    assert printed.splitlines() == expected


def test_variant_testing_snippet_runs():
    [code] = _blocks("### Testing your own variant")
    namespace = {}
    exec(compile(code, "Testing your own variant", "exec"), namespace)
    namespace["test_my_variant"]()
