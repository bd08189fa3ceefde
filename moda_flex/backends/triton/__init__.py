"""The fused Triton backend: group-aware MoDA forward and backward kernels.

Importing this package needs ``triton``; on CPU the kernels run only under
``TRITON_INTERPRET=1`` (set before triton is imported).
"""

from .function import triton_attention, unsupported_reason

__all__ = ["triton_attention", "unsupported_reason"]
