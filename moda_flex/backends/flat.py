"""Flat wrappers, written from a kernel's own signature: the kernels of a traced op, as inductor launches them.

Inductor launches the kernels of a ``torch.library.triton_op`` itself
(``wrap_triton``) and takes tensors and scalars as a kernel's arguments, not
tuples. So a traced launch goes through a wrapper that takes every tuple
spread into scalars (``sq0`` .. ``sq3`` for ``sq``), rebuilds the tuples and
calls the kernel. :func:`flat_wrapper` writes that wrapper's source from the
kernel's parameters and one launch's arguments, once a kind of launch, so a
new argument of a kernel reaches its wrapper by itself:

- a tuple becomes one scalar a member; a side's depth pointers (``DK``,
  ``DV``: :func:`.launch.pointer_depth`) become ``DK0`` .. and ``DV0`` .., the
  first ``SLOT_PTRS`` of which :func:`.slot_pointers.depth_tables` writes into
  the table ``TAB`` that the kernel reads as ``DK_TAB``, ``DV_TAB``;
- a float is cast to float32 (inductor passes floats as float64, where
  Triton's own launch types them float32);
- an argument given as None that the kernel does not take as a constexpr (a
  tensor descriptor off the Hopper path) is None in the wrapper's body.
"""

from __future__ import annotations

import functools
import inspect
import linecache
from typing import Any

import triton.language as tl

from .slot_pointers import depth_tables

# Options of a launch, not arguments of its kernel.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")
# The kernel parameters that a side's depth pointers (tuples ``DK``, ``DV``) reach as one table.
_TABLES = ("DK_TAB", "DV_TAB")


def _kind(value: Any):
    """What a wrapper's source needs of an argument: a tuple's length, ``float``, None, or ``"value"``."""
    if isinstance(value, tuple):
        return len(value)
    if isinstance(value, float):
        return "float"
    return None if value is None else "value"


def launch_kinds(arguments: dict) -> tuple:
    """The kinds of a launch's arguments (:func:`_kind`), the key of its wrapper: sorted (name, kind) pairs."""
    return tuple(sorted((name, _kind(value)) for name, value in arguments.items() if name not in LAUNCH_OPTIONS))


def flat_arguments(arguments: dict) -> dict:
    """A launch's arguments as its flat wrapper takes them: every tuple as one argument a member, and an
    argument given as None left out (the wrapper passes None itself: :func:`flat_wrapper`)."""
    flat = {}
    for name, value in arguments.items():
        if isinstance(value, tuple):
            flat.update((f"{name}{i}", member) for i, member in enumerate(value))
        elif value is not None:
            flat[name] = value
    return flat


@functools.cache
def flat_wrapper(kernel, kinds: tuple):
    """The ``@triton.jit`` wrapper of ``kernel`` for launches of ``kinds`` (:func:`launch_kinds`).

    Raises:
        TypeError: for an argument the kernel does not take, or a parameter without a value or default.
    """
    given = dict(kinds)
    parameters, body, call = [], [], []
    for param in inspect.signature(kernel.fn).parameters.values():
        name = param.name
        if name in _TABLES:
            if name == "DK_TAB":  # both sides' pointers, written into one table
                keys, values = _spread("DK", given.pop("DK")), _spread("DV", given.pop("DV"))
                given.pop("TAB"), given.pop("SLOT_PTRS")
                parameters += ["TAB", *keys, *values, "SLOT_PTRS: tl.constexpr"]
                body.append(f"DK_TAB, DV_TAB = depth_tables(TAB, ({', '.join(keys)},)[:SLOT_PTRS], "
                            f"({', '.join(values)},)[:SLOT_PTRS], SLOTS=SLOTS)")  # fmt: skip
            call.append(f"{name}={name}")
            continue
        if name not in given:
            if param.default is not inspect.Parameter.empty:
                continue
            raise TypeError(f"a launch of {kernel.__name__} gives no {name!r}")
        kind = given.pop(name)
        if _is_constexpr(param):
            parameters.append(f"{name}: tl.constexpr")
            call.append(f"{name}={name}")
        elif kind is None:
            call.append(f"{name}=None")
        elif isinstance(kind, int):
            parameters += _spread(name, kind)
            call.append(f"{name}=({', '.join(_spread(name, kind))},)")
        else:
            parameters.append(name)
            if kind == "float":
                body.append(f"{name} = tl.cast({name}, tl.float32)")
            call.append(f"{name}={name}")
    if given:
        raise TypeError(f"{kernel.__name__} takes no argument {sorted(given)}")
    return _compiled(f"{kernel.__name__}_flat", kernel, parameters, body, call)


def _is_constexpr(param: inspect.Parameter) -> bool:
    """Whether a kernel parameter is annotated ``tl.constexpr`` (as an object, or as text under postponed
    annotations)."""
    return param.annotation is tl.constexpr or param.annotation in ("tl.constexpr", "constexpr")


def _spread(name: str, count: int) -> list[str]:
    return [f"{name}{i}" for i in range(count)]


def _compiled(name: str, kernel, parameters: list[str], body: list[str], call: list[str]):
    """A ``@triton.jit`` function ``name`` from its parts; its source is kept where ``inspect`` (Triton's JIT,
    inductor's code generation) finds it."""
    lines = [f"def {name}(", *(f"    {p}," for p in parameters), "):",
             *(f"    {line}" for line in body), f"    {kernel.__name__}(", *(f"        {c}," for c in call), "    )"]
    source = "\n".join(lines) + "\n"
    filename = f"<moda_flex flat wrapper {name} {abs(hash(source)):x}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": __name__, "tl": tl, "depth_tables": depth_tables, kernel.__name__: kernel}
    exec(compile(source, filename, "exec"), namespace)
    return type(kernel)(namespace[name])  # jitted as its kernel is: compiled, or run by Triton's interpreter

