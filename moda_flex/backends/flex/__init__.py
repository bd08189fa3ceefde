"""The flex backend: MoDA through FlexAttention.

A call without depth is one FlexAttention call as it is made without MoDA.
With depth, two designs (:mod:`.function`): ``"concat"``, the default
(``DESIGN``), is one call over ``[sequence | chunk-packed depth]``, the
expression the paper draws; ``"split"`` runs the sequence part as
FlexAttention itself is called and the depth part on its own, merged through
the log-sum-exps. The concat layout (per batch and KV head)::

    rows     r = t * G + g          query token t, query head kv_head * G + g
    columns  [ k_0 ... k_{Tk-1} pad | depth(t=0, l=0..L-1) depth(t=1, ...) ... ]
              \\___ Tk_pad = Tk rounded up to KV blocks __/ \\____ Tq * L ____/

The G query heads of a group are folded into rows, so a block of rows covers
a few consecutive tokens and reads one contiguous span of depth columns (the
chunk-packed layout). The sequence part is padded to whole KV blocks so that
no block mixes sequence keys and depth entries. The split design's depth
call, for variants that read other tokens' depth, uses the same rows and the
depth columns alone.

- ``function.py``: the call: the designs, folding, eager or compiled;
- ``compiled.py``: one compiled function per kind of call, and the error where dynamo would run it eagerly;
- ``scoring.py``: the variant's score as FlexAttention's ``score_mod``, and the copies of a learned tensor;
- ``run.py``: one FlexAttention call, compiled, eager, or eager and differentiable on CPU;
- ``block_mask.py``: each call's layout, its element mask and the BlockMask built from the variant's structure.
"""

from .block_mask import BLOCK, moda_block_mask
from .function import DESIGN, DESIGNS, flex_attention_backend, flex_moda
from .run import eager_flex_with_grad

__all__ = [
    "BLOCK",
    "DESIGN",
    "DESIGNS",
    "eager_flex_with_grad",
    "flex_attention_backend",
    "flex_moda",
    "moda_block_mask",
]
