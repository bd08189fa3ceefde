"""Context parallelism: MoDA over a sequence sharded across the ranks of a process group.

Every rank holds ``T_local = T / world`` tokens of each sequence: the
sequence is cut into ``2 * world`` chunks of ``C = T / (2 * world)`` tokens
and rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r`` (the "zigzag"
split), so that under a causal mask every rank does the same work::

    T = 16, world = 2: 4 chunks of C = 4 tokens

    position   0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 14 15
    chunk          0      |     1      |     2      |      3
    held by      rank 0   |   rank 1   |   rank 1   |    rank 0

    rank 0, local rows 0..7: [chunk 0 | chunk 3] = positions 0..3, 12..15
    rank 1, local rows 0..7: [chunk 1 | chunk 2] = positions 4..11

    causal blocks (query chunk x key chunk): d diagonal, with the depth
    entries; 0 / 1 computed by that rank; . nothing to compute

                 key chunk  0  1  2  3
    query chunk 0           d  .  .  .      rank 0: 2 diagonal + 3 full blocks
                1           1  d  .  .      rank 1: 2 diagonal + 3 full blocks
                2           1  1  d  .
                3           0  0  0  d

Each rank's depth entries never move: a query reads only its own token's
depth, and those join the softmax once, in the diagonal block. The sequence
K/V travels around a ring: at step ``s`` rank ``r`` attends to the K/V of
rank ``(r - s) mod world`` while it already sends that K/V on to ``r + 1``
and receives the next from ``r - 1``. The partial results of a query row
merge through their log-sum-exps (``lse = log sum_i exp(lse_i)``,
``out = sum_i exp(lse_i - lse) * out_i``).

Backward runs the same ring without running any block's forward again.
The merge hands back all that FlashAttention's backward needs of a row: its
merged output ``out`` and ``lse``. With them a block's share of the
gradients follows from its own logits ``s`` alone, since the row's final
weights over the block's entries are ``P = exp(s - lse)``::

    delta = rowsum(dO * out) - dlse          per row, the same for every block
    dV = P^T dO        dS = P * (dO V^T - delta)        dQ = scale dS K        dK = scale dS^T Q

and the blocks' shares sum to the one-process gradients (the depth slots
of the diagonal block are more columns of the same ``P``). Each block
hands ``(out, lse)`` to :func:`moda_flex.backends.merged_backward`, the
policy's backward of a call given its rows' merged results: on triton or
the split path the kernel's backward takes the given lse, on the reference
backend the lines above run in plain PyTorch. A block on flex (where
triton cannot describe a document block, see
:func:`context_parallel_moda_attention`) is run forward again and
differentiated with its share of the row's gradient: FlexAttention takes
no given lse.

Memory per rank: the backward keeps, besides the rank's own inputs, the
merged ``out`` (B, Hq, T_local, D) and ``lse`` (B, Hq, T_local) in float32
(float64 for float64 inputs): ``O(T/P * Hq * (D + 1))`` floats, and nothing
per block or per ring step. While the ring turns it also holds the K/V in
use, the K/V arriving and one K/V gradient in flight, (2, B, Hk, T_local, D)
each: memory per rank stays proportional to ``T / world``. A block's own
working memory is its backend's: the reference's holds the block's weights,
(b, Hq, rows, cols + L), as its forward does. The lse of each block is
float32 (what ``moda_attention`` returns), so float64 inputs agree with the
one-process result to float32 precision.

Works with any torch.distributed backend that has point-to-point sends
(NCCL on GPUs, gloo on CPU).

Use :func:`shard_sequence` to cut a global (B, H, T, ...) tensor into the
local part and :func:`gather_sequence` to put the local parts back together.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import backends
from .attention import check_inputs, moda_attention
from .depth import slot_count
from .variants import Documents, Structure, Variant, full, resolve


def zigzag_positions(seq_len: int, world_size: int, rank: int, device=None) -> Tensor:
    """The absolute positions a rank holds, in local order.

    Args:
        seq_len: T, the global sequence length; a multiple of ``2 * world_size``.
        world_size, rank: the rank's place in the process group.
        device: where the positions live.

    Returns:
        (2 * C,) int64, ``C = T / (2 * world_size)``: chunk ``rank`` then chunk
        ``2 * world_size - 1 - rank``. Use it for rotary positions or labels.
    """
    chunk = _chunk_len(seq_len, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * world_size - 1 - rank) * chunk, (2 * world_size - rank) * chunk, device=device)
    return torch.cat([first, second])


def shard_sequence(x: Tensor, group: Optional[dist.ProcessGroup] = None, *, dim: int = 2) -> Tensor:
    """This rank's zigzag part of a tensor every rank holds in full.

    Args:
        x: (..., T, ...) with the token axis at ``dim``: (B, H, T, D) for q/k/v,
            (B, Hk, T, L, D) for depth entries; ``T % (2 * world) == 0``.
        group: the process group (default: the world).

    Returns:
        (..., 2 * C, ...): chunks ``rank`` and ``2 * world - 1 - rank`` of C tokens.
    """
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = _chunk_len(x.shape[dim], world)
    return torch.cat([x.narrow(dim, rank * chunk, chunk), x.narrow(dim, (2 * world - 1 - rank) * chunk, chunk)], dim)


def gather_sequence(x: Tensor, group: Optional[dist.ProcessGroup] = None, *, dim: int = 2) -> Tensor:
    """The global tensor from every rank's zigzag part (the inverse of :func:`shard_sequence`).

    Differentiable: each rank's part receives the sum over ranks of the
    gradients of the global tensor at its positions. Every rank must pass a
    part of the same shape.

    Args:
        x: (..., 2 * C, ...), this rank's part, token axis at ``dim``.
        group: the process group (default: the world).

    Returns:
        (..., T, ...) with ``T = 2 * C * world``, tokens in absolute order.
    """
    if x.shape[dim] % 2:
        raise ValueError(f"x must hold two chunks of equal length along dim {dim}, got shape {tuple(x.shape)}")
    return _GatherSequence.apply(x, group or dist.group.WORLD, dim % x.dim())


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        chunks = [None] * (2 * world)
        for rank, part in enumerate(parts):
            chunks[rank], chunks[2 * world - 1 - rank] = part.chunk(2, dim)
        ctx.group, ctx.dim = group, dim
        return torch.cat(chunks, dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank may have used the whole tensor: sum their gradients, keep our part.
        # (An all-reduce rather than a reduce-scatter, which gloo lacks.)
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return shard_sequence(grad, ctx.group, dim=ctx.dim), None, None


def context_parallel_moda_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Optional[Tensor] = None,
    depth_v: Optional[Tensor] = None,
    *,
    group: Optional[dist.ProcessGroup] = None,
    variant: Union[str, Variant] = "causal",
    scale: Optional[float] = None,
    backend: str = "auto",
    return_lse: bool = False,
):
    """:func:`moda_attention` over a sequence sharded across ``group`` (zigzag, see the module doc).

    ``o_i = softmax(scale * q_i [K_seq (all ranks) | K_depth(i)]^T) [V_seq (all ranks) | V_depth(i)]``

    Called by every rank of ``group`` with its own part; returns its own part
    of the result, equal to ``moda_attention`` on the whole sequence::

        query at position t:  sequence keys 0 .. t, gathered around the ring | depth slots of t, local
                              x x x ... x (every rank's chunks)             | x x ... x

    Args:
        q: (B, Hq, T_local, D) this rank's queries, ``T_local = T / world``
            (:func:`shard_sequence` of the global (B, Hq, T, D)).
        k, v: (B, Hk, T_local, D) this rank's keys and values, same tokens.
        depth_k, depth_v: (B, Hk, T_local, L, D) or None: the depth entries
            of this rank's tokens; any strides.
        group: the process group (default: the world); ranks hold the zigzag
            parts in group-rank order.
        variant: ``"causal"``, ``"full"`` or a structured :class:`moda_flex.Variant`
            over the *global* positions (``document(ids)`` takes the (B, T) or
            (T,) ids of the whole sequence, the same on every rank). The ring
            runs a variant by its :class:`moda_flex.Structure`, as the triton
            backend does: causal, full, depth_window, depth_only, document
            (contiguous runs) and their intersections; not sliding windows or
            chunk-visible depth. A document with more tokens in a later chunk
            than in the chunk where it starts makes one block no structure
            describes: it runs on flex where triton was asked for.
        scale: logit scale, default ``1 / sqrt(D)``.
        backend: the ``moda_attention`` backend each block runs on.
        return_lse: also return the log-sum-exp.

    Returns:
        out (B, Hq, T_local, D); with ``return_lse`` also lse (B, Hq, T_local)
        float32. A row that sees no key gives zeros and ``lse = -inf``.

    Raises:
        ValueError: bad shapes (locally, or shards that differ across ranks),
            ``T_local`` not even, document ids that do not cover ``world * T_local``
            positions in contiguous runs: raised on every rank, after one small
            all-gather of the local shapes and before any K/V moves.
        NotImplementedError: a variant the ring cannot run, on every rank.
        RuntimeError: torch.distributed is not initialized.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context parallelism needs torch.distributed: call torch.distributed.init_process_group")
    group = group or dist.group.WORLD
    variant, depth_k, depth_v = _check_every_rank(q, k, v, depth_k, depth_v, variant, backend, group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = q.shape[2] // 2
    ring = _Ring(
        group=group,
        rank=rank,
        world=world,
        steps=_plan(variant, rank, world, chunk, backend),
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        backend=backend,
    )
    out, lse = _RingAttention.apply(q, k, v, depth_k, depth_v, ring)
    return (out, lse) if return_lse else out


# -- checks -------------------------------------------------------------------

_ERRORS = (ValueError, NotImplementedError)


def _check_every_rank(q, k, v, depth_k, depth_v, variant, backend, group):
    """Check the call on this rank, then agree across ranks; raise the same failure everywhere.

    Returns the resolved variant and the depth tensors (L = 0 filled in).
    """
    shape, world = [0] * 6, dist.get_world_size(group)
    try:
        variant, depth_k, depth_v = _check_locally(q, k, v, depth_k, depth_v, variant, backend, world)
        (B, Hq, T, D), Hk, L = q.shape, k.shape[1], depth_k.shape[3]
        shape = [B, Hq, Hk, T, L, D]
        failure = None
    except _ERRORS as error:
        failure = error
    code = 0 if failure is None else 1 + _ERRORS.index(type(failure))
    device = q.device if isinstance(q, Tensor) else torch.device("cpu")
    mine = torch.tensor([code, *shape], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    # One small collective that every rank reaches, whatever its inputs, so
    # that a failure on one rank becomes a failure on all instead of a hang.
    dist.all_gather(everyone, mine, group=group)
    rows = [row.tolist() for row in everyone]
    failed = [rank for rank, row in enumerate(rows) if row[0]]
    if failed:
        messages = [None] * len(rows)
        dist.all_gather_object(messages, None if failure is None else str(failure), group=group)
        if failure is not None:
            raise failure
        first = failed[0]
        raise _ERRORS[rows[first][0] - 1](f"rank {first} rejected its inputs: {messages[first]}")
    if any(row != rows[0] for row in rows):
        seen = ", ".join(f"rank {rank}: {tuple(row[1:])}" for rank, row in enumerate(rows))
        raise ValueError(f"every rank must hold a part of the same shape (B, Hq, Hk, T_local, L, D); got {seen}")
    return variant, depth_k, depth_v


def _check_locally(q, k, v, depth_k, depth_v, variant, backend, world):
    """The checks that need only this rank's inputs. Returns variant, depth_k, depth_v."""
    variant = resolve(variant)
    _check_ring_runs(variant)
    depth_k, depth_v = check_inputs(q, k, v, depth_k, depth_v)
    # A backend that cannot run the blocks must say so now, not halfway round the ring.
    backends.choose(backend, q, k, slot_count(depth_k), variant, return_lse=True)
    T = q.shape[2]
    if k.shape[2] != T:
        raise ValueError(
            f"q and k must hold the same tokens (T_local), got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if T % 2:
        raise ValueError(
            f"q must hold two chunks of T / (2 * world) tokens (T divisible by 2 * world = {2 * world}); "
            f"got T_local={T} in q {tuple(q.shape)}"
        )
    documents = variant.structure.documents
    if documents is not None:
        _check_documents(documents, q.shape[0], world * T)
    return variant, depth_k, depth_v


def _check_ring_runs(variant: Variant) -> None:
    structure = variant.structure
    reason = None
    if variant.score is not None:
        reason = f"score functions ({variant.score.name}) are not run across the ring yet"
    elif structure is None:
        reason = "it has no Structure (a custom predicate)"
    elif structure.depth_chunk is not None:
        reason = f"it reads other tokens' depth (depth_chunk={structure.depth_chunk}), which stays on their rank"
    elif structure.window is not None:
        reason = f"sliding windows (window={structure.window}) are not split across chunks"
    if reason is not None:
        raise NotImplementedError(f"context parallelism cannot run variant {variant.name!r}: {reason}")


def _check_documents(documents: Documents, batch: int, seq_len: int) -> None:
    """Document ids cover the global sequence, one contiguous run per document."""
    ids = documents.ids
    if ids.shape[0] not in (1, batch) or ids.shape[1] != seq_len:
        raise ValueError(
            f"doc_ids must have shape (1 or B={batch}, T={seq_len}) for the global sequence "
            f"(world * T_local), got {tuple(ids.shape)}"
        )
    if not documents.contiguous:
        raise ValueError("doc_ids must give each document one contiguous run of positions")


def _chunk_len(seq_len: int, world_size: int) -> int:
    if world_size < 1 or seq_len % (2 * world_size):
        raise ValueError(
            f"the sequence length must be divisible by 2 * world_size = {2 * world_size}, got T={seq_len}"
        )
    return seq_len // (2 * world_size)


# -- the plan: which blocks each ring step computes -----------------------------


@dataclasses.dataclass(frozen=True)
class _Block:
    """One ``moda_attention`` call: local query rows against rows of the K/V in hand.

    ``rows`` index the local (B, Hq, 2C) queries, ``cols`` the (B, Hk, 2C) K/V
    of the rank whose turn it is; ``depth`` marks the diagonal block, where
    the queries' own depth entries join; ``backend`` overrides the call's
    backend for a block whose variant has no structure.
    """

    batch: slice
    rows: slice
    cols: slice
    variant: Variant
    depth: bool
    backend: Optional[str] = None


_ALL = slice(None)
_FULL = full()


def _plan(variant: Variant, rank: int, world: int, chunk: int, backend: str) -> list[list[_Block]]:
    """The blocks of each ring step; step ``s`` holds the K/V of rank ``(rank - s) mod world``."""
    ids = variant.structure.doc_ids
    ids = None if ids is None else ids.cpu()
    steps = []
    for step in range(world):
        source = (rank - step) % world
        blocks = []
        for q_half, q_chunk in enumerate(_chunks_of(rank, world)):
            for k_half, k_chunk in enumerate(_chunks_of(source, world)):
                rows = slice(q_half * chunk, (q_half + 1) * chunk)
                cols = slice(k_half * chunk, (k_half + 1) * chunk)
                blocks += _pair_blocks(variant, ids, backend, q_chunk, k_chunk, chunk, rows, cols)
        steps.append(blocks)
    return steps


def _chunks_of(rank: int, world: int) -> tuple[int, int]:
    return rank, 2 * world - 1 - rank


def _pair_blocks(variant, ids, backend, q_chunk, k_chunk, chunk, rows, cols) -> list[_Block]:
    """The calls for query chunk ``q_chunk`` against key chunk ``k_chunk``, read from the structure."""
    structure = variant.structure
    if q_chunk == k_chunk:
        if structure.doc_ids is not None:
            span = slice(q_chunk * chunk, (q_chunk + 1) * chunk)
            structure = dataclasses.replace(structure, documents=Documents.from_ids(structure.doc_ids[:, span]))
        diagonal = _at_positions(variant, structure, q_chunk * chunk, q_chunk * chunk)
        return [_Block(_ALL, rows, cols, diagonal, depth=True)]
    if not structure.sequence or (structure.causal and k_chunk > q_chunk):
        return []
    if ids is None:
        # A whole chunk before the query chunk (or any chunk, non-causal) is all visible.
        return [_Block(_ALL, rows, cols, _FULL, depth=False)]
    return _document_blocks(variant, ids, backend, q_chunk, k_chunk, chunk, rows, cols)


def _document_blocks(variant, ids: Tensor, backend, q_chunk, k_chunk, chunk, rows, cols) -> list[_Block]:
    """Off-diagonal blocks under document masking: one per batch row of ids.

    With contiguous runs, the only document in two different chunks is the
    one that spans from the earlier into the later: the last of the earlier
    chunk, the first of the later. Its rows and columns form one rectangle,
    all visible. ``moda_attention`` needs no more query rows than keys
    (``Tq <= Tk``), so a rectangle taller than wide widens to a square of
    the key chunk, masked by the document predicate itself: no structure
    describes that square, so it runs on flex when triton was asked for.
    """
    blocks = []
    for b, row in enumerate(ids):
        keys = row[k_chunk * chunk : (k_chunk + 1) * chunk]
        queries = row[q_chunk * chunk : (q_chunk + 1) * chunk]
        shared = keys[-1] if k_chunk < q_chunk else keys[0]
        q_hits = (queries == shared).nonzero().flatten().tolist()
        if not q_hits:
            continue
        k_hits = (keys == shared).nonzero().flatten().tolist()
        batch = _ALL if ids.shape[0] == 1 else slice(b, b + 1)
        q_lo, q_hi, k_lo, k_hi = q_hits[0], q_hits[-1] + 1, k_hits[0], k_hits[-1] + 1
        block = dict(batch=batch, rows=slice(rows.start + q_lo, rows.start + q_hi), depth=False)
        if q_hi - q_lo <= k_hi - k_lo:
            blocks.append(_Block(cols=slice(cols.start + k_lo, cols.start + k_hi), variant=_FULL, **block))
            continue
        # The square of the key chunk's side that holds the document: its end (earlier chunk) or start (later).
        k_lo = min(k_lo, chunk - (q_hi - q_lo))
        k_hi = k_lo + q_hi - q_lo
        square = _at_positions(
            variant, None, q_chunk * chunk + q_lo, k_chunk * chunk + k_lo, batch_start=batch.start or 0
        )
        blocks.append(
            _Block(
                cols=slice(cols.start + k_lo, cols.start + k_hi),
                variant=square,
                backend="flex" if backend == "triton" else None,
                **block,
            )
        )
    return blocks


def _at_positions(
    variant: Variant, structure: Optional[Structure], q_start: int, k_start: int, batch_start: int = 0
) -> Variant:
    """``variant`` for a call with as many queries as keys, starting at absolute ``q_start`` and ``k_start``.

    Such a call puts query ``i`` and key ``j`` at positions ``i`` and ``j``:
    the predicates see them shifted back to where they sit in the sequence
    (and batch row ``b`` at ``batch_start + b``). ``structure`` describes the
    shifted masks, or is None. Without document ids the built-in structures
    are shift-invariant, so the name (which keys flex's BlockMask cache)
    stays the variant's own.
    """

    def sequence(b, h, q_pos, k_pos):
        return variant.sequence(b + batch_start, h, q_pos + q_start, k_pos + k_start)

    def depth_for_slots(num_slots):
        depth = variant.depth_predicate(num_slots)

        def shifted(b, h, q_pos, d_pos, slot):
            return depth(b + batch_start, h, q_pos + q_start, d_pos + q_start, slot)

        return shifted

    return Variant(variant.name, sequence, depth_for_slots=depth_for_slots, structure=structure)


# -- the ring -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Ring:
    """Everything the ring needs besides the tensors."""

    group: dist.ProcessGroup
    rank: int
    world: int
    steps: list[list[_Block]]
    scale: float
    backend: str

    def pass_on(self, tensor: Tensor) -> "_Transfer":
        """Start sending ``tensor`` to the next rank and receiving the previous rank's."""
        if self.world == 1:
            return _Transfer(tensor, [])
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, group=self.group, group_peer=(self.rank + 1) % self.world),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.world),
        ]
        return _Transfer(received, dist.batch_isend_irecv(ops))


@dataclasses.dataclass
class _Transfer:
    tensor: Tensor
    works: list

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        return self.tensor


def _attend(block: _Block, q, kv, depth_k, depth_v, ring: _Ring):
    """Run one block: out (b, Hq, rows, D) and lse (b, Hq, rows)."""
    depth = (depth_k, depth_v) if block.depth else (None, None)
    backend = block.backend or ring.backend
    return moda_attention(
        q, kv[0], kv[1], *depth, variant=block.variant, scale=ring.scale, backend=backend, return_lse=True
    )


def _block_inputs(block: _Block, q, kv, depth_k, depth_v) -> list[Tensor]:
    """The views one block reads: q rows, K/V columns, and the rows' depth on the diagonal."""
    b, rows, cols = block.batch, block.rows, block.cols
    inputs = [q[b, :, rows], kv[:, b, :, cols]]
    if block.depth:
        inputs += [depth_k[b, :, rows], depth_v[b, :, rows]]
    return inputs


class _RingAttention(torch.autograd.Function):
    """Ring MoDA: forward merges the blocks by lse, backward differentiates each from the merged (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, depth_k, depth_v, ring: _Ring):
        accumulate = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(q.shape, dtype=accumulate, device=q.device)  # (B, Hq, 2C, D)
        lse = torch.full(q.shape[:3], -math.inf, dtype=accumulate, device=q.device)  # (B, Hq, 2C)
        kv = torch.stack([k, v])  # (2, B, Hk, 2C, D): one message per step
        out_dtype = q.dtype
        for step, blocks in enumerate(ring.steps):
            incoming = ring.pass_on(kv) if step < ring.world - 1 else None
            for block in blocks:
                q_rows, kv_cols, *depth = _block_inputs(block, q, kv, depth_k, depth_v)
                block_out, block_lse = _attend(block, q_rows, kv_cols, *(depth or (None, None)), ring)
                out_dtype = block_out.dtype
                _merge(out[block.batch, :, block.rows], lse[block.batch, :, block.rows], block_out, block_lse)
            if incoming is not None:
                kv = incoming.wait()
        ctx.save_for_backward(q, k, v, depth_k, depth_v, out, lse)
        ctx.ring = ring
        # The dtype the blocks computed in (autocast's, if on): the backward computes in it too.
        ctx.compute_dtype = out_dtype
        ctx.autocast = _autocast_state(q.device.type)
        return out.to(out_dtype), lse.float()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, depth_k, depth_v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        accumulate = out.dtype
        grad_out, grad_lse = grad_out.to(accumulate), grad_lse.to(accumulate)
        rows = _Rows(out, lse, grad_out, grad_lse, ctx.compute_dtype, ctx.autocast)
        grads = {
            "q": torch.zeros(q.shape, dtype=accumulate, device=q.device),
            "depth_k": torch.zeros(depth_k.shape, dtype=accumulate, device=q.device),
            "depth_v": torch.zeros(depth_v.shape, dtype=accumulate, device=q.device),
        }
        kv = torch.stack([k, v])
        grad_kv_in_flight = None
        for step, blocks in enumerate(ring.steps):
            incoming = ring.pass_on(kv) if step < ring.world - 1 else None
            grad_kv = torch.zeros(kv.shape, dtype=accumulate, device=q.device)
            for block in blocks:
                inputs = _block_inputs(block, q, kv, depth_k, depth_v)
                block_grads = _block_backward(block, inputs, rows, ring)
                b, r = block.batch, block.rows
                grads["q"][b, :, r] += block_grads[0]
                grad_kv[:, b, :, block.cols] += torch.stack(block_grads[1:3])
                if block.depth:
                    grads["depth_k"][b, :, r] += block_grads[3]
                    grads["depth_v"][b, :, r] += block_grads[4]
            # This K/V's gradient so far arrived from the ranks it visited before; add ours and pass it on.
            if grad_kv_in_flight is not None:
                grad_kv += grad_kv_in_flight.wait()
            grad_kv_in_flight = ring.pass_on(grad_kv)
            if incoming is not None:
                kv = incoming.wait()
        # After a full turn the gradient of our own K/V comes back from the previous rank.
        grad_kv = grad_kv_in_flight.wait()
        return (
            grads["q"].to(q.dtype),
            grad_kv[0].to(k.dtype),
            grad_kv[1].to(v.dtype),
            grads["depth_k"].to(depth_k.dtype),
            grads["depth_v"].to(depth_v.dtype),
            None,
        )


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block into the running (out, lse) of its rows, in place.

    out (b, Hq, rows, D) and lse (b, Hq, rows) are views of the accumulators;
    ``lse' = log(e^lse + e^block_lse)``, ``out' = e^(lse - lse') out + e^(block_lse - lse') block_out``.
    """
    merged = torch.logaddexp(lse, block_lse.to(lse.dtype))
    # Both -inf (no key yet): keep zeros instead of exp(-inf - -inf) = NaN.
    finite = merged.masked_fill(merged == -math.inf, 0.0)
    out.mul_(torch.exp(lse - finite).unsqueeze(-1))
    out.add_(torch.exp(block_lse.to(lse.dtype) - finite).unsqueeze(-1) * block_out.to(out.dtype))
    lse.copy_(merged)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """What the backward knows of this rank's rows: (B, Hq, 2C, D) ``out`` and ``grad_out``, (B, Hq, 2C) the rest.

    ``out``, ``lse`` are the merged forward results (``lse = -inf``: a row
    that saw nothing); all in the accumulation dtype. ``compute_dtype`` and
    ``autocast`` are the forward's (:func:`_autocast_state`).
    """

    out: Tensor
    lse: Tensor
    grad_out: Tensor
    grad_lse: Tensor
    compute_dtype: torch.dtype
    autocast: tuple[str, bool, torch.dtype]


def _block_backward(block: _Block, inputs: list[Tensor], rows: _Rows, ring: _Ring) -> tuple[Tensor, ...]:
    """One block's share of the gradients: dq (b, Hq, rows, D), dk, dv (b, Hk, cols, D), and on the
    diagonal d depth_k, d depth_v (b, Hk, rows, L, D), by the backend that ran the block's forward."""
    b, r = block.batch, block.rows
    q, kv, *depth = (t.to(rows.compute_dtype) for t in inputs)
    grads = backends.merged_backward(
        block.backend or ring.backend, q, kv[0], kv[1], *(depth or (None, None)), block.variant, ring.scale,
        out=rows.out[b, :, r], lse=rows.lse[b, :, r], grad_out=rows.grad_out[b, :, r], grad_lse=rows.grad_lse[b, :, r],
    )  # fmt: skip
    if grads is None:  # flex: no given lse
        return _recomputed_block_backward(block, inputs, rows, ring)
    return grads if block.depth else grads[:3]


def _recomputed_block_backward(block: _Block, inputs: list[Tensor], rows: _Rows, ring: _Ring) -> tuple[Tensor, ...]:
    """Run one block forward again and differentiate it: for a backend that takes no given lse (flex).

    The block's output enters the row's output with weight ``w = exp(lse_block - lse)``,
    so its upstream gradients are ``w * grad_out`` for its output and
    ``w * (grad_out . (out_block - out) + grad_lse)`` for its lse.
    """
    b, r = block.batch, block.rows
    inputs = [t.detach().requires_grad_() for t in inputs]
    device_type, enabled, dtype = rows.autocast
    with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
        q_rows, kv_cols, *depth = inputs
        block_out, block_lse = _attend(block, q_rows, kv_cols, *(depth or (None, None)), ring)
    # Rows that saw nothing have lse = -inf: a finite stand-in makes their block weights exp(-inf) = 0.
    lse = rows.lse[b, :, r]
    lse = lse.masked_fill(lse == -math.inf, 0.0)
    weight = torch.exp(block_lse.to(lse.dtype) - lse)  # (b, Hq, rows)
    row_grad = rows.grad_out[b, :, r]
    share = ((block_out.detach().to(lse.dtype) - rows.out[b, :, r]) * row_grad).sum(-1)
    upstream = (
        (weight.unsqueeze(-1) * row_grad).to(block_out.dtype),
        (weight * (share + rows.grad_lse[b, :, r])).to(block_lse.dtype),
    )
    grads = torch.autograd.grad((block_out, block_lse), inputs, upstream, allow_unused=True, materialize_grads=True)
    q_grad, kv_grad, *depth_grads = grads
    return (q_grad, kv_grad[0], kv_grad[1], *depth_grads)


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """The caller's autocast, for recomputing the blocks in backward under the same one."""
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
