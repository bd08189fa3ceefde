"""The package's public names."""

import subprocess
import sys
from pathlib import Path

import moda_flex
from moda_flex.variants import BUILTINS


def test_star_import_keeps_torch_nn():
    code = """
from torch import nn
from moda_flex import *
import moda_flex.nn
print(nn.__name__, moda_flex.nn.__name__)
"""
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert result.stdout.split() == ["torch.nn", "moda_flex.nn"]


def test_every_builtin_is_a_public_name():
    for name, builtin in BUILTINS.items():
        assert name in moda_flex.__all__ and getattr(moda_flex, name) is builtin.make
