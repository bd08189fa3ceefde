"""Depth slots read where they lie: the address table the kernels of both kernel backends read them through.

Depth K/V reach a launch as the ops' list (:func:`moda_flex.depth.as_list`):
either one (B, Hk, Tq, L, D) tensor, or L per-slot (B, Hk, Tq, D) tensors
(the entries earlier layers wrote). A kernel reads slot ``l`` at address
``DK_TAB[l]`` (values ``DV_TAB[l]``) plus the shared (b, h, t, d) strides,
so neither form is copied; or, given a slab as it lies (:func:`slab_args`),
``l`` slot strides past its start.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import Tensor

from ..depth import is_slab


# A table whose every slot address is a multiple of this many bytes lets the kernels load slots in 16-byte vectors.
SLOT_ALIGNMENT = 16


class SlotTable(NamedTuple):
    """The depth slots' addresses and strides, as the kernels read them."""

    table: Tensor  # (2L,) int64 on the device: the L key slots' addresses, then the L value slots'
    key_strides: tuple  # (b, h, t, d), in elements
    value_strides: tuple
    held: list  # the tensors the addresses point into: hold them until the kernel is launched
    aligned: bool  # every address a multiple of SLOT_ALIGNMENT bytes


def slot_table(depth_k: list[Tensor], depth_v: list[Tensor], L: int, device: torch.device) -> SlotTable:
    """The address table of the L key slots and the L value slots, and each side's strides.

    Entries of one side that disagree on strides are copied to contiguous
    ones first; the table then points into the copies, which ``held`` holds.
    """
    addresses, strides, held = [], [], []
    for depth in (depth_k, depth_v):
        if is_slab(depth):
            t = depth[0]  # (B, Hk, Tq, L, D): slot l sits l slot-strides after slot 0
            step = t.stride(3) * t.element_size()
            addresses += range(t.data_ptr(), t.data_ptr() + L * step, step) if step else [t.data_ptr()] * L
            strides.append((t.stride(0), t.stride(1), t.stride(2), t.stride(4)))
            continue
        if not shared_strides(depth):
            depth = [t.contiguous() for t in depth]
        addresses += [t.data_ptr() for t in depth]
        strides.append(depth[0].stride() if depth else (0, 0, 0, 0))
        held.append(depth)
    aligned = functools.reduce(operator.or_, addresses, 0) % SLOT_ALIGNMENT == 0
    return SlotTable(device_table(tuple(addresses or [0]), device), strides[0], strides[1], held, aligned)


def shared_strides(entries: list[Tensor]) -> bool:
    """Whether a side's entries all have one stride tuple, which a kernel reads every slot of the side at."""
    return all(e.stride() == entries[0].stride() for e in entries)


class PinnedTables:
    """Pinned host copies of slot tables, by device and addresses, from which a table is copied without a wait.

    A CUDA graph captures a table's copy from its host buffer and replays it: a table made while the current
    stream is capturing is kept for good (the graph's memory keeps its addresses, so a model meets few). Any
    other table is kept for reuse, at most ``limit`` of them, the least recently used dropped first: eager calls
    whose addresses keep changing (lengths that vary from batch to batch) would otherwise pin host memory
    without end. A dropped buffer still being copied from stays allocated until its copy ends (PyTorch's pinned
    allocator records the copy's stream).
    """

    def __init__(self, limit: int = 1024):
        self.limit = limit
        self.captured: dict = {}
        self.recent: OrderedDict = OrderedDict()
        self.made = 0  # buffers made so far: a model whose calls find theirs makes none a step

    def get(self, key, make, capturing: bool) -> Tensor:
        """The buffer of ``key``, made by ``make()`` if it has none."""
        host = self.captured.get(key)
        if host is not None:
            return host
        host = self.recent.pop(key, None)
        if host is None:
            host = make()
            self.made += 1
        if capturing:
            self.captured[key] = host
        else:
            self.recent[key] = host
            if len(self.recent) > self.limit:
                self.recent.popitem(last=False)
        return host

    def __len__(self) -> int:
        return len(self.captured) + len(self.recent)


_PINNED = PinnedTables()


def device_table(addresses: tuple, device: torch.device) -> Tensor:
    """(len(addresses),) int64 on ``device``, copied without a wait from a pinned buffer (:class:`PinnedTables`)."""
    if device.type != "cuda":
        return torch.tensor(addresses, dtype=torch.int64)
    host = _PINNED.get((device, addresses), lambda: torch.tensor(addresses, dtype=torch.int64).pin_memory(),
                       torch.cuda.is_current_stream_capturing())  # fmt: skip
    return host.to(device, non_blocking=True)


def depth_args(depth_k: list[Tensor], depth_v: list[Tensor], L: int, device: torch.device) -> tuple[dict, list]:
    """The kernels' depth arguments through an address table (:func:`..slot_pointers.slot_bases`), and the
    tensors to hold until the launch: ``DK_TAB``, ``DV_TAB`` (the key and value slots' addresses), ``sdk``,
    ``sdv`` (their (b, h, t, d, l) strides, l unused: 0) and ``SLOTS`` (1 where :attr:`SlotTable.aligned`,
    else 0)."""
    slots = slot_table(depth_k, depth_v, L, device)
    table = slots.table
    return dict(DK_TAB=table, DV_TAB=table[L:], sdk=(*slots.key_strides, 0), sdv=(*slots.value_strides, 0),
                SLOTS=int(slots.aligned)), slots.held  # fmt: skip


def slab_args(depth_k: Tensor, depth_v: Tensor) -> dict:
    """The kernels' depth arguments for two (B, Hk, Tq, L, D) slabs read as they lie, slot by slot stride
    (``SLOTS`` 2): ``DK_TAB``, ``DV_TAB`` the slabs, ``sdk``, ``sdv`` their (b, h, t, d, l) strides."""
    return dict(DK_TAB=depth_k, DV_TAB=depth_v, sdk=_kernel_strides(depth_k), sdv=_kernel_strides(depth_v), SLOTS=2)


def _kernel_strides(slab: Tensor) -> tuple:
    sb, sh, st, sl, sd = slab.stride()
    return sb, sh, st, sd, sl
