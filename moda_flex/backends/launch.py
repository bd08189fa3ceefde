"""The one launcher of both kernel backends, and the one way depth reaches a kernel, eager and traced alike.

A kernel is launched through its flat wrapper (:mod:`.flat`, :func:`launch_flat`), either by Triton (an
eager call, or a call a CUDA graph captures: :func:`by_triton`) or by inductor's generated code
(``wrap_triton``, the body of a traced op: :func:`.records.define_traced`), which spares a compiled step
the dispatcher's and our Python's host time.

A kernel is never handed an address read on the host (a CUDA graph would replay it, and inductor frees a
buffer after the last kernel that takes it), so the depth entries are the kernel's own arguments
(:func:`pointer_depth`):

- each entry a pointer argument of its own, up to :data:`.slot_pointers.SLOT_ARGS` a side (``SLOTS`` 3),
  whose addresses the wrapper writes into a table each program reads: the entries are read where they lie,
  no copy;
- else one (B, Hk, Tq, L, D) slab a side, read by slot stride (``SLOTS`` 2): a slab input as it lies, more
  entries (or entries a kernel cannot load 16 bytes at a time) stacked into one first (:func:`slab_depth`),
  a copy of ``L`` entries a call that lives only while the call's kernels read it.

A tensor a traced kernel writes is passed as itself, with the strides of the
view the kernel addresses, never as a view: inductor copies a written view
to a buffer of its own before the launch and back after it, two kernels
(:func:`.split.sequence.lse_argument`, the lse of the vendor's layout).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import wrap_triton

from ..depth import is_slab
from .blocks import next_pow2
from .flat import flat_arguments, flat_wrapper, launch_kinds
from .slot_pointers import SLOT_ARGS

# A slot whose address is a multiple of this many bytes can be loaded in 16-byte vectors.
SLOT_ALIGNMENT = 16
# The fewest pointer arguments a side a launch of :func:`pointer_depth` fills.
_LEAST_CLASS = 4


def traceable(q: Tensor, *tensors: Tensor) -> bool:
    """Whether a call may take the traced ops: CUDA tensors whose sizes and strides are plain ints (a dynamic
    shape's symbols cannot pick a launch configuration)."""
    return q.is_cuda and all(isinstance(n, int) for t in (q, *tensors) for n in (*t.shape, *t.stride()))


def by_triton(kernel):
    """The launch of ``kernel`` as Triton makes it: the ``wrap`` of an eager call (``wrap_triton`` traces)."""
    return kernel


def launch_flat(kernel, grid: tuple, wrap=wrap_triton, **arguments) -> None:
    """Launch ``kernel`` with ``arguments`` through its flat wrapper (:mod:`.flat`) and ``wrap``
    (``wrap_triton``: inductor traces it; the identity: Triton launches it)."""
    wrapper = flat_wrapper(kernel, launch_kinds(arguments))
    wrap(wrapper)[grid](**flat_arguments(arguments))


def slab_depth(depth_k: list[Tensor], depth_v: list[Tensor], L: int, device: torch.device) -> dict:
    """The depth arguments of a launch: each side one slab read as it lies, entries stacked into one first (a
    copy: only depth that :func:`pointer_depth` cannot pass as it lies comes here).

    Without entries, an address table of one null slot that no load reads (``SLOTS`` 0): a kernel then types
    its depth pointers by the queries' dtype, where an empty slab's dtype would not be the call's.
    """
    if not depth_k and not depth_v:
        table = torch.zeros(1, dtype=torch.int64, device=device)
        return dict(DK_TAB=table, DV_TAB=table, sdk=(0,) * 5, sdv=(0,) * 5, SLOTS=0)
    if is_slab(depth_k) and is_slab(depth_v):
        return slab_args(depth_k[0], depth_v[0])
    return slab_args(torch.stack(depth_k, dim=3), torch.stack(depth_v, dim=3))


def pointer_depth(depth_k: list[Tensor], depth_v: list[Tensor], L: int, device: torch.device) -> dict:
    """The depth arguments of a launch whose kernel takes each slot as a pointer argument of its own
    (``SLOTS`` 3, :data:`.slot_pointers.SLOT_ARGS` a side): ``DK``, ``DV``, tuples the wrapper takes as
    ``DK0`` .. ``DK63`` and ``DV0`` .. ``DV63``, the first ``SLOT_PTRS`` of them filled, and ``TAB``, the
    (2 * SLOT_PTRS,) int64 table the kernel writes their addresses into
    (:func:`.slot_pointers.write_slot_table`).

    Entries are read where they lie, no copy, where each side has at most ``SLOT_ARGS`` of them that share
    their strides and start at multiples of 16 bytes. The arguments past L, up to the next power of two (at
    least 4), repeat the last entry, and the rest are None: a launch pays host time for each pointer it
    passes (Triton's launcher checks each), and Triton compiles the kernel once per pattern of Nones, so once
    per size class rather than once per L. Any other depth reaches the kernel as :func:`slab_depth` gives
    it, the slab or table passed once.
    """
    if L and L <= SLOT_ARGS and not is_slab(depth_k) and all(_pointable(d) for d in (depth_k, depth_v)):
        size = max(_LEAST_CLASS, next_pow2(L))
        table = torch.empty(2 * size, dtype=torch.int64, device=device)
        return dict(DK=_padded(depth_k, size), DV=_padded(depth_v, size), SLOT_PTRS=size, TAB=table,
                    sdk=(*depth_k[0].stride(), 0), sdv=(*depth_v[0].stride(), 0), SLOTS=3)  # fmt: skip
    return one_pointer_a_side(slab_depth(depth_k, depth_v, L, device))


def one_pointer_a_side(arguments: dict) -> dict:
    """Depth arguments that give each side one table or slab (``DK_TAB``, ``DV_TAB``), as a kernel that takes
    pointer arguments takes them: the first pointer of each side (``SLOT_PTRS`` 1; ``TAB`` unwritten)."""
    arguments = dict(arguments)
    dk, dv = arguments.pop("DK_TAB"), arguments.pop("DV_TAB")
    return dict(arguments, DK=_padded([dk], 1), DV=_padded([dv], 1), SLOT_PTRS=1, TAB=dk)


def _padded(pointers: list, size: int) -> tuple:
    """``pointers``, their last repeated up to ``size``, then None up to :data:`.slot_pointers.SLOT_ARGS`."""
    return (*pointers, *pointers[-1:] * (size - len(pointers)), *(None,) * (SLOT_ARGS - size))


def _pointable(entries: list[Tensor]) -> bool:
    """Whether a side's entries can be passed as pointers a kernel loads 16 bytes at a time: one stride tuple,
    each starting a multiple of 16 bytes into its storage (whose start inductor and PyTorch's allocators
    align)."""
    return shared_strides(entries) and all(_aligned(e.storage_offset(), e.element_size()) for e in entries)


def _aligned(offset, element_size: int) -> bool:
    return isinstance(offset, int) and offset * element_size % SLOT_ALIGNMENT == 0


def shared_strides(entries: list[Tensor]) -> bool:
    """Whether a side's entries all have one stride tuple, which a kernel reads every slot of the side at."""
    return all(e.stride() == entries[0].stride() for e in entries)


def slab_args(depth_k: Tensor, depth_v: Tensor) -> dict:
    """The kernels' depth arguments for two (B, Hk, Tq, L, D) slabs read as they lie, slot by slot stride
    (``SLOTS`` 2): ``DK_TAB``, ``DV_TAB`` the slabs, ``sdk``, ``sdv`` their (b, h, t, d, l) strides."""
    return dict(DK_TAB=depth_k, DV_TAB=depth_v, sdk=_kernel_strides(depth_k), sdv=_kernel_strides(depth_v), SLOTS=2)


def _kernel_strides(slab: Tensor) -> tuple:
    sb, sh, st, sl, sd = slab.stride()
    return sb, sh, st, sd, sl
