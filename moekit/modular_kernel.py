"""The chunked fused-MoE modular kernel (the behaviour fixed by vLLM PR #20392).

::

    [router] -> prepare (quantize, dispatch) -> experts, chunk by chunk -> finalize (combine)

    forward(hidden [M, K], w1, w2, topk_weights, topk_ids)
      prepared = prepare_finalize.prepare(...)              # a1q, scales, tokens_meta, ids
      output   = empty(experts.workspace_shapes(M).output)  # whole-batch, sliced per chunk
      for (s, e) in chunk_ranges(M, C):
          shapes = experts.workspace_shapes(M=e-s)          # per chunk: the bug-1 fix
          ws13, ws2 = pool.take(shapes)                     # reused memory, grows on demand
          meta = count_expert_num_tokens(ids[s:e])          # per chunk: the bug-2 fix
          backend = experts.apply(output[s:e], a1q[s:e], ..., ws13, ws2, meta)
          trace.append(ChunkRecord(s, e, backend, shapes, counts))
      return prepare_finalize.finalize(output, prepared)    # [M, K]

Two policies replay the pre-fix loop for teaching (:mod:`moekit.policies`); neither is the
default. The chunk loop existed in this form for about a month before the fix: #19168 added it
to the modular kernel on 2025-06-11, #20392 fixed it on 2025-07-10.

- ``workspace_policy="once"``: shapes declared once, for the first chunk, serve every chunk.
- ``metadata_policy="whole_batch"``: every chunk receives the whole batch's tokens per expert.

``guard=True`` (the default) adds moekit's own checks, which upstream did not have: a chunk whose
workspace layout or output slice differs from what its backend declared raises
WorkspaceShapeError before the experts run, and experts that consume ``tokens_meta`` check that
it describes their rows. ``guard=False`` runs as upstream did, so the failures are upstream's.

Batched-format experts take no chunks (their slabs are per expert, not per token): one call.

A second chunk plan, ``chunk_by="rows"`` (moekit's own), cuts the expert-sorted rows instead of
the tokens: see :mod:`moekit.row_plan`.
"""

from __future__ import annotations

import torch

from moekit.chunking import ChunkRange, chunk_ranges, slice_rows, slice_scales, validate_chunk_size
from moekit.errors import FormatMismatchError, InvalidInputError, MoekitError, QuantizationError, WorkspaceShapeError
from moekit.experts.base import Experts
from moekit.policies import (
    METADATA_POLICIES,
    WORKSPACE_POLICIES,
    DeclaredOnceWorkspaces,
    PerChunkWorkspaces,
    check_policy,
    chunk_metadata,
)
from moekit.prepare_finalize.base import PrepareFinalize
from moekit.row_plan import check_row_plan, expert_bytes, run_row_chunks
from moekit.trace import ChunkRecord, Trace
from moekit.types import ActivationFormat, ExpertPlacement, ExpertsCall, MoEWeights, Prepared, ProblemSize
from moekit.validate import check_id_range, check_moe_inputs, check_placement
from moekit.workspace import WorkspacePool

CHUNK_BY = ("tokens", "rows")


class ModularKernel:
    """prepare -> experts per chunk -> finalize.

    Args:
        prepare_finalize: a :class:`PrepareFinalize` (its activation format must match the
            experts' format; checked here).
        experts: an :class:`Experts`.
        chunk_size: tokens per chunk, or None for one chunk. None is the default because
            chunking only bounds workspace memory; it costs speed (each chunk re-reads the
            weights of the experts it touches), and upstream removed it in 2026 (#34086).
        chunk_by: ``"tokens"`` (chunks of C tokens, as upstream) or ``"rows"`` (chunks of
            ``chunk_size`` expert-sorted rows, a multiple of 128; see the module docstring). Needs
            experts with ``supports_row_chunks`` and ``workspace_policy="per_chunk"``.
        workspace_policy: ``"per_chunk"`` (the fix) or ``"once"`` (pre-fix, for teaching).
        metadata_policy: ``"per_chunk"`` (the fix) or ``"whole_batch"`` (pre-fix).
        guard: moekit's stricter checks (see the module docstring); False replays upstream.
        trace_counts: record tokens per expert for each chunk (one small count-kernel launch per
            chunk, shared with the per-chunk metadata; no host sync).
        pool: a :class:`WorkspacePool` to share between layers; by default each kernel has its own.

    A kernel (and a pool) serves one forward at a time: concurrent calls from several threads
    take turns on the pool's lock, so they are correct, not parallel.
    """

    def __init__(
        self,
        prepare_finalize: PrepareFinalize,
        experts: Experts,
        *,
        chunk_size: int | None = None,
        chunk_by: str = "tokens",
        workspace_policy: str = "per_chunk",
        metadata_policy: str = "per_chunk",
        guard: bool = True,
        trace_counts: bool = True,
        pool: WorkspacePool | None = None,
    ):
        if not isinstance(prepare_finalize, PrepareFinalize) or not isinstance(experts, Experts):
            raise InvalidInputError(
                f"need a PrepareFinalize and an Experts, got {type(prepare_finalize).__name__} "
                f"and {type(experts).__name__}"
            )
        if prepare_finalize.activation_format is not experts.activation_format:
            raise FormatMismatchError(
                f"{prepare_finalize.name} produces {prepare_finalize.activation_format.value} activations "
                f"but {experts.name} consumes {experts.activation_format.value} ones; pair Standard with "
                "Standard (NoEP/All2All + Triton/DeepGemm) and Batched with Batched"
            )
        if pool is not None and not isinstance(pool, WorkspacePool):
            raise InvalidInputError(f"pool must be a moekit.workspace.WorkspacePool or None, got {type(pool).__name__}")
        for name, value in (("guard", guard), ("trace_counts", trace_counts)):
            if not isinstance(value, bool):
                raise InvalidInputError(f"{name} must be a bool, got {value!r}")
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.chunk_size = validate_chunk_size(chunk_size)
        self.chunk_by = check_policy(chunk_by, CHUNK_BY, "chunk_by")
        self.workspace_policy = check_policy(workspace_policy, WORKSPACE_POLICIES, "workspace_policy")
        if self.chunk_by == "rows":
            check_row_plan(self.chunk_size, experts, self.workspace_policy)
        self.metadata_policy = check_policy(metadata_policy, METADATA_POLICIES, "metadata_policy")
        self.guard = guard
        self.trace_counts = trace_counts
        self.pool = pool
        self.last_trace: Trace | None = None

    def __repr__(self) -> str:
        return (
            f"ModularKernel({self.prepare_finalize!r}, {self.experts!r}, chunk_size={self.chunk_size}, "
            f"chunk_by={self.chunk_by!r}, workspace_policy={self.workspace_policy!r}, "
            f"metadata_policy={self.metadata_policy!r})"
        )

    # ----------------------------------------------------------------------------------------
    def forward(
        self,
        hidden: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        expert_map: torch.Tensor | None = None,
        global_num_experts: int | None = None,
        w1_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        a2_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the MoE layer; returns ``[M, K]`` in ``hidden``'s dtype.

        Args:
            hidden: ``[M, K]`` bf16/fp16/fp32 activations.
            w1, w2: ``[E_local, N, K]`` and ``[E_local, K, N/2]`` (fp8 with scales for fp8 block).
            topk_weights, topk_ids: ``[M, topk]``; ids are global, -1 marks an empty slot.
            expert_map: int ``[E_global]``, global -> local id, -1 for experts on other ranks.
            global_num_experts: E_global (defaults to the map's length, else E_local).
            w1_scale, w2_scale: 128x128 block scales for fp8 weights.
            a2_scale: optional static scale for requantizing the intermediate activations to fp8:
                per-tensor (one element) or per-token ``[M]`` (sliced per chunk).

        Raises:
            InvalidInputError, InvalidIdsError, QuantizationError: bad arguments (checked here,
                before anything is written, whatever M is).
            WorkspaceShapeError: an experts class declared buffers that do not fit a chunk.
        """
        try:
            weights, placement, problem = self._check(hidden, w1, w2, topk_weights, topk_ids, expert_map,
                                                      global_num_experts, w1_scale, w2_scale, a2_scale)  # fmt: skip
        except MoekitError as err:  # issue 25 (EP door): a collective stage tells its peers, so they raise too
            if self.prepare_finalize.collective:
                self.prepare_finalize.refuse(err)
            raise
        M, K = hidden.shape
        trace = Trace(M, self.chunk_size, self.experts.name, self.workspace_policy, self.metadata_policy,
                      chunk_by=self.chunk_by)  # fmt: skip
        self.last_trace = trace
        if M == 0 and not self.prepare_finalize.collective:  # upstream divided by zero here (#26523)
            return hidden.new_empty((0, K))
        pool = self._pool(hidden.device)
        with pool.lock:
            prepared = self.prepare_finalize.prepare(
                hidden, topk_weights, topk_ids, quant=self.experts.quant, placement=placement
            )
            out_dtype = self.experts.compute_dtype(hidden.dtype)
            if self.experts.activation_format is ActivationFormat.BATCHED:
                fused_out = self._run_batched(prepared, weights, placement, out_dtype, pool, trace)
            elif self.chunk_by == "rows":
                problem = self._rows_problem(prepared, weights, placement)
                fused_out = run_row_chunks(self, problem, prepared, weights, placement, out_dtype, a2_scale, pool,
                                           trace)  # fmt: skip
            else:
                fused_out = self._run_chunks(prepared, weights, placement, out_dtype, a2_scale, pool, trace)
            output = torch.empty((M, K), dtype=hidden.dtype, device=hidden.device)
            return self.prepare_finalize.finalize(fused_out, prepared, output=output)

    __call__ = forward

    # ----------------------------------------------------------------------------------------
    def _check(self, hidden, w1, w2, topk_weights, topk_ids, expert_map, global_num_experts,
               w1_scale, w2_scale, a2_scale) -> tuple[MoEWeights, ExpertPlacement, ProblemSize]:  # fmt: skip
        """Every argument, once, before anything runs (also when M is 0)."""
        check_moe_inputs(hidden, w1, w2, topk_weights, topk_ids)
        weights = MoEWeights(w1, w2, w1_scale, w2_scale)
        placement = check_placement(w1, expert_map, global_num_experts, hidden.device)
        if expert_map is not None and not self.experts.supports_expert_map:
            raise InvalidInputError(f"{self.experts.name} does not support an expert_map")
        check_id_range(topk_ids, placement.global_num_experts)
        E, N, K = w1.shape
        M, topk = topk_ids.shape
        problem = ProblemSize(M, N, K, topk, placement.global_num_experts, placement.num_local_experts)
        self.experts.check(problem, weights, a2_scale=a2_scale)
        if a2_scale is not None and a2_scale.numel() > 1 and self.chunk_by == "rows":
            raise QuantizationError(
                f"a per-token a2_scale ({tuple(a2_scale.shape)}) cannot follow rows sorted by expert "
                "(chunk_by='rows'); pass a per-tensor scale (one element)"
            )
        if a2_scale is not None and a2_scale.numel() > 1 and self.prepare_finalize.dispatches:
            raise QuantizationError(
                f"a per-token a2_scale ({tuple(a2_scale.shape)}) belongs to the caller's tokens, but "
                f"{self.prepare_finalize.name} hands the experts other rows (dispatched); pass a per-tensor "
                "scale (one element)"
            )
        return weights, placement, problem

    def _pool(self, device: torch.device) -> WorkspacePool:
        if self.pool is None:
            self.pool = WorkspacePool(device)
        return self.pool

    def _rows_problem(self, prepared: Prepared, weights: MoEWeights, placement: ExpertPlacement) -> ProblemSize:
        """The sizes the experts see: the rows after prepare (received rows, or slab height)."""
        _, N, K = weights.w1.shape
        if self.experts.activation_format is ActivationFormat.BATCHED:
            M, topk = prepared.a1q.shape[1], prepared.topk_ids.shape[1]  # max tokens per expert
        else:
            M, topk = prepared.a1q.shape[0], prepared.topk_ids.shape[1]
        return ProblemSize(M, N, K, topk, placement.global_num_experts, placement.num_local_experts)

    def _count(self, ids: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
        from moekit.kernels.count import count_expert_num_tokens

        return count_expert_num_tokens(ids, placement.num_local_experts, placement.expert_map)

    def _run_chunks(self, prepared, weights, placement, out_dtype, a2_scale, pool, trace) -> torch.Tensor:
        experts, act = self.experts, prepared.a1q.dtype
        problem = self._rows_problem(prepared, weights, placement)
        trace.expert_rows = problem.M
        whole = experts.workspace_shapes(problem, act_dtype=act, tokens_meta=prepared.tokens_meta)
        fused_out = torch.empty(whole.output, dtype=out_dtype, device=prepared.a1q.device)
        ranges = chunk_ranges(problem.M, self.chunk_size if experts.supports_chunking else None)
        workspaces = self._workspace_policy(problem, ranges, act, prepared)
        single = len(ranges) == 1
        for r in ranges:
            sub = problem.with_M(r.size)
            ids = prepared.topk_ids[r.start : r.end]
            counts = self._chunk_counts(ids, placement, prepared, single)
            meta = chunk_metadata(self.metadata_policy, prepared.tokens_meta, counts, single=single)
            own = experts.workspace_shapes(sub, act_dtype=act, tokens_meta=meta)
            given = workspaces.buffers_for(own, r, sub)
            out = slice_rows(fused_out, r, problem.M)
            if self.guard and tuple(out.shape) != own.output:
                raise WorkspaceShapeError(self._output_message(r, sub, own, whole, out, problem.M))
            buffers = pool.take(given)
            call = ExpertsCall(
                output=out, hidden=prepared.a1q[r.start : r.end],
                hidden_scale=slice_scales(prepared.a1q_scale, r.start, r.end), topk_ids=ids, weights=weights,
                workspace13=buffers.workspace13, workspace2=buffers.workspace2, problem=sub, shapes=own,
                placement=placement, tokens_meta=meta, a2_scale=slice_scales(a2_scale, r.start, r.end),
                guard=self.guard,
            )  # fmt: skip
            record = ChunkRecord(r.index, r.start, r.end, experts.backend_for(sub), given, tuple(out.shape),
                                 counts, needed=own, completed=False, expert_bytes=expert_bytes(weights))  # fmt: skip
            trace.chunks.append(record)
            record.backend = experts.apply(call)
            record.completed, record.note = True, experts.why(sub)
        trace.peak_workspace_bytes = pool.peak_bytes
        return fused_out

    def _workspace_policy(self, problem, ranges: list[ChunkRange], act, prepared):
        if self.workspace_policy == "per_chunk" or not ranges:
            return PerChunkWorkspaces()
        # The parent commit declared the workspaces once, for M = the chunk size.
        first = problem.with_M(ranges[0].size)
        declared = self.experts.workspace_shapes(first, act_dtype=act, tokens_meta=prepared.tokens_meta)
        return DeclaredOnceWorkspaces(declared, self.experts, self.guard)

    def _chunk_counts(self, ids, placement, prepared: Prepared, single: bool) -> torch.Tensor | None:
        """This chunk's tokens per local expert, counted at most once: for its metadata and its trace."""
        meta = prepared.tokens_meta
        if single and meta is not None:
            return meta.expert_num_tokens  # one chunk of every row: prepare's counts are its own
        needs_meta = meta is not None and self.metadata_policy == "per_chunk"
        if needs_meta or self.trace_counts:
            return self._count(ids, placement)
        return None

    def _output_message(self, r: ChunkRange, sub: ProblemSize, own, whole, out, M: int) -> str:
        return (
            f"{self.experts.name} declared output {own.output} for chunk {r.index} (tokens [{r.start}, "
            f"{r.end}), backend {self.experts.backend_for(sub)}), but the whole-batch output it declared "
            f"for M={M} ({whole.output}) slices to {tuple(out.shape)}. Every backend of a dispatching experts class "
            "must declare the same output layout, with dim 0 proportional to M (the second half of the "
            "PR #20392 fix). (moekit's guard; upstream asserted equal shapes after the fix.)"
        )

    def _run_batched(self, prepared, weights, placement, out_dtype, pool, trace) -> torch.Tensor:
        """Batched format: one call over every slab (no token dimension to chunk)."""
        problem = self._rows_problem(prepared, weights, placement)
        trace.expert_rows = problem.M
        meta = prepared.tokens_meta
        shapes = self.experts.workspace_shapes(problem, act_dtype=prepared.a1q.dtype, tokens_meta=meta)
        fused_out = torch.empty(shapes.output, dtype=out_dtype, device=prepared.a1q.device)
        buffers = pool.take(shapes)
        call = ExpertsCall(
            output=fused_out, hidden=prepared.a1q, hidden_scale=prepared.a1q_scale, topk_ids=prepared.topk_ids,
            weights=weights, workspace13=buffers.workspace13, workspace2=buffers.workspace2, problem=problem,
            shapes=shapes, placement=placement, tokens_meta=meta, guard=self.guard,
        )  # fmt: skip
        counts = meta.expert_num_tokens if meta is not None else None
        record = ChunkRecord(0, 0, problem.M, self.experts.backend_for(problem), shapes, tuple(fused_out.shape),
                             counts, completed=False)  # fmt: skip
        trace.chunks.append(record)
        record.backend = self.experts.apply(call)
        record.completed = True
        trace.peak_workspace_bytes = pool.peak_bytes
        return fused_out
