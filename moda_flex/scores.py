"""Score modifications over ``[sequence | depth]``: FlexAttention's ``score_mod``, for MoDA.

A score function changes a logit before the one softmax, for sequence keys
and depth entries alike, written once for every backend that runs it::

    score(s, b, h, q_pos, pos, slot, is_depth) -> s'

- ``s``: the scaled logit ``scale * q . k`` (float);
- ``b``, ``h``: batch row and query head;
- ``q_pos``: the query's absolute position (as for the predicates);
- ``pos``: the key's position, or for a depth entry the token it was written for;
- ``slot``: the depth slot ``0 .. L-1`` (meaningless, and 0, for sequence keys);
- ``is_depth``: bool, the logit is a depth entry's.

Arguments arrive as broadcastable tensors; the function must return a float
tensor of ``s``'s shape (use ``torch.where(is_depth, ..., ...)`` to treat the
two parts apart). It runs before masking: a masked entry stays masked.

A :class:`Score` joins a variant with ``&``: ``causal() & softcap(30.0)``.
Two scores joined with ``&`` apply left to right: ``alibi(m) & softcap(30.0)``
caps the biased logit.

Scores that read tensors (a learned bias) list them as ``params`` and read
them from the arguments of ``build``, never from a closure: the flex backend
hands them to FlexAttention as buffers, which is how their gradients are
computed on its eager path.

The built-ins (:data:`BUILTINS`, the one list of them): :func:`softcap`,
:func:`alibi`, :func:`depth_bias`, :func:`depth_alibi`.

Backends: ``reference`` and ``flex`` run every score; ``triton`` fuses the
kinds of :data:`moda_flex.backends.triton.support.FUSED_SCORES`, which it
recognizes by :attr:`Score.terms`.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

ScoreFunction = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class Score:
    """A named score function over ``[sequence | depth]``.

    Args:
        name: shown in errors, reprs and test ids.
        fn: ``(s, b, h, q_pos, pos, slot, is_depth) -> s'``, for a score that
            reads no tensor and does not depend on the call's sizes.
        build: alternatively, ``(q_heads, slots, *params) -> fn``, called per
            call with ``Hq``, ``L`` and the tensors ``params``; it validates
            them (raising ``ValueError``) and returns the score function.
        params: the tensors ``build`` reads (they may require grad).

    ``a & b`` applies ``a`` then ``b``; ``variant & score`` (or ``score &
    variant``) is the variant with the score.

    Attributes:
        terms: what a fused kernel needs to recognize the built-ins it runs:
            for ``softcap`` and ``depth_bias`` and ``&`` chains of them, the
            terms in the order they apply, ``("softcap", cap)`` or
            ``("depth_bias", None)`` (which reads the next tensor of
            ``params``); None for every other score.
    """

    def __init__(
        self,
        name: str,
        fn: Optional[ScoreFunction] = None,
        *,
        build: Optional[Callable[..., ScoreFunction]] = None,
        params: Sequence[Tensor] = (),
    ):
        if (fn is None) == (build is None):
            raise ValueError(f"score {name!r}: pass exactly one of fn or build")
        params = tuple(params)
        if fn is not None and params:
            raise ValueError(f"score {name!r}: params are read by build; pass build instead of fn")
        for i, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise TypeError(f"score {name!r}: params[{i}] must be a tensor, got {type(p).__name__}")
        _refuse_captured_grad(name, fn if fn is not None else build)
        self.name = name
        self.params = params
        self._build = build if build is not None else (lambda q_heads, slots: fn)
        self.terms = None

    def bind(self, q_heads: int, slots: int, params: Optional[Sequence[Tensor]] = None) -> ScoreFunction:
        """The score function for a call with ``Hq = q_heads`` and ``L = slots``, reading ``params``.

        ``params`` default to :attr:`params`; a backend passes its own copies
        (FlexAttention's buffers). The function checks what it returns.
        """
        params = self.params if params is None else tuple(params)
        return _checked(self.name, self._build(q_heads, slots, *params))

    def with_params(self, params: Sequence[Tensor]) -> "Score":
        """The same score reading ``params`` instead (the testing helpers' leaf copies)."""
        params = tuple(params)
        if len(params) != len(self.params):
            raise ValueError(f"score {self.name!r} reads {len(self.params)} params, got {len(params)}")
        score = Score(self.name, build=self._build, params=params)
        score.terms = self.terms
        return score

    def __and__(self, other):
        if not isinstance(other, Score):
            return NotImplemented  # Variant.__rand__ joins a score and a variant
        first, second, split = self, other, len(self.params)

        def build(q_heads, slots, *params):
            fn_a = first.bind(q_heads, slots, params[:split])
            fn_b = second.bind(q_heads, slots, params[split:])

            def both(s, b, h, q_pos, pos, slot, is_depth):
                return fn_b(fn_a(s, b, h, q_pos, pos, slot, is_depth), b, h, q_pos, pos, slot, is_depth)

            return both

        joined = Score(f"{self.name} & {other.name}", build=build, params=self.params + other.params)
        if self.terms is not None and other.terms is not None:
            joined.terms = self.terms + other.terms
        return joined

    def __repr__(self) -> str:
        return f"Score({self.name})"


def _refuse_captured_grad(name: str, fn: Callable) -> None:
    """A tensor that requires grad in ``fn``'s closure would get no gradient on flex: refuse it."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, Tensor) and value.requires_grad:
            raise ValueError(
                f"score {name!r}: its function captures a tensor of shape {tuple(value.shape)} that requires "
                f"grad; list it in params= and read it from build's arguments, so that every backend "
                f"differentiates it"
            )


def _checked(name: str, fn: ScoreFunction) -> ScoreFunction:
    """``fn``, failing with a clear error unless it returns a float tensor of the logit's shape."""

    def checked(s, b, h, q_pos, pos, slot, is_depth):
        out = fn(s, b, h, q_pos, pos, slot, is_depth)
        if not (isinstance(out, Tensor) and out.is_floating_point()):
            got = f"a {out.dtype} tensor" if isinstance(out, Tensor) else f"{type(out).__name__} {out!r}"
            raise TypeError(f"score {name!r} must return a float tensor of the logit's shape, got {got}")
        if out.shape != s.shape:
            raise ValueError(
                f"score {name!r} must return a tensor of the logit's shape {tuple(s.shape)}, got "
                f"{tuple(out.shape)}; index per-entry tensors with h, slot or pos"
            )
        return out.to(s.dtype)

    checked.__name__ = getattr(fn, "__name__", name)
    return checked


def softcap(cap: float) -> Score:
    """Gemma-style logit soft-capping, ``cap * tanh(s / cap)``, on every logit."""
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap: cap must be a finite real number > 0, got {cap!r}")
    cap = float(cap)

    def fn(s, b, h, q_pos, pos, slot, is_depth):
        return cap * torch.tanh(s / cap)

    score = Score(f"softcap({cap:g})", fn)
    score.terms = (("softcap", cap),)
    return score


def _check_slopes(name: str, slopes: Tensor, q_heads: int) -> None:
    """ALiBi slopes: one per query head of the call."""
    if slopes.shape != (q_heads,):
        raise ValueError(f"{name}: slopes must have shape (Hq={q_heads},), got {tuple(slopes.shape)}")


def alibi(slopes: Tensor) -> Score:
    """ALiBi over the sequence: ``s - slopes[h] * |q_pos - k_pos|``; depth logits unchanged.

    Args:
        slopes: (Hq,) float, one per query head (may require grad).
    """
    return _sloped("alibi", slopes, on_depth=False, distance=lambda q_pos, pos, slot, slots: (q_pos - pos).abs())


def depth_bias(bias: Tensor) -> Score:
    """A bias per depth slot, ``s + bias[slot]`` (or ``bias[h, slot]``) on depth logits; sequence unchanged.

    Args:
        bias: (L,) or (Hq, L) float; learned when it requires grad (an
            ``nn.Parameter``). Each call checks ``L`` (and ``Hq``).
    """
    _check_float("depth_bias", "bias", bias, (1, 2))

    def build(q_heads, slots, bias):
        want = (slots,) if bias.dim() == 1 else (q_heads, slots)
        if bias.shape != want:
            layout = "(L,)" if bias.dim() == 1 else "(Hq, L)"
            raise ValueError(
                f"depth_bias: bias must have shape {layout} = {want} for a call with Hq={q_heads}, L={slots}, "
                f"got {tuple(bias.shape)}"
            )
        if slots == 0:
            return _identity

        def fn(s, b, h, q_pos, pos, slot, is_depth):
            added = bias[slot] if bias.dim() == 1 else bias[h, slot]
            return torch.where(is_depth, s + added, s)

        return fn

    score = Score("depth_bias", build=build, params=(bias,))
    score.terms = (("depth_bias", None),)
    return score


def depth_alibi(slopes: Tensor) -> Score:
    """ALiBi over depth: ``s - slopes[h] * (L - 1 - slot)`` on depth logits; sequence unchanged.

    The newest slot (``L - 1``, the layer just below) is unbiased; each older
    slot costs one more ``slopes[h]``.

    Args:
        slopes: (Hq,) float, one per query head (may require grad).
    """
    return _sloped("depth_alibi", slopes, on_depth=True, distance=lambda q_pos, pos, slot, slots: slots - 1 - slot)


# Every built-in score factory by name: what the test strategies and the tests enumerate.
BUILTINS = {"softcap": softcap, "alibi": alibi, "depth_bias": depth_bias, "depth_alibi": depth_alibi}


def _sloped(name: str, slopes: Tensor, on_depth: bool, distance: Callable) -> Score:
    """``s - slopes[h] * distance(q_pos, pos, slot, L)`` on the depth logits (``on_depth``) or the sequence ones."""
    _check_float(name, "slopes", slopes, 1)

    def build(q_heads, slots, slopes):
        _check_slopes(name, slopes, q_heads)

        def fn(s, b, h, q_pos, pos, slot, is_depth):
            biased = s - slopes[h] * distance(q_pos, pos, slot, slots)
            return torch.where(is_depth, biased, s) if on_depth else torch.where(is_depth, s, biased)

        return fn

    return Score(name, build=build, params=(slopes,))


def _identity(s, b, h, q_pos, pos, slot, is_depth):
    return s


def _check_float(score: str, name: str, t, dims) -> None:
    dims = (dims,) if isinstance(dims, int) else dims
    if not (isinstance(t, Tensor) and t.is_floating_point() and t.dim() in dims):
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        layouts = {1: "(Hq,)" if name == "slopes" else "(L,)", 2: "(Hq, L)"}
        raise TypeError(
            f"{score}: {name} must be a float tensor of shape {' or '.join(layouts[d] for d in dims)}, got {got}"
        )
