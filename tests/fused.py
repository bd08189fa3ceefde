"""Where the fused kernels run, and which built-in variants they run, by the triton backend's own check."""

import pytest
import torch

from moda_flex.variants import BUILTINS, causal


def _triton_here():
    """The triton backend's package where it runs here (CUDA, or the interpreter on CPU), else None."""
    try:
        from moda_flex.backends import triton
    except ImportError:
        return None
    return triton if triton.unsupported_reason(torch.zeros(1, 1, 1, 16), causal()) is None else None


TRITON = _triton_here()
needs_triton = pytest.mark.skipif(TRITON is None, reason="the triton backend cannot run here")
FUSED_KINDS = tuple(
    kind
    for kind, builtin in BUILTINS.items()
    if TRITON is not None and TRITON.unsupported_reason(torch.zeros(1, 1, 1, 16), builtin.example(8, 2)) is None
)
