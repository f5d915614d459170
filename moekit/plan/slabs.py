"""The batched format's plan: one call over every expert's slab (``SlabPlanner``, ``SlabPlan``)."""

from __future__ import annotations

import torch

from moekit.plan.base import Batch, _Plan
from moekit.plan.chunks import SlabChunk
from moekit.types import ExpertsCall, WorkspaceShapes


class SlabPlanner:
    """The batched format: one call over every expert slab."""

    name = "slabs"
    chunk_size = None

    def plan(self, experts, batch: Batch, pool) -> SlabPlan:
        return SlabPlan(self, experts, batch, pool)


class SlabPlan(_Plan):
    def __init__(self, planner: SlabPlanner, experts, batch: Batch, pool):
        super().__init__(planner, experts, batch)
        meta = batch.prepared.tokens_meta
        self.whole = experts.workspace_shapes(batch.problem, act_dtype=batch.prepared.a1q.dtype, tokens_meta=meta)
        self.output = pool.output(self.whole.output, batch.out_dtype)
        self.chunks, self.single = (SlabChunk(0, 0, batch.problem.M),), True

    def shapes(self, chunk: SlabChunk, meta) -> WorkspaceShapes:
        return self.whole

    def declared_once(self) -> WorkspaceShapes:
        return self.whole

    def chunk_ids(self, chunk: SlabChunk) -> torch.Tensor:
        return self.batch.prepared.topk_ids

    def backend(self, chunk: SlabChunk) -> str:
        return self.experts.backend_for(self.batch.problem)

    def run(self, experts, call: ExpertsCall) -> str:
        return experts.apply(call)
