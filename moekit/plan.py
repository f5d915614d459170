"""Chunk plans: which rows each experts call of one forward computes.

A plan is a value: a tuple of :class:`Chunk` records plus what every chunk shares (the
whole-batch output, the sorted layout). :class:`moekit.ModularKernel` picks one planner in its
constructor and runs whatever plan it makes with one loop. Three planners:

- :class:`TokenPlanner`, the seed's plan (``chunk_by="tokens"``): chunks of C tokens,
  ``chunk_ranges(M, C)``. Each chunk re-reads the weights of every expert it touches; its
  workspaces scale with C. ``chunk_size=None`` (or experts that cannot chunk) is the whole
  batch as one chunk.
- :class:`RowPlanner`, moekit's own (``chunk_by="rows"``): align the whole batch once, then cut
  the expert-sorted rows into chunks of R::

      layout = moe_align_block_size(ids, 128)               # once: (token, slot) rows sorted by
                                                             # expert, each expert padded to 128
      for (s, e) in ranges(len(layout), R):                  # R sorted rows per chunk
          shapes = experts.row_workspace_shapes(e - s)       # per chunk, bounded by R
          experts.apply_rows(rows [s, e) -> output[pairs of those rows])

  Each chunk holds a contiguous run of experts, so every expert's weights are read about once
  (twice for an expert cut by a boundary). Every (token, slot) row lives in exactly one chunk and
  writes its own row of the ``[M, topk, K]`` output, which finalize weights and sums:
  deterministic. No upstream chunk loop cuts this axis.
- :class:`SlabPlanner` for the batched format: one call over every expert's slab (there is no
  token axis to cut).

Bug 1's and bug 2's fixes hold in every plan: shapes are declared per chunk (every plan asks the
experts for each chunk's shapes, in ``Plan.shapes``), and counts are the chunk's own.

The module reads in the order a forward uses it: the chunk records and the token ranges, the
batch every chunk shares (:class:`Batch`), what every plan does the same way (:class:`Plan`),
then each planner and the plan it makes (tokens, rows, slabs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moekit.errors import ChunkSizeError, InvalidInputError, QuantizationError, WorkspaceShapeError
from moekit.types import ALIGN_M, ExpertsCall, Prepared, ProblemSize, WorkspaceShapes

if TYPE_CHECKING:
    from moekit.kernels.align import AlignedBlocks


# ---------------------------------------------------------------------------------------------
# Chunk records: which rows a chunk names.


@dataclass(frozen=True)
class Chunk:
    """Rows ``[start, end)`` of chunk number ``index``; which rows depends on the kind of chunk."""

    index: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TokenChunk(Chunk):
    """Tokens ``[start, end)`` of the rows the experts see (the caller's, or those received)."""


@dataclass(frozen=True)
class RowChunk(Chunk):
    """Rows ``[start, end)`` of the batch's expert-sorted ``layout`` (128-row blocks)."""

    layout: AlignedBlocks = None


@dataclass(frozen=True)
class SlabChunk(Chunk):
    """Every slab of the batched format: rows ``[0, end)`` of each local expert's slab."""


# ---------------------------------------------------------------------------------------------
# Token ranges, and the rows of a scale that belong to one.


def chunk_ranges(M: int, chunk_size: int | None) -> tuple[TokenChunk, ...]:
    """``[s, e)`` token chunks with ``e = min(s + C, M)``; M=0 gives no chunk, C=None one chunk.

    >>> [(c.start, c.end) for c in chunk_ranges(130, 128)]
    [(0, 128), (128, 130)]
    """
    C = validate_chunk_size(chunk_size)
    if isinstance(M, bool) or not isinstance(M, int) or M < 0:
        raise ChunkSizeError(f"M must be an int >= 0, got {M!r}")
    return _ranges(TokenChunk, M, C)


def validate_chunk_size(chunk_size) -> int | None:
    """None (one chunk) or a positive int; anything else raises ChunkSizeError."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise ChunkSizeError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if chunk_size <= 0:
        raise ChunkSizeError(f"chunk_size must be > 0 (None means one chunk), got {chunk_size}")
    return chunk_size


@functools.lru_cache(maxsize=512)  # a pure function of its arguments, asked for on every forward
def _ranges(kind, M: int, C: int | None) -> tuple:
    if M == 0:
        return ()
    if C is None or C >= M:
        return (kind(0, 0, M),)
    return tuple(kind(i, s, min(s + C, M)) for i, s in enumerate(range(0, M, C)))


def slice_scales(scale: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """The rows of a per-token or per-group scale that belong to ``[start, end)``.

    A per-tensor scale (one element) is shared by every chunk and passes whole. From #24812 upstream
    sliced a per-token ``a2_scale`` with ``(end, end)``, handing every chunk an empty scale, until
    #28728 fixed it (``moekit.history``).
    """
    if scale is None or scale.numel() == 1:
        return scale
    return scale[start:end]


# ---------------------------------------------------------------------------------------------
# What every plan shares: the batch of one forward, and the base class of the plans.


@dataclass(slots=True)
class Batch:
    """What every chunk of one forward shares: prepare's result and the checked arguments."""

    prepared: Prepared
    weights: object  # MoEWeights
    placement: object  # ExpertPlacement
    problem: ProblemSize  # the sizes of the rows the experts see (after prepare)
    out_dtype: torch.dtype
    a2_scale: torch.Tensor | None
    guard: bool

    def call(self, chunk, output, hidden, scale, ids, problem, buffers, shapes, counts, meta, a2) -> ExpertsCall:
        """The :class:`~moekit.types.ExpertsCall` of one chunk of this batch: its rows (``hidden``, their
        ``scale`` and ``ids``, sized ``problem``), where they go, its buffers, counts and metadata; the
        weights, placement and guard are the batch's. Every plan (and ``moekit.testing.experts_call``)
        builds its calls here."""
        return ExpertsCall(
            chunk=chunk,
            output=output,
            hidden=hidden,
            hidden_scale=scale,
            topk_ids=ids,
            weights=self.weights,
            workspace13=buffers.workspace13,
            workspace2=buffers.workspace2,
            problem=problem,
            shapes=shapes,
            placement=self.placement,
            counts=counts,
            tokens_meta=meta,
            a2_scale=a2,
            guard=self.guard,
        )


class Plan:
    """What every plan does the same way; subclasses say how a chunk is sized, handed and run.

    The modular kernel's loop asks a plan, for each of its ``chunks``: ``count`` (the chunk's rows
    per local expert), ``shapes`` (the workspaces the experts declare for it), ``call`` (the
    :class:`~moekit.types.ExpertsCall` that hands it its rows and buffers), ``backend`` and ``run``.
    """

    chunks: tuple
    output: torch.Tensor
    single: bool  # one chunk of every row: prepare's counts are the chunk's own

    def __init__(self, planner, experts, batch: Batch):
        self.planner, self.experts, self.batch = planner, experts, batch

    def count(self, chunk: Chunk) -> torch.Tensor:
        """This chunk's rows per local expert, on the device (one launch of the count kernel)."""
        return self.experts.count_tokens(self.chunk_ids(chunk), self.batch.placement)

    def call(self, chunk: Chunk, buffers, shapes: WorkspaceShapes, counts, meta) -> ExpertsCall:
        """The whole batch, unsliced; the chunk names the rows to compute (rows and slabs: token
        chunks slice instead)."""
        pr, b = self.batch.prepared, self.batch
        return b.call(
            chunk, self.output, pr.a1q, pr.a1q_scale, pr.topk_ids, b.problem, buffers, shapes, counts, meta, b.a2_scale
        )


# ---------------------------------------------------------------------------------------------
# Token chunks (``chunk_by="tokens"``, the seed's plan).


class TokenPlanner:
    """Chunks of ``chunk_size`` tokens (None: the whole batch), as the seed's loop."""

    name = "tokens"

    def __init__(self, chunk_size: int | None):
        self.chunk_size = validate_chunk_size(chunk_size)

    def plan(self, experts, batch: Batch, pool) -> TokenPlan:
        return TokenPlan(self, experts, batch, pool)

    # history hook: moekit.history.TokenPlannerBefore28728 overrides this to replay #24812's (e, e) slice.
    slice_a2 = staticmethod(slice_scales)


class TokenPlan(Plan):
    def __init__(self, planner: TokenPlanner, experts, batch: Batch, pool):
        super().__init__(planner, experts, batch)
        p, act = batch.problem, batch.prepared.a1q.dtype
        self.whole = experts.workspace_shapes(p, act_dtype=act, tokens_meta=batch.prepared.tokens_meta)
        self.output = pool.output(self.whole.output, batch.out_dtype)
        self.chunks = _ranges(TokenChunk, p.M, planner.chunk_size if experts.supports_chunking else None)
        self.single = len(self.chunks) == 1
        self.sizes = (p,) if self.single else tuple(p.with_M(c.size) for c in self.chunks)

    def shapes(self, chunk: TokenChunk, meta) -> WorkspaceShapes:
        """What the experts declare for this chunk's own sizes and metadata (the bug-1 fix)."""
        act = self.batch.prepared.a1q.dtype
        return self.experts.workspace_shapes(self.sizes[chunk.index], act_dtype=act, tokens_meta=meta)

    def declared_once(self) -> WorkspaceShapes:
        """What the parent commit of PR #20392 declared once, for every chunk: the first chunk's shapes."""
        return self.shapes(self.chunks[0], self.batch.prepared.tokens_meta)

    def chunk_ids(self, chunk: TokenChunk) -> torch.Tensor:
        ids = self.batch.prepared.topk_ids
        return ids if self.single else ids[chunk.start : chunk.end]

    def backend(self, chunk: TokenChunk) -> str:
        return self.experts.backend_for(self.sizes[chunk.index])

    def call(self, chunk: TokenChunk, buffers, shapes: WorkspaceShapes, counts, meta) -> ExpertsCall:
        b, pr = self.batch, self.batch.prepared
        if self.single:
            out, hidden, scale, ids, a2 = self.output, pr.a1q, pr.a1q_scale, pr.topk_ids, b.a2_scale
        else:
            s, e = chunk.start, chunk.end
            factor = self.output.shape[0] // b.problem.M
            out, hidden, ids = self.output[s * factor : e * factor], pr.a1q[s:e], pr.topk_ids[s:e]
            scale, a2 = slice_scales(pr.a1q_scale, s, e), self.planner.slice_a2(b.a2_scale, s, e)
            if b.guard and a2 is not None and a2.numel() not in (1, e - s):  # moekit's guard (history: #28728)
                raise QuantizationError(
                    f"chunk {chunk.index} (tokens [{s}, {e})) was handed {a2.numel()} a2 scales "
                    f"for {e - s} tokens: a per-token a2_scale is sliced (s, e) per chunk. "
                    "(moekit's guard; upstream's #24812 sliced (e, e), fixed by #28728)"
                )
        if b.guard and out.shape != shapes.output:
            raise WorkspaceShapeError(self._output_message(chunk, shapes, out))
        problem = self.sizes[chunk.index]
        return b.call(chunk, out, hidden, scale, ids, problem, buffers, shapes, counts, meta, a2)

    def run(self, experts, call: ExpertsCall) -> str:
        return experts.apply(call)

    def _output_message(self, chunk: TokenChunk, own: WorkspaceShapes, out: torch.Tensor) -> str:
        M = self.batch.problem.M
        return (
            f"{self.experts.name} declared output {own.output} for chunk {chunk.index} (tokens [{chunk.start}, "
            f"{chunk.end}), backend {self.backend(chunk)}), but the whole-batch output it declared for M={M} "
            f"({self.whole.output}) slices to {tuple(out.shape)}. Every backend of a dispatching experts class "
            "must declare the same output layout, with dim 0 proportional to M (the second half of the "
            "PR #20392 fix). (moekit's guard; upstream asserted equal shapes after the fix.)"
        )


# ---------------------------------------------------------------------------------------------
# Chunks of expert-sorted rows (``chunk_by="rows"``, moekit's own plan).


class RowPlanner:
    """Chunks of ``rows`` expert-sorted rows (a multiple of 128); see :mod:`moekit.plan`."""

    name = "rows"

    def __init__(self, rows, experts, workspace_policy: str):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0 or rows % ALIGN_M:
            raise ChunkSizeError(
                f"chunk_by='rows' needs chunk_size = sorted rows per chunk, a positive multiple of {ALIGN_M} "
                f"(the layout's block), got {rows!r}"
            )
        if not experts.supports_row_chunks:
            raise InvalidInputError(f"{experts.name} does not support chunks of sorted rows (chunk_by='rows')")
        if workspace_policy != "per_chunk":
            raise InvalidInputError(
                f"chunk_by='rows' declares workspaces per chunk; workspace_policy must be 'per_chunk', "
                f"got {workspace_policy!r}"
            )
        self.chunk_size = rows

    def plan(self, experts, batch: Batch, pool) -> RowPlan:
        return RowPlan(self, experts, batch, pool)


class RowPlan(Plan):
    def __init__(self, planner: RowPlanner, experts, batch: Batch, pool):
        # Imported here, not above: ``import moekit`` imports this module, and must load no kernel
        # module (Triton kernels load on first use; tests/test_device.py checks). Not a cycle.
        from moekit.kernels.align import launch_align

        super().__init__(planner, experts, batch)
        p, ids, pl = batch.problem, batch.prepared.topk_ids, batch.placement
        self.layout = launch_align(
            ids, ALIGN_M, pl.global_num_experts, pl.expert_map, num_local_experts=pl.num_local_experts, keep_empty=True
        )
        # The layout's length is a bound from sizes alone (no sync); chunks past its used rows find
        # no rows and return at once, on the device.
        total, R = (self.layout.sorted_token_ids.numel() if ids.numel() else 0), planner.chunk_size
        self.chunks = tuple(RowChunk(i, s, min(s + R, total), self.layout) for i, s in enumerate(range(0, total, R)))
        self.single = len(self.chunks) == 1
        rows = self.chunks[0].size if self.chunks else R  # the output is the whole batch's, whatever the rows
        whole = experts.row_workspace_shapes(rows, p, act_dtype=batch.prepared.a1q.dtype)
        self.output = pool.output(whole.output, batch.out_dtype)
        self._counts = None

    def shapes(self, chunk: RowChunk, meta) -> WorkspaceShapes:
        """What the experts declare for this chunk's count of sorted rows (at most R)."""
        act = self.batch.prepared.a1q.dtype
        return self.experts.row_workspace_shapes(chunk.size, self.batch.problem, act_dtype=act)

    def count(self, chunk: RowChunk) -> torch.Tensor:
        """This chunk's rows per local expert: a row of every chunk's counts, made by one launch."""
        if self._counts is None:
            from moekit.kernels.align import launch_chunk_counts  # on first use, as launch_align above

            num_local = self.batch.placement.num_local_experts
            self._counts = launch_chunk_counts(self.layout, self.planner.chunk_size, num_local)
        return self._counts[chunk.index]

    def backend(self, chunk: RowChunk) -> str:
        return self.experts.backend_for(self.batch.problem.with_M(chunk.size))

    def run(self, experts, call: ExpertsCall) -> str:
        return experts.apply_rows(call)


# ---------------------------------------------------------------------------------------------
# The batched format's plan: one call over every expert's slab.


class SlabPlanner:
    """The batched format: one call over every expert slab."""

    name = "slabs"
    chunk_size = None

    def plan(self, experts, batch: Batch, pool) -> SlabPlan:
        return SlabPlan(self, experts, batch, pool)


class SlabPlan(Plan):
    def __init__(self, planner: SlabPlanner, experts, batch: Batch, pool):
        super().__init__(planner, experts, batch)
        meta = batch.prepared.tokens_meta
        self.whole = experts.workspace_shapes(batch.problem, act_dtype=batch.prepared.a1q.dtype, tokens_meta=meta)
        self.output = pool.output(self.whole.output, batch.out_dtype)
        self.chunks, self.single = (SlabChunk(0, 0, batch.problem.M),), True

    def shapes(self, chunk: SlabChunk, meta) -> WorkspaceShapes:
        act = self.batch.prepared.a1q.dtype
        return self.experts.workspace_shapes(self.batch.problem, act_dtype=act, tokens_meta=meta)

    def declared_once(self) -> WorkspaceShapes:
        return self.whole

    def chunk_ids(self, chunk: SlabChunk) -> torch.Tensor:
        return self.batch.prepared.topk_ids

    def backend(self, chunk: SlabChunk) -> str:
        return self.experts.backend_for(self.batch.problem)

    def run(self, experts, call: ExpertsCall) -> str:
        return experts.apply(call)
