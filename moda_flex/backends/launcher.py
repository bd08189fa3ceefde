"""Triton launches through the compiled binary's own launcher, once Triton has chosen the binary for a call's kind.

``kernel[grid](**arguments)`` binds and specializes every argument, computes
a cache key, looks the binary up and launches it: on an H100's host about
57 us a launch, against 9 us through the binary's own launcher with the
arguments bound (BENCHMARKS.md, ``benchmarks/launch_split.py``). A MoDA
call launches three to five kernels, and a model compiled in the default mode
is bound by its host, so this is step time.

:func:`launch` keys a binary by what Triton specializes on, or finer: a
tensor's dtype and whether its address is a multiple of 16 bytes, a tensor
descriptor's fields, every other argument (ints, floats, flags, constexprs,
tuples of them) by value. The first launch of a key goes through Triton,
which compiles if it must and returns the binary; every later one calls
that binary's launcher with the arguments in the kernel's order, on the
current device's current stream (a CUDA graph's capture stream included).
Calls on other devices than CUDA (Triton's interpreter), kernels that are
not plain ``@triton.jit`` functions (a test's stand-in) and arguments of
other kinds go through ``kernel[grid]`` every time.

:func:`launch_fixed` is the same for a launch whose grid and most arguments
a :class:`Fixed` holds, made once for a call's layout: only the other
arguments are keyed and bound per call.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

_BY_TRITON = object()  # an argument of a kind keyed here by nothing: let Triton launch
_SCALARS = frozenset({bool, int, float, str, type(None)})


def _key(values) -> tuple:
    """The kinds of ``values`` (:func:`_kind`) and their types (True == 1 == 1.0, which Triton types apart)."""
    return tuple(map(type, values)), tuple([v if type(v) in _SCALARS else _kind(v) for v in values])


def _kind(value):
    """What of a non-scalar ``value`` the binary depends on (or more), hashable; :data:`_BY_TRITON` for a kind
    not keyed, or holding one."""
    if isinstance(value, Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if type(value) in (tuple, list):
        types = tuple(map(type, value))
        if _SCALARS.issuperset(types):  # strides
            return types, tuple(value)
        nested = _key(value)
    elif dataclasses.is_dataclass(value):  # a tensor descriptor: its base, shape, strides, block shape, padding
        nested = _key([getattr(value, field.name) for field in dataclasses.fields(value)])
    else:
        return _BY_TRITON
    return _BY_TRITON if _BY_TRITON in nested[1] else nested


def _current_device_and_stream() -> tuple[int, int]:
    """The device and raw stream Triton's own launch would use."""
    from triton.runtime.driver import driver

    device = driver.active.get_current_device()
    return device, driver.active.get_current_stream(device)


class _Binaries:
    """One kernel's argument names and defaults, and the binaries of its launches without fixed arguments."""

    def __init__(self, kernel):
        self.names = list(kernel.arg_names)
        self.defaults = {p.name: p.default for p in kernel.params if p.has_default}
        self.unfixed = Fixed(None, {})  # what launch() keys its binaries in: nothing fixed, the grid per call


_BINARIES: dict = {}  # a kernel -> its _Binaries
_MOST_KINDS = 256  # binaries kept a Fixed: sizes are keyed by value, and a model's calls have few


def _binaries(kernel):
    """The kernel's :class:`_Binaries`, or None for a kernel that is not a plain ``@triton.jit`` function."""
    found = _BINARIES.get(kernel)
    if found is None:
        from triton.runtime.jit import JITFunction

        if not isinstance(kernel, JITFunction):
            return None
        found = _BINARIES[kernel] = _Binaries(kernel)
    return found


class Fixed:
    """A launch's grid and the arguments that stay the same from call to call of one layout (sizes, flags,
    block sizes, constexprs), and the binaries Triton chose for them, by kernel and the kinds of the rest.

    Made once a layout (cache it by what its arguments are computed from) and never changed after.
    """

    def __init__(self, grid: tuple, arguments: dict):
        self.grid, self.arguments = grid, arguments
        self.binaries: dict = {}
        self.templates: dict = {}  # a kernel -> (its argument values, the fixed in place; the others' places)

    def values(self, binaries: _Binaries, kernel, arguments: dict) -> list:
        """Every argument of ``kernel`` in its order: the fixed ones, ``arguments``, the kernel's defaults."""
        template = self.templates.get(kernel)
        if template is None:
            names = binaries.names
            template = self.templates[kernel] = (
                [self.arguments.get(name) for name in names],
                [(i, name) for i, name in enumerate(names) if name not in self.arguments],
            )
        values, holes = template
        values = values.copy()
        for i, name in holes:
            values[i] = arguments[name] if name in arguments else binaries.defaults[name]
        return values


def launch(kernel, grid: tuple, device: torch.device, **arguments) -> None:
    """``kernel[grid](**arguments)`` for a call on ``device``, through the binary's own launcher after its first
    launch (module docstring)."""
    _launch(kernel, grid, device, None, arguments)


def launch_fixed(kernel, fixed: Fixed, device: torch.device, **arguments) -> None:
    """``kernel[fixed.grid](**fixed.arguments, **arguments)`` for a call on ``device``, through the binary's own
    launcher after the first launch of the kinds of ``arguments`` (module docstring)."""
    _launch(kernel, fixed.grid, device, fixed, arguments)


def _launch(kernel, grid: tuple, device: torch.device, fixed, arguments: dict) -> None:
    """Launch ``kernel`` on ``grid`` with ``fixed``'s arguments (none for None) and ``arguments``, which alone
    are keyed."""
    binaries = _binaries(kernel) if device.type == "cuda" else None
    if binaries is None:
        kernel[grid](**(fixed.arguments if fixed is not None else {}), **arguments)
        return
    fixed = binaries.unfixed if fixed is None else fixed
    gpu, stream = _current_device_and_stream()
    key = (kernel, gpu, *_key(arguments.values()))
    binary = fixed.binaries.get(key)
    if binary is None:
        binary = kernel[grid](**fixed.arguments, **arguments)
        if binary is not None and _BY_TRITON not in key[3]:
            if len(fixed.binaries) >= _MOST_KINDS:  # calls whose sizes keep changing: start afresh
                fixed.binaries.clear()
            fixed.binaries[key] = binary
        return
    run_binary(binary, grid, stream, fixed.values(binaries, kernel, arguments))


def run_binary(binary, grid: tuple, stream: int, values: list) -> None:
    """Launch a compiled binary on ``stream`` with every argument of its kernel, in order, as Triton's own launch
    does."""
    from triton import knobs

    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    metadata = binary.launch_metadata(grid3, stream, *values)
    binary.run(*grid3, stream, binary.function, binary.packed_metadata, metadata,
               knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)  # fmt: skip
