"""Triton kernels for MoDA: forward (Algorithm 1) and backward. ``@triton.jit`` only.

Files: ``common.py`` (what the kernels share), ``forward.py``, ``dq.py`` and
``dkdv.py``, one kernel each.

Row layout (group-aware, Algorithm 1 lines 3-4). One program owns one KV head
``hk`` of one batch element and a block of ``BLOCK_T`` query tokens. Its
``BLOCK_M = BLOCK_T * GP`` rows fold the ``G`` query heads of that KV head into
rows: row ``r`` is token ``t0 + r // GP`` of query head ``hk * G + r % GP``
(``GP`` is ``G`` rounded up to a power of two; rows with ``r % GP >= G`` are
padding, loaded as zeros and never stored). So the block is aligned to ``G``
and a token's ``G`` rows never straddle two blocks. The dK/dV kernel, which
has no depth phase, may pack its rows without padding: row ``r`` is token
``t0 + r // G``, ``BLOCK_M // G`` tokens a block (its launch's ``ROW_G``,
:func:`..configs.launch_config`: ``GP`` again on the Hopper path, whose
tensor descriptors copy GP heads a token, and at D=128).

Sequence phase: a FlashAttention loop over key blocks with one online-softmax
state ``(m, l, acc)``, split into masked edge blocks and unmasked interior
blocks (keys every row of the block may see).

Depth phase (group-aware, beyond the paper): a token's depth logits are the
``G x L`` product of its own ``G`` query rows with its own ``L`` depth keys.
The paper multiplies a whole block of ``C`` query rows by whole depth blocks
and masks all but ``G / C`` of the products away (12.5% at ``G = 8``, ``C = 64``). Here the
block's rows are cut into tiles of ``R = max(GP, 16)`` rows (16 is the least
M of a Tensor Core dot), i.e. the rows of ``P = R / GP`` consecutive tokens,
and each tile is multiplied only by the depth keys of its own ``P`` tokens:
batched 3D dots ``[BLOCK_M / R, R, D] x [BLOCK_M / R, D, P * BLOCK_S]`` over
``BLOCK_S`` slots per token per step. A row keeps the ``BLOCK_S`` columns of
its own token, so depth utilization is ``G / R`` (times ``L / (BLOCK_S *
ceil(L / BLOCK_S))``): 50% at ``G = 8``, 100% at ``G >= 16``. The tiles are
a reshape of the block's rows, so the online-softmax state carries over from
the sequence phase in place.

Depth slots are read through address tables: slot ``l`` of the depth keys
starts at ``DK_TAB[l]`` (values ``DV_TAB[l]``), so the L slots may be L
separate tensors (the entries of a model's layers) or the slots of one 5-D
tensor, both read in place with shared (b, h, t, d) strides (a traced call's
flat wrapper writes the table from the entries, its own pointer arguments:
``SLOTS`` 3, :mod:`..traced`); or slot ``l`` is ``l`` slot strides past
``DK_TAB`` (``SLOTS`` 2, one slab each). The head dim is padded to a power of
two inside the kernels (:func:`.common.head_lanes`). The backward
runs the dQ kernel first: it also writes ``delta = rowsum(dO * O) - dLSE``,
which the dK/dV kernel reads.

The Hopper path (launch flag ``TMA``): the tiles of the unmasked blocks,
the part of the work that grows as T^2, come through tensor descriptors
(the TMA copy engine, pipelined ``LOOP_STAGES`` deep): K and V in the
forward and dQ kernels, q and dO in the dK/dV kernel, where a descriptor
over Q (or dO) seen as (B, Hk, T, G, D) gives a block's rows in the order
above. Masked blocks and the depth phase read as on the
generic path. ``DQ_ATOMIC`` (either path) lets the dK/dV kernel add
``dS K`` to float32 dQ sums instead of the dQ kernel recomputing ``QK^T``
and ``dO V^T``: five matrix products instead of seven, and a dQ whose last
bits depend on the order of the atomic adds.

Fused scores (:data:`moda_flex.backends.triton.support.FUSED_SCORES`, in
:func:`.common.score`): applied in the order the score joins them; the backward
multiplies dS by the cap's derivative. The bias's gradient sums the depth dS
over the batch and the tokens: each dQ program writes the sum over its own
tokens and the launcher adds them up (deterministic, no atomics).

Logits are kept in base 2: ``qk_scale = scale * log2(e)``; LSE is stored in
natural log. Batch/head base offsets and depth token offsets are int64: one
depth tensor may hold more than 2**31 elements (T=16384, L=256, Hk=8, D=64).
"""

from .dkdv import dkdv_kernel
from .dq import dq_kernel
from .forward import forward_kernel

__all__ = ["forward_kernel", "dq_kernel", "dkdv_kernel"]
