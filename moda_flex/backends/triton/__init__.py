"""The fused Triton backend: group-aware MoDA forward and backward kernels.

Files by layer: ``kernels/`` (``@triton.jit``, one file per kernel) -> ``configs.py`` (which
path, block sizes) -> ``launch.py`` (grids, descriptors, slot tables, the
launches) -> ``ops.py`` (``torch.library`` ops, autograd,
:func:`triton_attention`); ``support.py`` says which calls it runs and
which scores it fuses.

Importing this package needs ``triton``; on CPU the kernels run only under
``TRITON_INTERPRET=1`` (set before triton is imported).
"""

from .ops import merged_backward, triton_attention
from .support import unsupported_reason

__all__ = ["merged_backward", "triton_attention", "unsupported_reason"]
