"""The slot address table through which both kernel backends read depth K/V in place."""

import torch

from moda_flex.backends.slots import SLOT_ALIGNMENT, depth_args, slot_table
from moda_flex.depth import as_list

B, HK, T, L, D = 2, 3, 5, 4, 8


def test_a_slab_is_read_where_it_lies():
    buffer = torch.randn(B, HK, T, L + 2, D)  # a model's slot buffer, of which the first L slots are written
    slab = buffer[:, :, :, :L]
    table, key_strides, value_strides, held, aligned = slot_table(as_list(slab), as_list(slab), L, slab.device)
    step = slab.stride(3) * slab.element_size()
    assert table.tolist() == [slab.data_ptr() + l * step for l in range(L)] * 2
    assert key_strides == value_strides == (slab.stride(0), slab.stride(1), slab.stride(2), slab.stride(4))
    assert held == []
    assert aligned == all(address % SLOT_ALIGNMENT == 0 for address in table.tolist())


def test_a_slot_off_the_vector_alignment_is_flagged():
    """A slab whose slots sit 2 bytes apart from 16-byte boundaries: the kernels must not load it in vectors."""
    buffer = torch.randn(B, HK, T, L * D + 1, dtype=torch.float16)
    slab = buffer[..., 1:].view(B, HK, T, L, D)  # every slot starts one element (2 bytes) past a boundary
    assert not slot_table(as_list(slab), as_list(slab), L, slab.device).aligned
    assert not depth_args(as_list(slab), as_list(slab), L, slab.device)[0]["SLOTS_ALIGNED"]
    entries = [torch.randn(B, HK, T, D) for _ in range(L)]  # fresh allocations: aligned
    assert slot_table(entries, entries, L, torch.device("cpu")).aligned


def test_entries_are_read_where_they_lie_when_their_strides_agree():
    entries = [torch.randn(B, T, HK, D).transpose(1, 2) for _ in range(L)]  # (B, Hk, T, D) views, one layout
    table, key_strides, _, held, _ = slot_table(entries, entries, L, torch.device("cpu"))
    assert table.tolist()[:L] == [e.data_ptr() for e in entries]
    assert key_strides == entries[0].stride()
    assert all(h is e for h, e in zip(held[0], entries, strict=True))


def test_entries_of_different_layouts_are_copied_to_one_and_held():
    entries = [torch.randn(B, HK, T, D), torch.randn(B, T, HK, D).transpose(1, 2)]
    values = [torch.randn(B, HK, T, D) for _ in entries]
    table, key_strides, value_strides, held, _ = slot_table(entries, values, len(entries), torch.device("cpu"))
    copies = held[0]
    assert key_strides == copies[0].stride() == copies[1].stride() == value_strides
    assert table.tolist()[:2] == [c.data_ptr() for c in copies]  # the addresses are the held copies'
    for copy, entry in zip(copies, entries, strict=True):
        torch.testing.assert_close(copy, entry, rtol=0, atol=0)


def test_no_slots_give_a_table_of_one_placeholder():
    args, held = depth_args([], [], 0, torch.device("cpu"))
    assert args["DK_TAB"].tolist() == [0] and args["DV_TAB"].numel() == 1
    assert held == [[], []]
