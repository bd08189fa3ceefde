"""The depth slots' base pointers, read from their address table (:mod:`moda_flex.backends.slots`) inside a kernel.

Both kernel backends read depth through it: the fused kernels of ``triton/`` and the split path's depth kernels.
"""

import triton
import triton.language as tl

# The most depth slots a side that a traced launch passes as pointer arguments of their own (``SLOTS`` 3): a flat
# wrapper that takes them has the arguments ``DK0`` .. ``DK63`` and ``DV0`` .. ``DV63``, and the constexpr
# ``SLOT_PTRS``: how many of them a launch fills.
SLOT_ARGS = 64


@triton.jit
def slot_bases(DK_TAB, DV_TAB, slot, L, sdk, sdv, ELEM: tl.constexpr, SLOTS: tl.constexpr):
    """Base pointers of the depth key and value slots ``slot`` (a block of slots), by how the slots are passed.

    ``SLOTS`` 0 or 1: ``DK_TAB``, ``DV_TAB`` are the address tables, read here (a slot past ``L`` gets address
    0); 1: every slot starts at a multiple of 16 bytes (:data:`moda_flex.backends.slots.SLOT_ALIGNMENT`), which a
    pointer made from an integer cannot tell the compiler (it would load the slots element by element). 2: they
    point at one (B, Hk, Tq, L, D) slab each, slot ``l`` ``sdk[4] * l`` (``sdv[4] * l``) elements after slot 0;
    ``sdk``, ``sdv`` are the (b, h, t, d, l) strides. 3: they are tuples of at least L pointers (at most
    :data:`SLOT_ARGS`), slot ``l`` at ``DK_TAB[l]`` (``DV_TAB[l]``), each starting at a multiple of 16 bytes.
    """
    if SLOTS == 2:
        at = slot.to(tl.int64)
        dk_slot, dv_slot = DK_TAB + at * sdk[4], DV_TAB + at * sdv[4]
    elif SLOTS == 3:
        dk_slot = tl.multiple_of(_pick(DK_TAB, slot, L).to(tl.pointer_type(ELEM)), 16)
        dv_slot = tl.multiple_of(_pick(DV_TAB, slot, L).to(tl.pointer_type(ELEM)), 16)
    else:
        ok = slot < L
        dk_slot = tl.load(DK_TAB + slot, mask=ok, other=0).to(tl.pointer_type(ELEM))
        dv_slot = tl.load(DV_TAB + slot, mask=ok, other=0).to(tl.pointer_type(ELEM))
        if SLOTS == 1:
            dk_slot = tl.multiple_of(dk_slot, 16)
            dv_slot = tl.multiple_of(dv_slot, 16)
    return dk_slot, dv_slot


@triton.jit
def _pick(pointers, slot, L):
    """The address of ``pointers[l]`` for each slot ``l`` of ``slot``; 0 for a slot past ``L``."""
    address = slot.to(tl.int64) * 0
    for i in tl.static_range(len(pointers)):
        if i < L:
            address = tl.where(slot == i, pointers[i].to(tl.int64), address)
    return address

