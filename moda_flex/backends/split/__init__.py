"""The split path: MoDA's sequence part on the vendor's attention kernel, its depth part on ours.

Files by layer: ``kernels.py`` (``@triton.jit``; ``flat.py``, the same with
scalar strides, for compiled graphs) -> ``sequence.py`` (the vendor's aten
ops) -> ``ops.py`` (launchers, ``torch.library`` ops, autograd,
:func:`split_attention`) -> ``support.py`` (which calls it computes exactly).
"""

from .ops import split_attention, split_backward
from .support import unsupported_reason

__all__ = ["split_attention", "split_backward", "unsupported_reason"]
