"""The depth slots' base pointers, read from their address table (:mod:`moda_flex.backends.slots`) inside a kernel.

Both kernel backends read depth through it: the fused kernels of ``triton/`` and the split path's depth kernels.
"""

import triton
import triton.language as tl


@triton.jit
def slot_bases(DK_TAB, DV_TAB, slot, L, ELEM: tl.constexpr, ALIGNED: tl.constexpr):
    """Base pointers of the depth key and value slots ``slot`` (BLOCK_C,), read from the address tables.

    ``ALIGNED``: every slot starts at a multiple of 16 bytes (:data:`moda_flex.backends.slots.SLOT_ALIGNMENT`).
    A pointer made from an integer tells the compiler nothing of its alignment: without this it loads the slots
    element by element.
    """
    ok = slot < L
    dk_slot = tl.load(DK_TAB + slot, mask=ok, other=0).to(tl.pointer_type(ELEM))
    dv_slot = tl.load(DV_TAB + slot, mask=ok, other=0).to(tl.pointer_type(ELEM))
    if ALIGNED:
        dk_slot = tl.multiple_of(dk_slot, 16)
        dv_slot = tl.multiple_of(dv_slot, 16)
    return dk_slot, dv_slot
