"""The depth slots' base pointers inside a kernel: the one decoder of how depth is passed (:mod:`.launch`).

Both kernel backends read depth through it: the fused kernels of ``triton/`` and the split path's depth kernels.
"""

import triton
import triton.language as tl

# The most depth slots a side that a traced launch passes as pointer arguments of their own (``SLOTS`` 3): a flat
# wrapper that takes them has the arguments ``DK0`` .. ``DK63`` and ``DV0`` .. ``DV63``, the constexpr
# ``SLOT_PTRS`` (how many of them a launch fills) and ``TAB``, the table it writes them into.
SLOT_ARGS = 64


@triton.jit
def slot_bases(DK_TAB, DV_TAB, slot, L, sdk, sdv, ELEM: tl.constexpr, SLOTS: tl.constexpr):
    """Base pointers of the depth key and value slots ``slot`` (a block of slots), by how the slots are passed
    (:func:`moda_flex.backends.launch.pointer_depth`).

    ``SLOTS`` 3: ``DK_TAB``, ``DV_TAB`` are the address table a flat wrapper wrote from its pointer arguments
    (:func:`write_slot_table`), read here (a slot past ``L`` gets address 0); every slot starts at a multiple
    of 16 bytes, which a pointer made from an integer cannot tell the compiler (it would load the slots element
    by element). 2: they point at one (B, Hk, Tq, L, D) slab each, slot ``l`` ``sdk[4] * l`` (``sdv[4] * l``)
    elements after slot 0; ``sdk``, ``sdv`` are the (b, h, t, d, l) strides. 0: no slot (a null table).
    """
    if SLOTS == 2:
        at = slot.to(tl.int64)
        dk_slot, dv_slot = DK_TAB + at * sdk[4], DV_TAB + at * sdv[4]
    else:
        ok = slot < L
        dk_slot = tl.load(DK_TAB + slot, mask=ok, other=0).to(tl.pointer_type(ELEM))
        dv_slot = tl.load(DV_TAB + slot, mask=ok, other=0).to(tl.pointer_type(ELEM))
        if SLOTS == 3:
            dk_slot = tl.multiple_of(dk_slot, 16)
            dv_slot = tl.multiple_of(dv_slot, 16)
    return dk_slot, dv_slot


@triton.jit
def write_slot_table(TAB, pointers):
    """Write the addresses of ``pointers`` (a tuple, its length a power of two) to ``TAB`` and return it: every
    program writes the same table, and reads it back after a barrier, once a launch rather than picking each
    slot's pointer out of the tuple at every step of its loop."""
    i = tl.arange(0, len(pointers))
    address = i.to(tl.int64) * 0
    for j in tl.static_range(len(pointers)):
        address = tl.where(i == j, pointers[j].to(tl.int64), address)
    tl.store(TAB + i, address)
    return TAB


@triton.jit
def depth_tables(TAB, keys, values, SLOTS: tl.constexpr):
    """A flat wrapper's depth arguments for its kernel: with ``SLOTS`` 3, ``keys`` and ``values`` are a launch's
    pointer arguments (its size class, :data:`SLOT_ARGS` at most), written into one table ``TAB`` that every
    program reads after a barrier, keys first (:func:`write_slot_table`); else each holds the side's one table
    or slab."""
    if SLOTS == 3:
        dk = write_slot_table(TAB, keys)
        dv = write_slot_table(TAB + len(keys), values)
        tl.debug_barrier()
    else:
        dk, dv = keys[0], values[0]
    return dk, dv
