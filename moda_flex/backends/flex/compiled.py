"""The compiled flex call: one compiled function per kind of call, and an error where dynamo would give up.

Eager FlexAttention evaluates every score of a call densely (rows x columns
floats per head), which no GPU holds at a model's lengths. A plain
``torch.compile`` falls back to it, after a warning, once a function has
compiled ``torch._dynamo.config.recompile_limit`` graphs. So:

- lengths never specialize a graph: they reach the masks and scores as
  tensors (:func:`.block_mask.layout_lengths`), and after the first new
  length the graph is dynamic, so a sweep of lengths or a decode loop over a
  growing cache reuses it;
- what must specialize (:class:`Kind`: dtype, D, G, the variant, the score,
  the parts) has a compiled function of its own, over its own copy of the
  code: dynamo keeps graphs, checks guards and counts its limit per code
  object, so kinds neither share the limit nor check each other's guards;
- each function compiles with ``fullgraph=True``: a graph break or the limit
  raises instead of running eagerly, and :func:`call` says what to do.
"""

from __future__ import annotations

import functools
import types
from typing import Callable, NamedTuple, Optional

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit


class Kind(NamedTuple):
    """What a compiled graph specializes on, beyond which lengths are 0 or 1."""

    dtype: torch.dtype
    head_dim: int
    groups: int
    variant: str
    score: Optional[str]
    parts: tuple
    return_lse: bool
    learns_score: bool

    def __str__(self) -> str:
        score = "" if self.score is None else f", score {self.score!r}"
        return f"{self.dtype}, D={self.head_dim}, G={self.groups}, variant {self.variant!r}{score}, parts {self.parts}"


def call(fn: Callable, kind: Kind, backend: str, *args):
    """``fn(*args)`` through the compiled function of ``kind``; never eagerly.

    Raises:
        RuntimeError: when ``kind`` has compiled as many graphs as dynamo allows.
    """
    try:
        return _compiled(fn, kind, backend)(*args)
    except FailOnRecompileLimitHit as error:
        limit = torch._dynamo.config.recompile_limit
        raise RuntimeError(
            f"backend 'flex' has compiled {limit} graphs for calls of one kind ({kind}), "
            f"torch._dynamo.config.recompile_limit, and will not run FlexAttention eagerly: that evaluates every "
            f"score densely. TORCH_LOGS=recompiles names what changed; raise the limit, call torch._dynamo.reset() "
            f"between unrelated sweeps, or use backend='auto'"
        ) from error


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable, kind: Kind, backend: str) -> Callable:
    # Compiled on first use, never at import time.
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(own, backend=backend, fullgraph=True)
