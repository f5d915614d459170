"""What every plan shares: the batch of one forward (``Batch``) and the base class of the plans (``_Plan``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.plan.chunks import Chunk
from moekit.types import ExpertsCall, Prepared, ProblemSize, WorkspaceShapes


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
    stream: tuple[int, int] | None


class _Plan:
    """What every plan does the same way; subclasses say how a chunk is sized, handed and run."""

    chunks: tuple
    output: torch.Tensor
    single: bool  # one chunk of every row: prepare's counts are the chunk's own
    fills_counts = False  # the experts' run path fills in the chunk's counts (Experts.counts_in_apply)

    def __init__(self, planner, experts, batch: Batch):
        self.planner, self.experts, self.batch = planner, experts, batch

    def count(self, chunk: Chunk) -> torch.Tensor:
        """This chunk's rows per local expert, on the device (one count launch)."""
        from moekit.kernels.count import launch_count  # on first use: `import moekit` loads no kernel module

        p = self.batch.placement
        return launch_count(self.chunk_ids(chunk), p.num_local_experts, p.expert_map, stream=self.batch.stream)

    def call(self, chunk: Chunk, buffers, shapes: WorkspaceShapes, counts, meta, *, fill_counts=False) -> ExpertsCall:
        """The whole batch, unsliced; the chunk names the rows to compute (rows and slabs: token
        chunks slice instead). ``fill_counts`` is not passed on: these plans' ``fills_counts`` is False."""
        pr, b = self.batch.prepared, self.batch
        return self._call(chunk, self.output, pr.a1q, pr.a1q_scale, pr.topk_ids, b.problem, buffers, shapes, counts,
                          meta, b.a2_scale, False)  # fmt: skip

    def _call(self, chunk, output, hidden, scale, ids, problem, buffers, shapes, counts, meta, a2, fill) -> ExpertsCall:
        b = self.batch
        return ExpertsCall(chunk, output, hidden, scale, ids, b.weights, buffers.workspace13, buffers.workspace2,
                           problem, shapes, b.placement, counts, meta, a2, b.guard, b.stream, fill)  # fmt: skip
