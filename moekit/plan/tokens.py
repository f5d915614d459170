"""Token chunks (``chunk_by="tokens"``, the seed's plan): ``TokenPlanner`` and the ``TokenPlan`` it makes."""

from __future__ import annotations

import torch

from moekit.errors import QuantizationError, WorkspaceShapeError
from moekit.plan.base import Batch, _Plan
from moekit.plan.chunks import TokenChunk, _ranges, slice_scales, validate_chunk_size
from moekit.types import ExpertsCall, ProblemSize, WorkspaceShapes


class TokenPlanner:
    """Chunks of ``chunk_size`` tokens (None: the whole batch), as the seed's loop."""

    name = "tokens"

    def __init__(self, chunk_size: int | None):
        self.chunk_size = validate_chunk_size(chunk_size)
        self._shapes: dict = {}  # (ProblemSize, dtype) -> WorkspaceShapes when no metadata is handed

    def plan(self, experts, batch: Batch, pool) -> TokenPlan:
        return TokenPlan(self, experts, batch, pool)

    # history hook: moekit.history.TokenPlannerBefore28728 overrides this to replay #24812's (e, e) slice.
    slice_a2 = staticmethod(slice_scales)

    def shapes(self, experts, problem: ProblemSize, act: torch.dtype, meta) -> WorkspaceShapes:
        """``experts.workspace_shapes``, remembered when it depends on the sizes alone (no metadata).

        Experts declare shapes as a function of their arguments; an experts object whose settings
        change after it was handed to a kernel is not supported.
        """
        if meta is not None:
            return experts.workspace_shapes(problem, act_dtype=act, tokens_meta=meta)
        key = (problem, act)
        shapes = self._shapes.get(key)
        if shapes is None:
            if len(self._shapes) > 512:
                self._shapes.clear()
            shapes = self._shapes[key] = experts.workspace_shapes(problem, act_dtype=act, tokens_meta=None)
        return shapes


class TokenPlan(_Plan):
    def __init__(self, planner: TokenPlanner, experts, batch: Batch, pool):
        super().__init__(planner, experts, batch)
        p, act = batch.problem, batch.prepared.a1q.dtype
        self.whole = planner.shapes(experts, p, act, batch.prepared.tokens_meta)
        self.output = pool.output(self.whole.output, batch.out_dtype)
        self.chunks = _ranges(TokenChunk, p.M, planner.chunk_size if experts.supports_chunking else None)
        self.single = len(self.chunks) == 1
        self.sizes = (p,) if self.single else tuple(p.with_M(c.size) for c in self.chunks)
        self.fills_counts = experts.counts_in_apply

    def shapes(self, chunk: TokenChunk, meta) -> WorkspaceShapes:
        if self.single and meta is self.batch.prepared.tokens_meta:
            return self.whole
        return self.planner.shapes(self.experts, self.sizes[chunk.index], self.batch.prepared.a1q.dtype, meta)

    def declared_once(self) -> WorkspaceShapes:
        """What the parent commit of PR #20392 declared once, for every chunk: the first chunk's shapes."""
        return self.shapes(self.chunks[0], self.batch.prepared.tokens_meta)

    def chunk_ids(self, chunk: TokenChunk) -> torch.Tensor:
        ids = self.batch.prepared.topk_ids
        return ids if self.single else ids[chunk.start : chunk.end]

    def backend(self, chunk: TokenChunk) -> str:
        return self.experts.backend_for(self.sizes[chunk.index])

    def call(self, chunk: TokenChunk, buffers, shapes: WorkspaceShapes, counts, meta, *, fill_counts=False):
        b, pr = self.batch, self.batch.prepared
        if self.single:
            out, hidden, scale, ids, a2 = self.output, pr.a1q, pr.a1q_scale, pr.topk_ids, b.a2_scale
        else:
            s, e = chunk.start, chunk.end
            factor = self.output.shape[0] // b.problem.M
            out, hidden, ids = self.output[s * factor : e * factor], pr.a1q[s:e], pr.topk_ids[s:e]
            scale, a2 = slice_scales(pr.a1q_scale, s, e), self.planner.slice_a2(b.a2_scale, s, e)
            if b.guard and a2 is not None and a2.numel() not in (1, e - s):  # moekit's guard (history: #28728)
                raise QuantizationError(f"chunk {chunk.index} (tokens [{s}, {e})) was handed {a2.numel()} a2 scales "
                                        f"for {e - s} tokens: a per-token a2_scale is sliced (s, e) per chunk. "
                                        "(moekit's guard; upstream's #24812 sliced (e, e), fixed by #28728)")
        if b.guard and out.shape != shapes.output:
            raise WorkspaceShapeError(self._output_message(chunk, shapes, out))
        return self._call(chunk, out, hidden, scale, ids, self.sizes[chunk.index], buffers, shapes, counts, meta, a2,
                          fill_counts)  # fmt: skip

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
