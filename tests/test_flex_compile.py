"""The compiled flex call: lengths share a graph, kinds get their own functions and limits, the limit raises.

On CPU through ``aot_eager``, which traces the call as inductor would and
runs the CPU's FlexAttention (inference only there: no gradients). Every
length spans two blocks or more where a graph is meant to be dynamic:
dynamo specializes a size of 1.
"""

import pytest
import torch
from torch._dynamo.utils import counters  # dynamo's own tally of compiled graphs

import moda_flex
from moda_flex.backends.flex import DESIGNS, flex_moda
from moda_flex.backends.reference import reference_attention
from moda_flex.testing import MoDAShape, make_inputs, relative_error


def _run(q_len: int, kv_len: int, *, design: str, head_dim: int = 16, dtype=torch.float32, seed: int = 0):
    """One compiled call (B=1, Hq=4, Hk=2, L=3), checked against the reference."""
    inputs = make_inputs(MoDAShape(1, 4, 2, q_len, kv_len, 3, head_dim), dtype=dtype, requires_grad=False, seed=seed)
    args = list(inputs.values()) + [moda_flex.causal(), 0.25]
    out = flex_moda(*args, compiled="aot_eager", design=design)[0]
    assert relative_error(out, reference_attention(*args)[0]) < 1e-4, (q_len, kv_len)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("design", DESIGNS)
def test_new_lengths_and_decode_steps_compile_nothing_new(design):
    """A static graph, a dynamic one for every other prefill length, one for one-token steps: then nothing."""
    torch._dynamo.reset()
    before = _graphs()
    # The second length changes every block count, so its graph is dynamic in all.
    for step, (q_len, kv_len) in enumerate([(130, 260), (260, 520), (140, 300), (155, 290)]):
        _run(q_len, kv_len, design=design, seed=step)
    assert _graphs() - before == 2
    # Decode: one query over a growing cache, across a block boundary (the sequence
    # part's padding to whole blocks shrinks to 1 and 0, sizes dynamo would specialize).
    for kv_len in range(381, 387):
        _run(1, kv_len, design=design, seed=kv_len)
    assert _graphs() - before == 3


def test_every_kind_has_its_own_limit_and_the_limit_raises():
    """Kinds (here D) never share dynamo's recompile limit; a kind past it raises instead of running eagerly."""
    torch._dynamo.reset()
    # config.patch, not monkeypatch: undoing a monkeypatch deletes the setting from dynamo's config module
    with torch._dynamo.config.patch(recompile_limit=2):
        for head_dim in (8, 16, 24):  # three kinds, two graphs each: six under a limit of two
            for q_len, kv_len in [(130, 260), (260, 520)]:
                _run(q_len, kv_len, design="concat", head_dim=head_dim)
        with pytest.raises(RuntimeError, match=r"backend 'flex' has compiled 2 graphs .* D=8.*backend='auto'"):
            _run(1, 300, design="concat", head_dim=8)  # a third graph, for one-token steps
