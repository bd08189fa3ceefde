"""Where the fused kernels run, and which built-in variants they run, by the triton backend's own check.

``TRITON_DEVICE``: a GPU where there is one, else the CPU (the interpreter).
"""

import pytest
import torch

from moda_flex.variants import BUILTINS, causal


TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_QUERY = torch.zeros(1, 1, 1, 16, device=TRITON_DEVICE)  # what the backend's check looks at: device, dtype, D


def _triton_here():
    """The triton backend's package where it runs here (CUDA, or the interpreter on CPU), else None."""
    try:
        from moda_flex.backends import triton
    except ImportError:
        return None
    return triton if triton.unsupported_reason(_QUERY, causal()) is None else None


TRITON = _triton_here()
needs_triton = pytest.mark.skipif(TRITON is None, reason="the triton backend cannot run here")
# Tests written for the interpreter: CPU tensors and float32 tolerances (a GPU runs float32 dots as TF32).
needs_interpreter = pytest.mark.skipif(
    TRITON is None or TRITON_DEVICE != "cpu", reason="runs the kernels under Triton's interpreter, on CPU tensors"
)
FUSED_KINDS = tuple(
    kind
    for kind, builtin in BUILTINS.items()
    if TRITON is not None and TRITON.unsupported_reason(_QUERY, builtin.example(8, 2)) is None
)
