"""Call records: a kernel op's arguments as typed ``NamedTuple`` fields, the one place each argument is named.

A kernel backend describes its op's arguments as records (the tensors, the
options) and derives from them the ``torch.library`` schema
(:func:`schema`, :func:`define`, or traced ops: :func:`define_traced`,
:func:`define_traced_pair`), the op's unpacking of its flat arguments
(:func:`unpack`) and what autograd saves (:func:`saved` /
:func:`restored`). Adding an argument is adding a field.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, NamedTuple, NewType, Optional, get_type_hints

import torch
from torch import Tensor

# A tensor field the op writes in place (schema ``Tensor(a!)``, each with its own alias letter).
Written = NewType("Written", Tensor)

# A field's annotation -> its type in an op schema.
_SCHEMA_TYPES = {Tensor: "Tensor", Optional[Tensor]: "Tensor?", list[Tensor]: "Tensor[]",
                 float: "float", bool: "bool", int: "int", str: "str"}  # fmt: skip


# The tensors every MoDA kernel call takes, as (name, type) fields of a record: q (B, Hq, Tq, D), k and v
# (B, Hk, Tk, D), and depth K/V as the lists of :func:`moda_flex.depth.as_list`.
ATTENTION = [("q", Tensor), ("k", Tensor), ("v", Tensor), ("depth_k", list[Tensor]), ("depth_v", list[Tensor])]


@functools.cache  # resolving the annotations costs about 20 us, and restored runs in every backward
def _fields(record: type[NamedTuple]) -> dict:
    return get_type_hints(record)


def schema(*records: type[NamedTuple]) -> str:
    """The schema's arguments from the records' fields, in order: ``"Tensor q, ..., float scale, ..."``."""
    fields = [(name, kind) for record in records for name, kind in _fields(record).items()]
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    return ", ".join(f"Tensor({next(letters)}!) {name}" if kind is Written else f"{_SCHEMA_TYPES[kind]} {name}"
                     for name, kind in fields)  # fmt: skip


def define(op: str, *records: type[NamedTuple], returns: int, run: Callable, fake: Callable) -> None:
    """Define ``moda_flex::<op>``, whose arguments are the records' fields and which returns ``returns`` tensors,
    implemented on CUDA and CPU by ``run`` and for tracing by ``fake``; each is called with one instance of
    each record (:func:`unpack`)."""
    name = f"moda_flex::{op}"
    torch.library.define(name, f"({schema(*records)}) -> ({', '.join(['Tensor'] * returns)})")
    torch.library.impl(name, ("cuda", "cpu"))(lambda *args: run(*unpack(args, *records)))
    torch.library.register_fake(name)(lambda *args: fake(*unpack(args, *records)))


def define_traced(op: str, *records: type[NamedTuple], returns: int, body: Callable):
    """A ``torch.library.triton_op`` ``moda_flex::<op>`` whose arguments are the records' fields and which
    returns ``returns`` tensors; ``body`` is called with one instance of each record, and inductor traces it
    (:mod:`.traced`). The op's schema is inferred from the signature given here."""
    fields = [(name, kind) for record in records for name, kind in _fields(record).items()]
    signature = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=kind) for name, kind in fields],
        return_annotation=tuple[(Tensor,) * returns],
    )  # fmt: skip

    def run(*args, **kwargs):
        return body(*unpack(signature.bind(*args, **kwargs).args, *records))

    run.__name__, run.__signature__ = op, signature
    return torch.library.triton_op(f"moda_flex::{op}", run, mutates_args=())


def define_traced_pair(name: str, inputs: type[NamedTuple], grads: type[NamedTuple], options: type[NamedTuple], *,
                       forward: Callable, backward: Callable, returns: int, autograd_backward: Callable,
                       setup_context: Callable):  # fmt: skip
    """The traced ops ``moda_flex::<name>_forward`` (out and lse, by ``forward(inputs, options)``) and
    ``<name>_backward`` (``returns`` tensors, by ``backward(grads, inputs, options)``) (:func:`define_traced`).

    The forward's autograd is an eager op's: ``autograd_backward(ctx, grad_out, grad_lse, run_backward=...)``
    with ``setup_context``, given the traced backward op to run.
    """
    forward_op = define_traced(f"{name}_forward", inputs, options, returns=2, body=forward)
    backward_op = define_traced(f"{name}_backward", grads, inputs, options, returns=returns, body=backward)

    def run_backward(grads_record, inputs_record, options_record):
        return backward_op(*grads_record, *inputs_record, *options_record)

    forward_op.register_autograd(functools.partial(autograd_backward, run_backward=run_backward),
                                 setup_context=setup_context)  # fmt: skip
    return forward_op, backward_op


def unpack(args: tuple, *records: type[NamedTuple]) -> tuple:
    """The op's flat positional ``args`` as one instance of each record, consecutive fields in order."""
    out, at = [], 0
    for record in records:
        n = len(record._fields)
        out.append(record(*args[at : at + n]))
        at += n
    if at != len(args):
        raise TypeError(f"{len(args)} arguments for records of {at} fields")
    return tuple(out)


def saved(record: NamedTuple) -> tuple[list, tuple]:
    """A record of tensors (a field may be None or a list) as a flat list for ``save_for_backward``, and the
    list fields' lengths, for :func:`restored`."""
    flat, lengths = [], []
    for value in record:
        if isinstance(value, (list, tuple)):
            flat.extend(value)
            lengths.append(len(value))
        else:
            flat.append(value)
    return flat, tuple(lengths)


def restored(record: type[NamedTuple], flat, lengths: tuple) -> NamedTuple:
    """The record that :func:`saved` flattened into ``flat``."""
    values, at, lists = [], 0, iter(lengths)
    for kind in _fields(record).values():
        if kind == list[Tensor]:
            n = next(lists)
            values.append(list(flat[at : at + n]))
            at += n
        else:
            values.append(flat[at])
            at += 1
    if at != len(flat):
        raise TypeError(f"{len(flat)} saved tensors for a record of {at}")
    return record(*values)

