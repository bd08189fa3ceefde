"""Property-test a backend, or a variant of your own, against the dense reference.

Six pieces, meant to be combined with `hypothesis`_::

    from hypothesis import given, settings, strategies as st
    from moda_flex.testing import assert_matches_reference, make_inputs, moda_shapes, variants

    @settings(max_examples=25, deadline=None)
    @given(shape=moda_shapes(max_kv_len=40, max_slots=6), data=st.data())
    def test_flex(shape, data):
        variant = data.draw(variants(shape))
        assert_matches_reference(make_inputs(shape), backend="flex", variant=variant)

- :class:`MoDAShape` names one problem size; ``str(shape)`` is a test id
  like ``B1-Hq8-Hk2-Tq5-Tk63-L4-D16``.
- :func:`moda_shapes` draws sizes with odd lengths, ``Tq <= Tk`` (prefill,
  chunked prefill, one-token decode) and ``0 <= L``.
- :func:`make_inputs` builds seeded random inputs, optionally with depth
  tensors that are a strided slice of a larger slot buffer.
- :func:`assert_matches_reference` runs a backend and the float64 reference
  on the same inputs and compares the output, the lse and the gradients of
  all five inputs (and of the tensors a score function reads that require
  grad: learned biases), with a relative tolerance scaled by dtype
  (:func:`tolerance`).
- :func:`variants` draws built-in variants (and ``&`` compositions) that are
  valid for a shape.
- :func:`score_functions` draws built-in score functions (and ``&``
  compositions) with valid parameters: ``variant & score``.

.. _hypothesis: https://hypothesis.readthedocs.io
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

try:
    from hypothesis import strategies as st
except ImportError as error:
    raise ImportError("moda_flex.testing needs hypothesis: pip install hypothesis (or moda_flex[test])") from error

from .attention import moda_attention
from . import scores
from .scores import Score
from .variants import BUILTINS, Variant, causal, document, resolve

__all__ = [
    "MoDAShape",
    "moda_shapes",
    "make_inputs",
    "tolerance",
    "assert_matches_reference",
    "variants",
    "score_functions",
    "document_ids",
    "relative_error",
    "BUILTIN_KINDS",
    "SCORE_KINDS",
]

INPUT_NAMES = ("q", "k", "v", "depth_k", "depth_v")

# The built-in variant families that :func:`variants` can draw: all of them.
BUILTIN_KINDS = tuple(BUILTINS)

# The built-in score functions that :func:`score_functions` can draw: all of them.
SCORE_KINDS = tuple(scores.BUILTINS)

# Relative RMS error ||actual - reference|| / ||reference|| allowed per dtype,
# against a float64 reference computed from the very same (upcast) inputs.
_TOLERANCES = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}


@dataclasses.dataclass(frozen=True)
class MoDAShape:
    """One MoDA problem size.

    Attributes:
        batch: B.
        q_heads: Hq, a multiple of ``kv_heads``.
        kv_heads: Hk.
        q_len: Tq, at most ``kv_len``.
        kv_len: Tk.
        slots: L, depth slots per query token (0 allowed).
        head_dim: D.
    """

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    slots: int
    head_dim: int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            least = 0 if field.name in ("q_len", "slots") else 1
            if not isinstance(value, int) or value < least:
                raise ValueError(f"MoDAShape.{field.name} must be an int >= {least}, got {value!r}")
        if self.q_heads % self.kv_heads != 0:
            raise ValueError(
                f"MoDAShape.q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        if self.q_len > self.kv_len:
            raise ValueError(f"MoDAShape.q_len ({self.q_len}) must be at most kv_len ({self.kv_len})")

    @property
    def groups(self) -> int:
        """G = Hq // Hk, the query heads that share one KV head."""
        return self.q_heads // self.kv_heads

    def __str__(self) -> str:
        return (
            f"B{self.batch}-Hq{self.q_heads}-Hk{self.kv_heads}-Tq{self.q_len}-Tk{self.kv_len}"
            f"-L{self.slots}-D{self.head_dim}"
        )


def moda_shapes(
    *,
    max_batch: int = 2,
    max_groups: int = 8,
    max_kv_heads: int = 3,
    max_kv_len: int = 70,
    max_slots: int = 9,
    head_dims: Sequence[int] = (8, 16, 24, 32, 64),
) -> st.SearchStrategy[MoDAShape]:
    """A hypothesis strategy of :class:`MoDAShape`.

    Lengths are any integers in range (odd ones and ones that are not block
    multiples included). ``Tq`` is ``1`` (decode), ``Tk`` (prefill) or
    anything in between (chunked prefill); ``L`` runs over ``0..max_slots``.
    Shrinks towards ``B=1, G=1, Hk=1, Tq=1, Tk=1, L=0`` and the first head dim.
    """
    for name, value, least in (
        ("max_batch", max_batch, 1),
        ("max_groups", max_groups, 1),
        ("max_kv_heads", max_kv_heads, 1),
        ("max_kv_len", max_kv_len, 1),
        ("max_slots", max_slots, 0),
    ):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    head_dims = tuple(head_dims)
    if not head_dims or any(not isinstance(d, int) or d < 1 for d in head_dims):
        raise ValueError(f"head_dims must be a non-empty sequence of positive ints, got {head_dims!r}")

    @st.composite
    def shapes(draw) -> MoDAShape:
        kv_len = draw(st.integers(1, max_kv_len))
        q_len = draw(
            st.one_of(st.integers(1, kv_len), st.just(1), st.just(kv_len)),
        )
        kv_heads = draw(st.integers(1, max_kv_heads))
        groups = draw(st.integers(1, max_groups))
        return MoDAShape(
            batch=draw(st.integers(1, max_batch)),
            q_heads=kv_heads * groups,
            kv_heads=kv_heads,
            q_len=q_len,
            kv_len=kv_len,
            slots=draw(st.integers(0, max_slots)),
            head_dim=draw(st.sampled_from(head_dims)),
        )

    return shapes()


def make_inputs(
    shape: MoDAShape,
    *,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    strided_depth: bool = False,
    depth_entries: bool = False,
    seed: int = 0,
    requires_grad: bool = True,
) -> dict:
    """Seeded standard-normal inputs for one call.

    The values are drawn in float32 on the CPU, then cast and moved, so a seed
    gives the same numbers (up to rounding) on every device and dtype.

    Args:
        shape: the problem size.
        dtype: floating dtype of all five tensors.
        device: where they live.
        strided_depth: make ``depth_k`` / ``depth_v`` the slice
            ``buf[:, :, :, 1:1 + L]`` of a (B, Hk, Tq, L + 2, D) slot buffer,
            as a model with a preallocated depth cache passes them: not
            contiguous, token stride ``(L + 2) * D``.
        depth_entries: give depth as lists of L entries (B, Hk, Tq, D), the
            form a model's depth stream passes (with ``strided_depth``, each
            entry a transposed view, as a projection yields).
        seed: seed of the values.
        requires_grad: make every tensor a leaf that requires grad.

    Returns:
        ``{"q": (B, Hq, Tq, D), "k": (B, Hk, Tk, D), "v": (B, Hk, Tk, D),
        "depth_k": (B, Hk, Tq, L, D), "depth_v": (B, Hk, Tq, L, D)}``, or
        depth as lists of L (B, Hk, Tq, D) leaves with ``depth_entries``.
    """
    if not isinstance(shape, MoDAShape):
        raise ValueError(f"shape must be a MoDAShape, got {type(shape).__name__}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    B, Hq, Hk, Tq, Tk, L, D = (
        shape.batch,
        shape.q_heads,
        shape.kv_heads,
        shape.q_len,
        shape.kv_len,
        shape.slots,
        shape.head_dim,
    )
    generator = torch.Generator().manual_seed(seed)

    def normal(*size: int) -> Tensor:
        return torch.randn(*size, generator=generator).to(device=device, dtype=dtype)

    def depth():
        if depth_entries:
            if strided_depth:  # (B, Tq, Hk, D) memory seen as (B, Hk, Tq, D)
                return [normal(B, Tq, Hk, D).transpose(1, 2) for _ in range(L)]
            return [normal(B, Hk, Tq, D) for _ in range(L)]
        if not strided_depth:
            return normal(B, Hk, Tq, L, D)
        buf = normal(B, Hk, Tq, L + 2, D)  # (B, Hk, Tq, Lmax, D) slot buffer
        return buf[:, :, :, 1 : 1 + L]  # (B, Hk, Tq, L, D), a view

    inputs = {
        "q": normal(B, Hq, Tq, D),
        "k": normal(B, Hk, Tk, D),
        "v": normal(B, Hk, Tk, D),
        "depth_k": depth(),
        "depth_v": depth(),
    }
    for t in _leaves(inputs).values():
        t.requires_grad_(requires_grad)
    return inputs


def _leaves(inputs: dict) -> dict:
    """Every tensor of ``inputs`` by name; depth entries as ``depth_k[0]``, ``depth_k[1]``, ..."""
    leaves = {}
    for name in INPUT_NAMES:
        value = inputs.get(name)
        if isinstance(value, (list, tuple)):
            leaves.update({f"{name}[{i}]": t for i, t in enumerate(value)})
        elif value is not None:
            leaves[name] = value
    return leaves


def _rebuild(inputs: dict, leaves: dict) -> dict:
    """``inputs`` with every tensor replaced by the leaf of the same name."""
    rebuilt = {}
    for name in INPUT_NAMES:
        value = inputs.get(name)
        if isinstance(value, (list, tuple)):
            rebuilt[name] = [leaves[f"{name}[{i}]"] for i in range(len(value))]
        elif value is not None:
            rebuilt[name] = leaves[name]
    return rebuilt


def tolerance(dtype: torch.dtype, device: Union[str, torch.device, None] = None) -> float:
    """The relative RMS error ``||actual - reference|| / ||reference||`` allowed for ``dtype``.

    float64 1e-7, float32 1e-4, float16 5e-3, bfloat16 3e-2: a backend
    computing in ``dtype`` against the float64 reference on the same inputs.
    float32 on a CUDA ``device`` gets float16's: there the kernels' matrix
    products run as TF32, with float16's 10 mantissa bits.
    """
    if dtype not in _TOLERANCES:
        raise ValueError(f"dtype must be one of {sorted(map(str, _TOLERANCES))}, got {dtype!r}")
    if dtype == torch.float32 and device is not None and torch.device(device).type == "cuda":
        return _TOLERANCES[torch.float16]
    return _TOLERANCES[dtype]


def assert_matches_reference(
    inputs: dict,
    *,
    backend: Union[str, Callable] = "flex",
    variant: Union[str, Variant] = "causal",
    scale: Optional[float] = None,
    rtol: Optional[float] = None,
    check_grads: bool = True,
) -> None:
    """Check that a backend computes MoDA: output, lse and all five gradients.

    The backend runs on ``inputs`` as given (their dtype, device and strides);
    the reference runs in float64 on upcast copies on the same device. Both
    outputs are pulled back with the same random upstream gradient. The
    inputs' own ``.grad`` is left untouched.

    Checks, each failing with an ``AssertionError`` that names the tensor,
    the error, the tolerance and the shape:

    - no NaN anywhere, output and lse shapes and dtypes as the contract says;
    - rows that see no key (reference ``lse = -inf``) give exactly zero output
      and ``lse = -inf``, and no other row has ``lse = -inf``;
    - output, the finite lse and (with ``check_grads``) the gradients of
      ``q, k, v, depth_k, depth_v`` and of every tensor the variant's score
      reads that requires grad (a learned bias) have relative RMS error
      ``||actual - reference|| / ||reference||`` at most ``rtol``
      (:func:`tolerance` of the inputs' dtype by default); against an all-zero
      reference the absolute RMS norm is used.

    Args:
        inputs: ``{"q", "k", "v", "depth_k", "depth_v"}`` as from
            :func:`make_inputs`; q (B, Hq, Tq, D), k and v (B, Hk, Tk, D),
            depth (B, Hk, Tq, L, D), a list of L (B, Hk, Tq, D) entries, or None.
        backend: a name ``moda_attention`` accepts, or a callable with the
            backend signature ``(q, k, v, depth_k, depth_v, variant, scale)
            -> (out, lse)``.
        variant: ``"causal"``, ``"full"`` or a :class:`~moda_flex.Variant`.
        scale: logit scale, default ``1 / sqrt(D)``.
        rtol: relative RMS tolerance, default ``tolerance(q.dtype, q.device)``.
        check_grads: also compare the gradients.
    """
    missing = [name for name in ("q", "k", "v") if name not in inputs]
    if missing:
        raise ValueError(f"inputs must hold q, k, v (and depth_k, depth_v), missing {missing}; got {sorted(inputs)}")
    variant = resolve(variant)
    q = inputs["q"]
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"inputs['q'] must be a (B, Hq, Tq, D) tensor, got {getattr(q, 'shape', type(q))}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if rtol is None:
        rtol = tolerance(q.dtype, q.device)
    leaves = _leaves(inputs)
    names = list(leaves)
    run = backend if callable(backend) else _named_backend(backend)
    label = backend.__name__ if callable(backend) and hasattr(backend, "__name__") else repr(backend)
    where = f"backend {label}, variant {variant.name!r}, {_describe(inputs)}, dtype {q.dtype}"

    # Detached leaves keep the caller's strides and leave the caller's .grad alone.
    actual_in = {name: leaves[name].detach().requires_grad_(check_grads) for name in names}
    reference_in = {
        name: leaves[name].detach().to(torch.float64).requires_grad_(check_grads) for name in names
    }
    variant, reference_variant, param_names = _score_leaves(variant, actual_in, reference_in, check_grads)
    out, lse = _call(run, _rebuild(inputs, actual_in), variant, scale)
    ref_out, ref_lse = _call(_named_backend("reference"), _rebuild(inputs, reference_in), reference_variant, scale)

    _check_form("out", out, ref_out.shape, q.dtype, where)
    _check_form("lse", lse, ref_lse.shape, torch.float32, where)
    _check_empty_rows(lse, ref_lse, where)
    empty_rows = torch.isinf(ref_lse)  # (B, Hq, Tq)
    if bool(empty_rows.any()) and bool((out.detach()[empty_rows] != 0).any()):
        worst = out.detach()[empty_rows].abs().max().item()
        raise AssertionError(
            f"out: rows that see no key must be exactly zero, found |out| up to {worst:.3e} "
            f"in {int(empty_rows.sum())} empty rows ({where})"
        )
    _check_close("out", out, ref_out, rtol, where)
    finite = ~empty_rows
    _check_close("lse", lse.detach()[finite], ref_lse.detach()[finite], rtol, where)
    if not check_grads:
        return

    generator = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, generator=generator).to(device=out.device, dtype=out.dtype)
    grads = _grads(out, grad_out, actual_in, names + param_names)
    ref_grads = _grads(ref_out, grad_out.to(torch.float64), reference_in, names + param_names)
    for name in names + param_names:
        expected = actual_in[name]
        _check_form(f"grad of {name}", grads[name], expected.shape, expected.dtype, where)
        _check_close(f"grad of {name}", grads[name], ref_grads[name], rtol, where)


def _score_leaves(variant: Variant, actual_in: dict, reference_in: dict, check_grads: bool):
    """The variant for the backend and for the reference, each reading its own copies of the score's tensors.

    The copies that require grad join ``actual_in`` / ``reference_in`` under
    names like ``depth_bias.params[0]``; returns those names too. The
    reference reads float64 copies of every float tensor.
    """
    score = variant.score
    if score is None:
        return variant, variant, []
    actual, reference, names = [], [], []
    for i, p in enumerate(score.params):
        learned = check_grads and p.requires_grad
        mine = p.detach().requires_grad_(learned)
        theirs = p.detach().to(torch.float64) if p.is_floating_point() else p.detach()
        theirs.requires_grad_(learned)
        actual.append(mine)
        reference.append(theirs)
        if learned:
            name = f"{score.name}.params[{i}]"
            actual_in[name], reference_in[name] = mine, theirs
            names.append(name)
    return variant.with_score(score.with_params(actual)), variant.with_score(score.with_params(reference)), names


def _named_backend(name: str) -> Callable:
    if not isinstance(name, str):
        raise ValueError(f"backend must be a backend name or a callable, got {name!r}")

    def run(q, k, v, depth_k, depth_v, variant, scale):
        return moda_attention(q, k, v, depth_k, depth_v, variant=variant, scale=scale, backend=name, return_lse=True)

    return run


def _call(run: Callable, tensors: dict, variant: Variant, scale: float):
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    depth_k, depth_v = tensors.get("depth_k"), tensors.get("depth_v")
    if depth_k is None:
        B, Hk, Tq, D = q.shape[0], k.shape[1], q.shape[2], q.shape[3]
        depth_k = depth_v = q.new_empty(B, Hk, Tq, 0, D)
    result = run(q, k, v, depth_k, depth_v, variant, scale)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise AssertionError(f"the backend must return (out, lse), got {type(result).__name__}")
    return result


def _grads(out: Tensor, grad_out: Tensor, tensors: dict, names: list) -> dict:
    """Gradients of ``sum(out * grad_out)``; an input the graph never reached gets zeros."""
    leaves = [tensors[name] for name in names]
    if out.requires_grad:
        found = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    else:
        found = [None] * len(leaves)
    return {
        name: torch.zeros_like(leaf) if grad is None else grad
        for name, leaf, grad in zip(names, leaves, found)
    }


def _describe(inputs: dict) -> str:
    q, k = inputs["q"], inputs["k"]
    depth = inputs.get("depth_k")
    entries = isinstance(depth, (list, tuple))
    slots = len(depth) if entries else 0 if depth is None else depth.shape[3]
    form = f", depth as {slots} entries" if entries else ""
    try:
        shape = MoDAShape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], slots, q.shape[3])
    except ValueError:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, L {slots}{form}"
    return f"shape {shape}{form}"


def _check_form(name: str, t, shape, dtype: torch.dtype, where: str) -> None:
    if not isinstance(t, Tensor):
        raise AssertionError(f"{name}: expected a tensor, got {type(t).__name__} ({where})")
    if tuple(t.shape) != tuple(shape):
        raise AssertionError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)} ({where})")
    if t.dtype != dtype:
        raise AssertionError(f"{name}: dtype {t.dtype}, expected {dtype} ({where})")
    nans = int(torch.isnan(t).sum())
    if nans:
        raise AssertionError(f"{name}: {nans} NaN values of {t.numel()} ({where})")


def _check_empty_rows(lse: Tensor, ref_lse: Tensor, where: str) -> None:
    """The rows with ``lse = -inf`` (no visible key) must be the reference's, and no lse is +inf."""
    empty, ref_empty = lse.detach() == float("-inf"), ref_lse.detach() == float("-inf")
    if bool((empty != ref_empty).any()):
        wrong = (empty != ref_empty).nonzero()
        raise AssertionError(
            f"lse: -inf (row sees no key) at {int(empty.sum())} rows, reference at {int(ref_empty.sum())}; "
            f"first disagreement at (b, h, t) = {tuple(wrong[0].tolist())} ({where})"
        )
    if bool(torch.isposinf(lse).any()):
        raise AssertionError(f"lse: {int(torch.isposinf(lse).sum())} +inf values ({where})")


def _check_close(name: str, actual: Tensor, expected: Tensor, rtol: float, where: str) -> None:
    error = relative_error(actual, expected)
    if not error <= rtol:
        raise AssertionError(
            f"{name}: relative RMS error {error:.3e} > tolerance {rtol:.1e} against the float64 reference "
            f"(tensor shape {tuple(expected.shape)}; {where})"
        )


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64; ``||actual||`` if ``expected`` is all zero.

    NaN anywhere gives NaN, which fails every ``error <= tol`` check.
    """
    actual = actual.detach().to(torch.float64)
    expected = expected.detach().to(device=actual.device, dtype=torch.float64)
    if actual.numel() == 0:
        return 0.0
    diff = torch.linalg.vector_norm(actual - expected).item()
    norm = torch.linalg.vector_norm(expected).item()
    return diff / norm if norm > 0 else diff


def variants(
    shape: MoDAShape,
    *,
    kinds: Sequence[str] = BUILTIN_KINDS,
    max_terms: int = 2,
    structured: bool = False,
    device: Union[str, torch.device] = "cpu",
) -> st.SearchStrategy[Variant]:
    """A hypothesis strategy of built-in variants valid for ``shape``.

    Each term is a built-in of ``kinds`` (:data:`moda_flex.variants.BUILTINS`)
    with an argument that fits: a number of positions ``1 .. Tk``
    (``sliding_window``, ``chunk_depth``), of depth slots ``1 .. max(L, 1)``
    (``depth_window``), or (B, Tk) ids splitting every batch row into
    contiguous documents of random lengths (``document``, alone or under
    ``causal()``). Up to ``max_terms`` terms are joined with ``&``.

    Args:
        shape: the sizes the variant must fit (``Tk``, ``L``, ``B``).
        kinds: which families to draw from, a subset of :data:`BUILTIN_KINDS`.
        max_terms: the most terms in one ``&`` composition.
        structured: draw only variants that keep a
            :class:`~moda_flex.Structure` (what block-sparse backends need):
            no composition of two documents or of two different depth chunks.
        device: where document ids live: the device of the inputs.
    """
    kinds = _check_strategy_args(shape, kinds, BUILTIN_KINDS, max_terms)

    Tk, L, B = shape.kv_len, shape.slots, shape.batch
    arguments = {
        None: (),
        "tokens": (st.integers(1, Tk),),
        "slots": (st.integers(1, max(L, 1)),),
        "doc_ids": (document_ids(B, Tk, device=device), st.booleans()),  # alone or under causal()
    }

    def family(kind: str) -> st.SearchStrategy[Variant]:
        builtin = BUILTINS[kind]
        make = _documents if builtin.argument == "doc_ids" else builtin.make
        return st.builds(make, *arguments[builtin.argument])

    drawn = _joined({kind: family(kind) for kind in kinds}, max_terms)
    return drawn.filter(lambda variant: variant.structure is not None) if structured else drawn


def score_functions(
    shape: MoDAShape,
    *,
    kinds: Sequence[str] = SCORE_KINDS,
    learned: bool = True,
    max_terms: int = 2,
    device: Union[str, torch.device] = "cpu",
) -> st.SearchStrategy[Score]:
    """A hypothesis strategy of built-in score functions valid for ``shape``.

    Each term is one of ``kinds``: ``softcap(cap)`` with ``0.5 <= cap <= 50``,
    ``alibi(slopes)`` and ``depth_alibi(slopes)`` with (Hq,) slopes in
    ``[0, 1)``, ``depth_bias(bias)`` with a (L,) or (Hq, L) bias in
    ``[-2, 2)``. Up to ``max_terms`` terms are joined with ``&`` (applied in
    order). Tensors are float32, seeded by the draw.

    Args:
        shape: the sizes the tensors must fit (``Hq``, ``L``).
        kinds: which families to draw from, a subset of :data:`SCORE_KINDS`.
        learned: the drawn tensors require grad, so that
            :func:`assert_matches_reference` also compares their gradients.
        max_terms: the most terms in one composition.
        device: where the tensors live: the device of the inputs.
    """
    kinds = _check_strategy_args(shape, kinds, SCORE_KINDS, max_terms)
    Hq, L = shape.q_heads, shape.slots

    def uniform(low: float, high: float, *size: int):
        def make(seed: int) -> Tensor:
            generator = torch.Generator().manual_seed(seed)
            t = low + (high - low) * torch.rand(*size, generator=generator)
            return t.to(device).requires_grad_(learned)

        return st.integers(0, 2**16).map(make)

    arguments = {
        "softcap": st.floats(0.5, 50.0),
        "alibi": uniform(0.0, 1.0, Hq),
        "depth_bias": st.one_of(uniform(-2.0, 2.0, L), uniform(-2.0, 2.0, Hq, L)),
        "depth_alibi": uniform(0.0, 1.0, Hq),
    }
    return _joined({kind: st.builds(scores.BUILTINS[kind], arguments[kind]) for kind in kinds}, max_terms)


def _joined(families: dict, max_terms: int) -> st.SearchStrategy:
    """One to ``max_terms`` terms, each drawn from one of ``families``, joined with ``&`` in order."""
    term = st.one_of(list(families.values()))
    return st.lists(term, min_size=1, max_size=max_terms).map(_intersect_all)


def _check_strategy_args(shape, kinds: Sequence[str], allowed: tuple, max_terms) -> tuple:
    """The strategies' common arguments, validated; ``kinds`` as a tuple."""
    if not isinstance(shape, MoDAShape):
        raise ValueError(f"shape must be a MoDAShape, got {type(shape).__name__}")
    kinds = tuple(kinds)
    if not kinds or any(kind not in allowed for kind in kinds):
        raise ValueError(f"kinds must be a non-empty subset of {allowed}, got {kinds!r}")
    if not isinstance(max_terms, int) or max_terms < 1:
        raise ValueError(f"max_terms must be a positive int, got {max_terms!r}")
    return kinds


def document_ids(
    batch: int, kv_len: int, *, max_documents: int = 5, device: Union[str, torch.device] = "cpu"
) -> st.SearchStrategy[Tensor]:
    """(batch, kv_len) int64 document ids on ``device``: every row split into contiguous runs of random lengths."""
    if kv_len == 1:
        return st.just(torch.zeros(batch, 1, dtype=torch.long, device=device))
    starts = st.sets(st.integers(1, kv_len - 1), max_size=max_documents - 1)

    def ids(rows: list) -> Tensor:
        new_document = torch.zeros(batch, kv_len, dtype=torch.long)  # (B, Tk)
        for b, row_starts in enumerate(rows):
            new_document[b, sorted(row_starts)] = 1
        return new_document.cumsum(dim=1).to(device)

    return st.lists(starts, min_size=batch, max_size=batch).map(ids)


def _documents(doc_ids: Tensor, with_causal: bool) -> Variant:
    """``document(doc_ids)``, alone or under ``causal()``."""
    documents = document(doc_ids)
    return causal() & documents if with_causal else documents


def _intersect_all(terms: list) -> Variant:
    variant = terms[0]
    for other in terms[1:]:
        variant = variant & other
    return variant
