"""The slot address table through which both kernel backends read depth K/V in place."""

import pytest
import torch

from moda_flex.backends import slots
from moda_flex.backends.slots import SLOT_ALIGNMENT, PinnedTables, depth_args, device_table, slot_table
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
    assert depth_args(as_list(slab), as_list(slab), L, slab.device)[0]["SLOTS"] == 0
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


def test_pinned_tables_are_bounded_unless_a_graph_captured_them():
    tables = PinnedTables(limit=3)
    made = []

    def maker(key):
        def make():
            made.append(key)
            return torch.tensor([key])

        return make

    for key in range(10):  # eager calls whose addresses keep changing
        tables.get(key, maker(key), capturing=False)
    assert len(tables) == 3 and list(tables.recent) == [7, 8, 9]
    kept = tables.get(8, maker(8), capturing=False)  # a hit: the same buffer, now the most recent
    assert made.count(8) == 1 and list(tables.recent) == [7, 9, 8] and tables.made == len(made) == 10
    captured = tables.get(9, maker(9), capturing=True)  # a graph captures a table made eagerly before
    for key in range(100, 110):
        tables.get(key, maker(key), capturing=False)
    assert tables.get(9, maker(9), capturing=False) is captured  # kept for the graph's replays
    assert made.count(9) == 1 and 8 not in tables.recent and kept.tolist() == [8]
    assert len(tables.recent) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_table_outlives_eager_calls_past_the_limit():
    device = torch.device("cuda")
    addresses = tuple(range(16, 16 * 9, 16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # as torch.compile's CUDA graphs capture
        table = device_table(addresses, device)
    before = len(slots._PINNED.recent)
    for start in range(slots._PINNED.limit + 10):  # eager tables of other addresses, each once
        device_table((10**9 + 16 * start,), device)
    assert len(slots._PINNED.recent) <= slots._PINNED.limit and before <= slots._PINNED.limit
    table.zero_()
    graph.replay()
    assert table.tolist() == list(addresses)
