"""The depth slots' base pointers, read from their address table (:mod:`moda_flex.backends.slots`) inside a kernel.

Both kernel backends read depth through it: the fused kernels of ``triton/`` and the split path's depth kernels.
"""

import triton
import triton.language as tl


@triton.jit
def slot_bases(DK_TAB, DV_TAB, slot, L, sdk, sdv, ELEM: tl.constexpr, SLOTS: tl.constexpr):
    """Base pointers of the depth key and value slots ``slot`` (a block of slots), by how the slots are passed.

    ``SLOTS`` 0 or 1: ``DK_TAB``, ``DV_TAB`` are the address tables, read here (a slot past ``L`` gets address
    0); 1: every slot starts at a multiple of 16 bytes (:data:`moda_flex.backends.slots.SLOT_ALIGNMENT`), which a
    pointer made from an integer cannot tell the compiler (it would load the slots element by element). 2: they
    point at one (B, Hk, Tq, L, D) slab each, slot ``l`` ``sdk[4] * l`` (``sdv[4] * l``) elements after slot 0;
    ``sdk``, ``sdv`` are the (b, h, t, d, l) strides.
    """
    if SLOTS == 2:
        at = slot.to(tl.int64)
        dk_slot, dv_slot = DK_TAB + at * sdk[4], DV_TAB + at * sdv[4]
    else:
        ok = slot < L
        dk_slot = tl.load(DK_TAB + slot, mask=ok, other=0).to(tl.pointer_type(ELEM))
        dv_slot = tl.load(DV_TAB + slot, mask=ok, other=0).to(tl.pointer_type(ELEM))
        if SLOTS == 1:
            dk_slot = tl.multiple_of(dk_slot, 16)
            dv_slot = tl.multiple_of(dv_slot, 16)
    return dk_slot, dv_slot
