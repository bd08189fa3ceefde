"""Variants: predicates against their definitions, composition, structures, documents and the built-in list.

The hand-written masks below restate each built-in's definition one position
at a time; the predicates must agree with them on every (query, key) and
(query, token, slot) triple, with ``Tq < Tk`` offsets and ``L = 0`` included.
"""

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moda_flex import moda_attention
from moda_flex import variants as v
from moda_flex.testing import MoDAShape, assert_matches_reference, make_inputs, moda_shapes, variants
from moda_flex.variants import BUILTINS, Documents, Structure, Variant

from budget import examples
from own_variant import user_variant

B, H = 2, 3
SIZES = [(1, 1, 0), (4, 4, 3), (3, 8, 4), (1, 7, 2), (6, 9, 1)]  # (Tq, Tk, L)
DOC_IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3, 3]])


def _doc(b, p, k):
    return DOC_IDS[b, p] == DOC_IDS[b, k]


# name: (variant factory for Tk, sequence(b, h, p, k), depth(b, h, p, d, slot, L))
DEFINITIONS = {
    "causal": (lambda Tk: v.causal(), lambda b, h, p, k: k <= p, lambda b, h, p, d, s, L: d == p),
    "full": (lambda Tk: v.full(), lambda b, h, p, k: True, lambda b, h, p, d, s, L: d == p),
    "sliding_window(1)": (
        lambda Tk: v.sliding_window(1),
        lambda b, h, p, k: k == p,
        lambda b, h, p, d, s, L: d == p,
    ),
    "sliding_window(3)": (
        lambda Tk: v.sliding_window(3),
        lambda b, h, p, k: p - 3 < k <= p,
        lambda b, h, p, d, s, L: d == p,
    ),
    "depth_window(1)": (
        lambda Tk: v.depth_window(1),
        lambda b, h, p, k: k <= p,
        lambda b, h, p, d, s, L: d == p and s == L - 1,
    ),
    "depth_window(2)": (
        lambda Tk: v.depth_window(2),
        lambda b, h, p, k: k <= p,
        lambda b, h, p, d, s, L: d == p and s >= L - 2,
    ),
    "depth_window(9)": (
        lambda Tk: v.depth_window(9),
        lambda b, h, p, k: k <= p,
        lambda b, h, p, d, s, L: d == p,
    ),
    "chunk_depth(1)": (
        lambda Tk: v.chunk_depth(1),
        lambda b, h, p, k: k <= p,
        lambda b, h, p, d, s, L: d == p,
    ),
    "chunk_depth(3)": (
        lambda Tk: v.chunk_depth(3),
        lambda b, h, p, k: k <= p,
        lambda b, h, p, d, s, L: d <= p and d // 3 == p // 3,
    ),
    "depth_only": (lambda Tk: v.depth_only(), lambda b, h, p, k: False, lambda b, h, p, d, s, L: d == p),
    "document": (
        lambda Tk: v.document(DOC_IDS[:, :Tk]),
        lambda b, h, p, k: _doc(b, p, k),
        lambda b, h, p, d, s, L: d == p,
    ),
    "document (one row for all)": (
        lambda Tk: v.document(DOC_IDS[1, :Tk]),
        lambda b, h, p, k: _doc(1, p, k),
        lambda b, h, p, d, s, L: d == p,
    ),
}


def _predicate_masks(variant: Variant, Tq: int, Tk: int, L: int):
    """Evaluate both predicates on broadcast grids: (B, H, Tq, Tk) and (B, H, Tq, Tq, L)."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q_pos = (Tk - Tq + torch.arange(Tq)).view(1, 1, Tq, 1)
    sequence = variant.sequence(b, h, q_pos, torch.arange(Tk).view(1, 1, 1, Tk)).expand(B, H, Tq, Tk)
    d_pos = (Tk - Tq + torch.arange(Tq)).view(1, 1, 1, Tq, 1)
    slot = torch.arange(L).view(1, 1, 1, 1, L)
    depth = variant.depth_predicate(L)(b.unsqueeze(-1), h.unsqueeze(-1), q_pos.unsqueeze(-1), d_pos, slot)
    return sequence, depth.expand(B, H, Tq, Tq, L)


def _definition_masks(sequence_def, depth_def, Tq: int, Tk: int, L: int):
    """The same masks, one position at a time from the written definition."""
    sequence = torch.zeros(B, H, Tq, Tk, dtype=torch.bool)
    depth = torch.zeros(B, H, Tq, Tq, L, dtype=torch.bool)
    for b, h, i in itertools.product(range(B), range(H), range(Tq)):
        p = Tk - Tq + i
        for k in range(Tk):
            sequence[b, h, i, k] = bool(sequence_def(b, h, p, k))
        for t, s in itertools.product(range(Tq), range(L)):
            depth[b, h, i, t, s] = bool(depth_def(b, h, p, Tk - Tq + t, s, L))
    return sequence, depth


@pytest.mark.parametrize("Tq, Tk, L", SIZES, ids=lambda x: str(x))
@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_builtin_predicates_match_their_definitions(name, Tq, Tk, L):
    factory, sequence_def, depth_def = DEFINITIONS[name]
    sequence, depth = _predicate_masks(factory(Tk), Tq, Tk, L)
    expected_sequence, expected_depth = _definition_masks(sequence_def, depth_def, Tq, Tk, L)
    assert sequence.dtype == torch.bool and depth.dtype == torch.bool
    assert torch.equal(sequence, expected_sequence)
    assert torch.equal(depth, expected_depth)


@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_own_depth_only_is_true_exactly_when_no_other_token_is_read(name):
    factory, _, _ = DEFINITIONS[name]
    variant = factory(9)
    _, depth = _predicate_masks(variant, 6, 9, 3)
    reads_others = bool((depth & ~torch.eye(6, dtype=torch.bool).view(1, 1, 6, 6, 1)).any())
    if variant.own_depth_only:
        assert not reads_others
    assert variant.structure is not None
    assert variant.own_depth_only == (variant.structure.depth_chunk is None)


COMPOSABLE = {
    "causal": v.causal,
    "full": v.full,
    "sliding_window(2)": lambda: v.sliding_window(2),
    "depth_window(1)": lambda: v.depth_window(1),
    "chunk_depth(2)": lambda: v.chunk_depth(2),
    "depth_only": v.depth_only,
    "document": lambda: v.document(DOC_IDS),
    "user": user_variant,
}


@pytest.mark.parametrize("left, right", list(itertools.combinations(COMPOSABLE, 2)))
def test_composition_is_elementwise(left, right):
    a, b = COMPOSABLE[left](), COMPOSABLE[right]()
    Tq, Tk, L = 5, 9, 3
    seq_a, depth_a = _predicate_masks(a, Tq, Tk, L)
    seq_b, depth_b = _predicate_masks(b, Tq, Tk, L)
    seq_and, depth_and = _predicate_masks(a & b, Tq, Tk, L)
    seq_or, depth_or = _predicate_masks(a | b, Tq, Tk, L)
    assert torch.equal(seq_and, seq_a & seq_b) and torch.equal(depth_and, depth_a & depth_b)
    assert torch.equal(seq_or, seq_a | seq_b) and torch.equal(depth_or, depth_a | depth_b)
    assert (a & b).name == f"({a.name} & {b.name})"
    assert (a | b).name == f"({a.name} | {b.name})"
    assert (a | b).structure is None and not (a | b).own_depth_only


def test_composition_structures():
    window = v.causal() & v.sliding_window(4)
    assert window.structure.causal and window.structure.window == 4 and window.own_depth_only
    documents = v.causal() & v.document(DOC_IDS)
    assert documents.structure.causal and torch.equal(documents.structure.doc_ids, DOC_IDS.int())
    chunked = v.chunk_depth(2) & (v.chunk_depth(2) | v.full())
    assert chunked.structure is None
    assert (v.causal() & user_variant()).structure is None
    assert (v.chunk_depth(2) & v.chunk_depth(3)).structure is None
    assert (v.document(DOC_IDS) & v.document(DOC_IDS)).structure is None
    nested = (v.causal() & v.depth_window(3)) & v.depth_window(1)
    assert nested.structure.depth_window == 1
    _, depth = _predicate_masks(nested, 2, 2, 3)
    assert depth[0, 0].diagonal(dim1=0, dim2=1).t().tolist() == [[False, False, True]] * 2


def _assert_structure_holds(variant: Variant, shape: MoDAShape) -> None:
    """Every promise of ``variant.structure`` is true of its predicates at ``shape``."""
    Tq, Tk, L = shape.q_len, shape.kv_len, shape.slots
    s = variant.structure
    sequence, depth = _predicate_masks(variant, Tq, Tk, L)  # (B, H, Tq, Tk), (B, H, Tq, Tq, L)
    p = (Tk - Tq + torch.arange(Tq)).view(Tq, 1)
    k = torch.arange(Tk).view(1, Tk)
    if s.causal:
        assert not sequence[..., k > p].any(), "a key after the query is visible"
    if s.window is not None:
        assert not sequence[..., k <= p - s.window].any(), "a key outside the window is visible"
    if not s.sequence:
        assert not sequence.any(), "a sequence key is visible"
    if s.doc_ids is not None:
        ids = s.doc_ids.expand(B, Tk)
        same = ids[:, p.view(Tq)].unsqueeze(-1) == ids.unsqueeze(1)  # (B, Tq, Tk)
        assert not (sequence & ~same.unsqueeze(1)).any(), "a key of another document is visible"
    d = p.view(1, Tq)
    if s.depth_chunk is None:
        assert not depth[..., p != d, :].any(), "another token's depth is visible"
    else:
        outside = (d > p) | (d // s.depth_chunk != p // s.depth_chunk)
        assert not depth[..., outside, :].any(), "depth outside the chunk is visible"
    if s.depth_window is not None and L > s.depth_window:
        assert not depth[..., : L - s.depth_window].any(), "a depth slot outside the window is visible"


@settings(max_examples=examples(150))
@given(shape=moda_shapes(max_batch=B, max_kv_len=12, max_slots=4, max_groups=1, max_kv_heads=1), data=st.data())
def test_structure_promises_hold_for_builtins_and_intersections(shape, data):
    variant = data.draw(variants(shape, max_terms=3, structured=True))
    _assert_structure_holds(variant, shape)


@pytest.mark.parametrize(
    "structure, message",
    [
        (Structure(causal=True), "after the query"),
        (Structure(window=2), "outside the window"),
        (Structure(sequence=False), "sequence key"),
        (Structure(documents=Documents.from_ids(DOC_IDS)), "another document"),
        (Structure(depth_window=1), "depth slot outside"),
    ],
)
def test_a_false_structure_is_caught(structure, message):
    shape = MoDAShape(batch=B, q_heads=1, kv_heads=1, q_len=5, kv_len=9, slots=3, head_dim=8)
    liar = Variant("liar", v.full().sequence, structure=structure)
    with pytest.raises(AssertionError, match=message):
        _assert_structure_holds(liar, shape)


def test_a_false_own_depth_promise_is_caught():
    shape = MoDAShape(batch=B, q_heads=1, kv_heads=1, q_len=2, kv_len=2, slots=1, head_dim=8)
    reads_all = Variant("liar", v.full().sequence, lambda b, h, q_pos, d_pos, slot: d_pos >= 0, structure=Structure())
    with pytest.raises(AssertionError, match="another token's depth"):
        _assert_structure_holds(reads_all, shape)


def test_structure_intersect():
    a = Structure(causal=True, window=5, depth_window=3)
    b = Structure(window=2, sequence=False, depth_window=7)
    both = a.intersect(b)
    assert (both.causal, both.window, both.sequence, both.depth_window) == (True, 2, False, 3)
    assert both.doc_ids is None and both.depth_chunk is None and both.own_depth_only
    assert Structure().intersect(Structure()).window is None
    documents = Documents.from_ids(torch.zeros(1, 4, dtype=torch.long))
    assert Structure(documents=documents).intersect(Structure(causal=True)).documents is documents
    assert Structure(causal=True).intersect(Structure(documents=documents)).documents is documents
    assert Structure(documents=documents).intersect(Structure(documents=documents)) is None
    # A chunk holds the token itself, so own-token & chunk reads the own token only.
    assert Structure(depth_chunk=2).intersect(Structure()).own_depth_only
    assert Structure(depth_chunk=2).intersect(Structure(depth_chunk=3)) is None
    chunked = Structure(depth_chunk=4).intersect(Structure(depth_chunk=4, causal=True))
    assert chunked.depth_chunk == 4 and chunked.causal and not chunked.own_depth_only


@pytest.mark.parametrize(
    "make, argument",
    [
        (lambda: v.sliding_window(0), "window"),
        (lambda: v.sliding_window(2.0), "window"),
        (lambda: v.sliding_window(True), "window"),
        (lambda: v.depth_window(-1), "slots"),
        (lambda: v.depth_window(True), "slots"),
        (lambda: v.chunk_depth(0), "chunk"),
        (lambda: v.chunk_depth(True), "chunk"),
        (lambda: v.document(torch.zeros(4)), "doc_ids"),
        (lambda: v.document(torch.zeros(1, 2, 4, dtype=torch.long)), "doc_ids"),
        (lambda: v.document([0, 0, 1]), "doc_ids"),
        (lambda: v.document(torch.tensor([True, False])), "doc_ids"),
        (lambda: v.resolve("diagonal"), "variant"),
        (lambda: Variant("x", v.causal().sequence, v.own_token, depth_for_slots=lambda L: v.own_token), "depth"),
    ],
    ids=[
        "window-0", "window-float", "window-bool", "depth-window-negative", "depth-window-bool", "chunk-0",
        "chunk-bool", "doc-ids-float", "doc-ids-3d", "doc-ids-list", "doc-ids-bool", "unknown-name",
        "depth-and-depth-for-slots",
    ],
)  # fmt: skip
def test_bad_arguments_raise(make, argument):
    with pytest.raises(ValueError, match=argument):
        make()


@pytest.mark.parametrize("other", ["full", 1, None])
def test_composing_with_a_non_variant_names_the_operand(other):
    for combine in (lambda: v.causal() & other, lambda: v.causal() | other, lambda: other & v.causal()):
        with pytest.raises(TypeError, match=re.escape(f"got {other!r} ({type(other).__name__})")):
            combine()


@pytest.mark.parametrize("backend", ["reference", "flex"])
@pytest.mark.parametrize(
    "sequence, depth, role, got",
    [
        (lambda b, h, q, k: True, None, "sequence", "bool True"),
        (lambda b, h, q, k: (k <= q).int(), None, "sequence", "torch.int32 tensor"),
        (v.causal().sequence, lambda b, h, q, d, s: (q == d).long(), "depth", "torch.int64 tensor"),
    ],
    ids=["sequence-bool", "sequence-int32", "depth-int64"],
)
def test_a_predicate_that_returns_no_bool_tensor_is_named(backend, sequence, depth, role, got):
    inputs = make_inputs(MoDAShape(1, 2, 1, 3, 4, 2, 8), requires_grad=False)
    variant = Variant("mine", sequence, depth) & v.causal()
    with pytest.raises(TypeError, match=rf"variant 'mine': its {role} predicate <lambda> .* got .*{got}"):
        moda_attention(**inputs, variant=variant, backend=backend)


def test_every_builtin_has_a_written_definition():
    assert {name.split("(")[0].split(" ")[0] for name in DEFINITIONS} == set(BUILTINS)


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_has_an_example_with_a_structure(name):
    """The catalogue's examples are the family's own, and keep the structure the block-sparse backends read."""
    example = BUILTINS[name].example(kv_len=9, slots=4)
    assert isinstance(example, Variant) and example.structure is not None
    assert name in example.name


def test_named_variants_resolve():
    assert v.resolve("causal").name == "causal" and v.resolve("full").name == "full"
    custom = user_variant()
    assert v.resolve(custom) is custom


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_name_runs_or_says_how_to_make_it(name):
    """The names the picture's command line takes: the function runs those without an argument, and for the
    others says which call makes one."""
    inputs = make_inputs(MoDAShape(1, 2, 1, 3, 5, 2, 8), requires_grad=False)
    if BUILTINS[name].argument is None:
        expected = moda_attention(**inputs, variant=BUILTINS[name].make(), backend="reference")
        torch.testing.assert_close(moda_attention(**inputs, variant=name, backend="reference"), expected)
        assert name in v.NAMED
        return
    argument = {"sliding_window": "window", "depth_window": "slots", "chunk_depth": "chunk", "document": "doc_ids"}
    with pytest.raises(ValueError, match=re.escape(f"variant {name!r} takes an argument: pass "
                                                   f"moda_flex.{name}({argument[name]})")):  # fmt: skip
        moda_attention(**inputs, variant=name)


@pytest.mark.parametrize("name", ["sliding", "Causal", None, 3])
def test_an_unknown_name_lists_what_is_accepted(name):
    with pytest.raises(ValueError) as error:
        v.resolve(name)
    assert str(error.value) == (
        f"variant must be one of 'causal', 'full', 'depth_only' or a moda_flex Variant, got {name!r}; "
        "the built-ins with an argument are made by calling moda_flex.sliding_window(window), "
        "moda_flex.depth_window(slots), moda_flex.chunk_depth(chunk), moda_flex.document(doc_ids)"
    )


# --- documents ------------------------------------------------------------------------


def _runs_by_hand(ids):
    """(start, end) of each position's run of equal ids, and whether every document is one run."""
    starts, ends, contiguous = [], [], True
    for row in ids.tolist():
        start, end = [], []
        for p in range(len(row)):
            first, stop = p, p + 1
            while first > 0 and row[first - 1] == row[p]:
                first -= 1
            while stop < len(row) and row[stop] == row[p]:
                stop += 1
            start.append(first)
            end.append(stop)
        for value in set(row):
            where = [p for p, x in enumerate(row) if x == value]
            contiguous &= where[-1] - where[0] + 1 == len(where)
        starts.append(start)
        ends.append(end)
    return torch.tensor(starts), torch.tensor(ends), contiguous


@settings(max_examples=examples(40))
@given(
    rows=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), min_size=1, max_size=3).filter(
        lambda rows: len({len(row) for row in rows}) == 1
    ),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8]),
)
def test_documents_are_dense_ranks_with_their_runs(rows, dtype):
    ids = torch.tensor(rows, dtype=dtype)
    documents = Documents.from_ids(ids)
    start, end, contiguous = _runs_by_hand(ids)
    assert documents.ids.dtype == torch.int32 and documents.start.dtype == torch.int32
    assert torch.equal(documents.start, start.int()) and torch.equal(documents.end, end.int())
    assert documents.contiguous == contiguous
    same = ids.unsqueeze(2) == ids.unsqueeze(1)  # (Bd, Tk, Tk)
    assert torch.equal(documents.ids.unsqueeze(2) == documents.ids.unsqueeze(1), same)
    assert int(documents.ids.max()) < ids.shape[1]


def test_ids_that_differ_beyond_int32_stay_distinct():
    ids = torch.tensor([0] * 3 + [2**32] * 3 + [-(2**40)] * 2)
    assert Documents.from_ids(ids).ids.tolist() == [[1] * 3 + [2] * 3 + [0] * 2]
    inputs = make_inputs(MoDAShape(1, 2, 1, 8, 8, 1, 8), requires_grad=False)
    renumbered = torch.tensor([1] * 3 + [2] * 3 + [0] * 2)
    separate = moda_attention(**inputs, variant=v.document(ids), backend="reference")
    assert torch.equal(separate, moda_attention(**inputs, variant=v.document(renumbered), backend="reference"))


def test_doc_ids_are_copied_where_the_variant_is_made():
    ids = torch.zeros(6, dtype=torch.long)
    variant = v.document(ids)
    ids[3:] = 1
    assert variant.structure.documents.contiguous and variant.structure.doc_ids.unique().tolist() == [0]


def test_a_document_that_comes_back_is_one_document():
    """The issue's case: [0]*10 + [1]*20 + [0]*10; rows of document 0 see both of its runs."""
    ids = torch.tensor([0] * 10 + [1] * 20 + [0] * 10)
    variant = v.causal() & v.document(ids)
    inputs = make_inputs(MoDAShape(1, 2, 1, 40, 40, 2, 16))
    assert_matches_reference(inputs, backend="flex", variant=variant)
    sequence, _ = _predicate_masks(variant, 40, 40, 0)
    assert sequence[0, 0, 35, :10].all() and not sequence[0, 0, 35, 10:30].any()


def test_structures_compare_by_value_and_documents_by_identity():
    assert Structure(causal=True, window=3) == (v.causal() & v.sliding_window(3)).structure
    assert hash(Structure(causal=True, window=3)) == hash(v.sliding_window(3).structure)
    assert Structure(causal=True, window=3) != Structure(causal=True, window=150)
    ids = torch.zeros(4, dtype=torch.long)
    assert v.document(ids).structure != v.document(ids).structure
    documents = v.document(ids)
    assert (documents & v.causal()).structure == (v.causal() & documents).structure
