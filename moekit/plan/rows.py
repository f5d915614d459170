"""Chunks of expert-sorted rows (``chunk_by="rows"``, moekit's own plan): ``RowPlanner`` and ``RowPlan``."""

from __future__ import annotations

import torch

from moekit.errors import ChunkSizeError, InvalidInputError
from moekit.plan.base import Batch, _Plan
from moekit.plan.chunks import RowChunk
from moekit.types import ALIGN_M, ExpertsCall, WorkspaceShapes


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


class RowPlan(_Plan):
    def __init__(self, planner: RowPlanner, experts, batch: Batch, pool):
        # Imported here, not above: ``import moekit`` imports this package, and must load no kernel
        # module (Triton kernels load on first use; tests/test_device.py checks). Not a cycle.
        from moekit.kernels.align import launch_align

        super().__init__(planner, experts, batch)
        p, ids, pl = batch.problem, batch.prepared.topk_ids, batch.placement
        self.layout = launch_align(ids, ALIGN_M, pl.global_num_experts, pl.expert_map, num_local_experts=
                                   pl.num_local_experts, keep_empty=True, stream=batch.stream)  # fmt: skip
        # The layout's length is a bound from sizes alone (no sync); chunks past its used rows find
        # no rows and return at once, on the device.
        total, R = (self.layout.sorted_token_ids.numel() if ids.numel() else 0), planner.chunk_size
        self.chunks = tuple(RowChunk(i, s, min(s + R, total), self.layout) for i, s in enumerate(range(0, total, R)))
        self.single = len(self.chunks) == 1
        self._shapes: dict[int, WorkspaceShapes] = {}  # rows -> shapes: every chunk but the last has R
        whole = self.shapes(self.chunks[0], None) if self.chunks else experts.row_workspace_shapes(
            R, p, act_dtype=batch.prepared.a1q.dtype)  # fmt: skip
        self.output = pool.output(whole.output, batch.out_dtype)
        self._counts = None

    def shapes(self, chunk: RowChunk, meta) -> WorkspaceShapes:
        shapes = self._shapes.get(chunk.size)
        if shapes is None:
            act = self.batch.prepared.a1q.dtype
            shapes = self._shapes[chunk.size] = self.experts.row_workspace_shapes(chunk.size, self.batch.problem,
                                                                                 act_dtype=act)  # fmt: skip
        return shapes

    def count(self, chunk: RowChunk) -> torch.Tensor:
        """This chunk's rows per local expert: a row of every chunk's counts, made by one launch."""
        if self._counts is None:
            from moekit.kernels.align_layout import launch_chunk_counts  # on first use, as launch_align above

            self._counts = launch_chunk_counts(self.layout, self.planner.chunk_size,
                                               self.batch.placement.num_local_experts, stream=self.batch.stream)
        return self._counts[chunk.index]

    def backend(self, chunk: RowChunk) -> str:
        return self.experts.backend_for(self.batch.problem.with_M(chunk.size))

    def run(self, experts, call: ExpertsCall) -> str:
        return experts.apply_rows(call)
