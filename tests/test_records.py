"""Call records: the kernel ops' schemas, unpacking and saved tensors come from one set of typed fields."""

from typing import NamedTuple, Optional

import pytest
import torch
from torch import Tensor

from moda_flex.backends import records


class _Tensors(NamedTuple):
    a: Tensor
    entries: list[Tensor]
    maybe: Optional[Tensor]


class _Options(NamedTuple):
    scale: float
    flag: bool
    count: int


def test_schema_names_each_field_with_its_schema_type():
    expected = "Tensor a, Tensor[] entries, Tensor? maybe, float scale, bool flag, int count"
    assert records.schema(_Tensors, _Options) == expected


def test_unpack_splits_flat_arguments_into_the_records():
    a, e0, e1 = torch.ones(1), torch.zeros(2), torch.zeros(3)
    tensors, options = records.unpack((a, [e0, e1], None, 0.5, True, 3), _Tensors, _Options)
    assert tensors == _Tensors(a, [e0, e1], None) and options == _Options(0.5, True, 3)
    with pytest.raises(TypeError, match="7 arguments for records of 6 fields"):
        records.unpack((a, [e0], None, 0.5, True, 3, 4), _Tensors, _Options)


@pytest.mark.parametrize("n_entries", [0, 1, 3])
def test_saved_tensors_restore_the_record(n_entries):
    entries = [torch.full((2,), float(i)) for i in range(n_entries)]
    record = _Tensors(torch.ones(1), entries, None)
    flat, lengths = records.saved(record)
    assert len(flat) == n_entries + 2
    restored = records.restored(_Tensors, flat, lengths)
    assert restored.a is record.a and restored.maybe is None
    assert all(x is y for x, y in zip(restored.entries, entries, strict=True))
    with pytest.raises(TypeError, match="saved tensors for a record of"):
        records.restored(_Tensors, [*flat, torch.ones(1)], lengths)


@pytest.mark.parametrize("backend", ["triton", "split"])
def test_registered_ops_take_the_records_fields(backend):
    pytest.importorskip("triton")
    if backend == "triton":
        from moda_flex.backends.triton.launch import Grads, Inputs, Options
    else:
        from moda_flex.backends.split.ops import Grads, Inputs, Options
    forward = getattr(torch.ops.moda_flex, f"{backend}_forward").default._schema
    backward = getattr(torch.ops.moda_flex, f"{backend}_backward").default._schema
    assert [arg.name for arg in forward.arguments] == [*Inputs._fields, *Options._fields]
    assert [arg.name for arg in backward.arguments] == [*Grads._fields, *Inputs._fields, *Options._fields]
