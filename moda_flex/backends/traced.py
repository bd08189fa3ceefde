"""What the kernel backends' traced ops share: launches that ``torch.compile`` traces, and how depth reaches them.

An eager op is opaque to inductor: each call runs the dispatcher, our
launcher's Python and a slot table's copy, about 0.2 ms of host time per
forward or backward on an H100 machine, which a compiled step at a model's
lengths waits for. A ``torch.library.triton_op`` is not: inductor reads its
body, whose kernels are launched through ``wrap_triton``, and launches them
from its own generated code (:func:`.records.define_traced`).

Inductor takes scalars and tensors as a kernel's arguments, not tuples: each
kernel a traced op launches has a flat wrapper that takes the strides one
by one (:func:`flat_arguments`, :func:`launch_flat`).

A traced kernel cannot be handed addresses read on the host, and a table of
addresses made on the device would not keep the entries alive: inductor
frees a buffer after the last kernel that takes it. So the entries are the
kernel's own arguments, in one of two ways:

- the kernels of both backends take each entry as a pointer argument of its
  own, up to :data:`.slot_pointers.SLOT_ARGS` a side (:func:`pointer_depth`,
  ``SLOTS`` 3), and write their addresses into a table each program reads:
  the entries are read where they lie, no copy;
- depth beyond that (more entries, or entries a kernel cannot load 16 bytes
  at a time) comes as one (B, Hk, Tq, L, D) slab a side, read by slot stride
  (``SLOTS`` 2): a slab input as it lies, entries stacked into one inside
  the op's body (:func:`slab_depth`, one launch of :mod:`.stack_kernel` for
  both sides' first 32 entries). The copy costs ``L`` entries of memory
  traffic a call. The stack lives only while the op's kernels read it: the
  op keeps the entries for its backward, whose body stacks them again (a
  model's layers would otherwise hold a stack each, memory that grows as
  the square of the depth).

Neither holds a host address, which makes the ops safe to capture in CUDA graphs.

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
from .blocks import cdiv, next_pow2
from .slot_pointers import SLOT_ARGS
from .slots import SLOT_ALIGNMENT, shared_strides, slab_args
from .stack_kernel import GROUP, stack_kernel

# The launch options a wrapper's launch passes on as they are.
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")
# The fewest pointer arguments a side a launch of :func:`pointer_depth` fills.
_LEAST_CLASS = 4
# Elements of an entry one program of the stack kernel copies.
_STACK_ELEMENTS = 4096


def traceable(q: Tensor, *tensors: Tensor) -> bool:
    """Whether a call may take the traced ops: CUDA tensors whose sizes and strides are plain ints (a dynamic
    shape's symbols cannot pick a launch configuration)."""
    return q.is_cuda and all(isinstance(n, int) for t in (q, *tensors) for n in (*t.shape, *t.stride()))


def flat_arguments(wrapper, arguments: dict) -> dict:
    """A launch's arguments for a flat ``wrapper``: every tuple as one scalar per element (``sq`` -> ``sq0``,
    ``sq1``, ...); an argument the wrapper fixes itself (a descriptor) must be None."""
    names = set(wrapper.arg_names)
    flat = {}
    for name, value in arguments.items():
        if isinstance(value, tuple):
            flat.update((f"{name}{i}", x) for i, x in enumerate(value))
        elif name in names or name in _LAUNCH_OPTIONS:
            flat[name] = value
        elif value is not None:
            raise TypeError(f"{wrapper.__name__} has no argument {name!r} (given {value!r})")
    return flat


def launch_flat(wrapper, grid: tuple, wrap=wrap_triton, **arguments) -> None:
    """Launch a flat ``wrapper`` with a kernel's ``arguments`` through ``wrap`` (``wrap_triton``: inductor
    traces it; the identity: Triton launches it)."""
    wrap(wrapper)[grid](**flat_arguments(wrapper, arguments))


def stack_sides(depth_k: list[Tensor], depth_v: list[Tensor], wrap=wrap_triton) -> tuple[Tensor, Tensor]:
    """Two contiguous (B, Hk, T, L, D) slabs of L (B, Hk, T, D) key and value entries, ``GROUP`` entries a side
    a launch of :func:`.stack_kernel.stack_kernel` through ``wrap``.

    Inductor lowers ``torch.stack`` of many entries to a copy kernel each, whose launches a compiled step pays
    on the host (about 2,000 a Table 6 step with FFN entries). Entries whose strides differ within a side, or
    keys and values of different shapes, are stacked by ``torch.stack``.
    """
    key, value = depth_k[0], depth_v[0]
    if key.shape != value.shape or not (shared_strides(depth_k) and shared_strides(depth_v)):
        return torch.stack(depth_k, dim=3), torch.stack(depth_v, dim=3)
    B, Hk, T, D = key.shape
    L = len(depth_k)
    out_k, out_v = key.new_empty((B, Hk, T, L, D)), value.new_empty((B, Hk, T, L, D))
    rows, width = B * Hk * T, next_pow2(D)
    block_rows = max(1, _STACK_ELEMENTS // width)
    for first in range(0, L if out_k.numel() else 0, GROUP):
        keys, values = depth_k[first : first + GROUP], depth_v[first : first + GROUP]
        pointers = {}
        for name, group in (("K", keys), ("V", values)):  # the unused repeat the last
            pointers.update((f"{name}{i}", group[min(i, len(group) - 1)]) for i in range(GROUP))
        wrap(stack_kernel)[(cdiv(rows, block_rows), 2 * len(keys))](
            OUT_K=out_k, OUT_V=out_v, **pointers, rows=rows, Hk=Hk, T=T, L=L, first=first, count=len(keys),
            **{f"sk{i}": n for i, n in enumerate(key.stride())}, **{f"sv{i}": n for i, n in enumerate(value.stride())},
            D=D, DP=width, BLOCK_R=block_rows,
        )  # fmt: skip
    return out_k, out_v


def slab_depth(depth_k: list[Tensor], depth_v: list[Tensor], L: int, device: torch.device) -> tuple[dict, list]:
    """The depth arguments of a traced launch: each side one slab read as it lies, entries stacked into one
    first (:func:`stack_sides`).

    Without entries, an address table of one null slot that no load reads (``SLOTS`` 0): a kernel then types
    its depth pointers by the queries' dtype, as an eager call's table does, where an empty slab's dtype
    would not be the call's.
    """
    if not depth_k and not depth_v:
        table = torch.zeros(1, dtype=torch.int64, device=device)
        return dict(DK_TAB=table, DV_TAB=table, sdk=(0,) * 5, sdv=(0,) * 5, SLOTS=0), []
    if is_slab(depth_k) and is_slab(depth_v):
        return slab_args(depth_k[0], depth_v[0]), []
    return slab_args(*stack_sides(depth_k, depth_v)), []


def pointer_depth(depth_k: list[Tensor], depth_v: list[Tensor], L: int, device: torch.device) -> tuple[dict, list]:
    """The depth arguments of a traced launch whose kernel takes each slot as a pointer argument of its own
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
                    sdk=(*depth_k[0].stride(), 0), sdv=(*depth_v[0].stride(), 0), SLOTS=3), []  # fmt: skip
    arguments, held = slab_depth(depth_k, depth_v, L, device)
    return one_pointer_a_side(arguments), held


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
