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

Two policies reproduce the pre-fix behaviour for teaching; neither is the default:

- ``workspace_policy="once"``: shapes are declared once, for the first (largest) chunk, and
  every chunk gets those buffers. A smaller last chunk of the same backend takes their leading
  rows, which is why this worked for years. But a dispatching experts class that picks another
  backend for the last chunk needs another layout, and the buffers no longer fit. The guard
  (``guard=True``) names the mismatch; ``guard=False`` lets the raw failure happen, as users
  met it.
- ``metadata_policy="whole_batch"``: every chunk receives the whole batch's tokens per expert.
  A consumer that sizes or masks by these counts then works on the wrong numbers.
"""

from __future__ import annotations

import torch

from moekit.chunking import ChunkRange, chunk_ranges, slice_rows, slice_scales, validate_chunk_size
from moekit.errors import FormatMismatchError, InvalidInputError, WorkspaceShapeError
from moekit.experts.base import Experts
from moekit.prepare_finalize.base import PrepareFinalize
from moekit.trace import ChunkRecord, Trace
from moekit.types import (
    ActivationFormat,
    ExpertPlacement,
    ExpertsCall,
    ExpertTokensMetadata,
    MoEWeights,
    Prepared,
    ProblemSize,
)
from moekit.validate import check_expert_map, check_moe_inputs
from moekit.workspace import WorkspacePool, fits_leading_rows, leading_rows, once_mismatch_message

WORKSPACE_POLICIES = ("per_chunk", "once")
METADATA_POLICIES = ("per_chunk", "whole_batch")


class ModularKernel:
    """prepare -> experts per chunk -> finalize.

    Args:
        prepare_finalize: a :class:`PrepareFinalize` (its activation format must match the
            experts' format; checked here).
        experts: an :class:`Experts`.
        chunk_size: tokens per chunk, or None for one chunk. None is the default because
            chunking only bounds workspace memory; it costs speed (each chunk re-reads the
            weights of the experts it touches), and upstream removed it in 2026 (#34086).
        workspace_policy: ``"per_chunk"`` (the fix) or ``"once"`` (pre-fix, for teaching).
        metadata_policy: ``"per_chunk"`` (the fix) or ``"whole_batch"`` (pre-fix).
        guard: under ``workspace_policy="once"``, turn a mismatch into WorkspaceShapeError
            before the experts run. False lets the raw failure through.
        trace_counts: record tokens per expert for each chunk (one small count-kernel launch per
            chunk, no host sync).
        pool: a :class:`WorkspacePool` to share between layers; by default each kernel has its own.
    """

    def __init__(
        self,
        prepare_finalize: PrepareFinalize,
        experts: Experts,
        *,
        chunk_size: int | None = None,
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
        if workspace_policy not in WORKSPACE_POLICIES:
            raise InvalidInputError(f"workspace_policy must be one of {WORKSPACE_POLICIES}, got {workspace_policy!r}")
        if metadata_policy not in METADATA_POLICIES:
            raise InvalidInputError(f"metadata_policy must be one of {METADATA_POLICIES}, got {metadata_policy!r}")
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.chunk_size = validate_chunk_size(chunk_size)
        self.workspace_policy = workspace_policy
        self.metadata_policy = metadata_policy
        self.guard = guard
        self.trace_counts = trace_counts
        self.pool = pool
        self.last_trace: Trace | None = None

    def __repr__(self) -> str:
        return (
            f"ModularKernel({self.prepare_finalize!r}, {self.experts!r}, chunk_size={self.chunk_size}, "
            f"workspace_policy={self.workspace_policy!r}, metadata_policy={self.metadata_policy!r})"
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
            a2_scale: optional static scale for requantizing the intermediate activations:
                per-tensor (one element) or per-token ``[M, ...]`` (sliced per chunk).

        Raises:
            InvalidInputError, InvalidIdsError, QuantizationError: bad arguments.
            WorkspaceShapeError: an experts class declared buffers that do not fit a chunk.
        """
        check_moe_inputs(hidden, w1, w2, topk_weights, topk_ids)
        weights = MoEWeights(w1, w2, w1_scale, w2_scale)
        weights.check(self.experts.quant)
        placement = self._placement(w1, expert_map, global_num_experts, hidden.device)
        if expert_map is not None and not self.experts.supports_expert_map:
            raise InvalidInputError(f"{self.experts.name} does not support an expert_map")
        M, K = hidden.shape
        trace = Trace(M, self.chunk_size, self.experts.name, self.workspace_policy, self.metadata_policy)
        self.last_trace = trace
        if M == 0 and not self.prepare_finalize.collective:  # upstream divided by zero here (#26523)
            return hidden.new_empty((0, K))

        prepared = self.prepare_finalize.prepare(
            hidden, topk_weights, topk_ids, quant=self.experts.quant, placement=placement
        )
        out_dtype = self.experts.compute_dtype(hidden.dtype)
        fused_out = self._run_experts(prepared, weights, placement, out_dtype, a2_scale, trace)
        output = torch.empty((M, K), dtype=hidden.dtype, device=hidden.device)
        return self.prepare_finalize.finalize(fused_out, prepared, output=output)

    __call__ = forward

    # ----------------------------------------------------------------------------------------
    @staticmethod
    def _placement(w1, expert_map, global_num_experts, device) -> ExpertPlacement:
        E_local = w1.shape[0]
        check_expert_map(expert_map, num_local_experts=E_local, device=device)
        E_global = global_num_experts
        if E_global is None:
            E_global = expert_map.numel() if expert_map is not None else E_local
        if expert_map is not None and expert_map.numel() != E_global:
            raise InvalidInputError(
                f"expert_map has {expert_map.numel()} entries but global_num_experts={E_global}"
            )
        if E_global < E_local:
            raise InvalidInputError(f"global_num_experts={E_global} < local experts {E_local}")
        return ExpertPlacement(E_global, E_local, expert_map)

    def _pool(self, device: torch.device) -> WorkspacePool:
        if self.pool is None:
            self.pool = WorkspacePool(device)
        return self.pool

    def _problem(self, prepared: Prepared, weights: MoEWeights, placement: ExpertPlacement) -> ProblemSize:
        E, N, K = weights.w1.shape
        a1q = prepared.a1q
        if self.experts.activation_format is ActivationFormat.BATCHED:
            M = a1q.shape[1]  # max tokens per expert
            topk = prepared.topk_ids.shape[1] if prepared.topk_ids.dim() == 2 else 1
        else:
            M, topk = a1q.shape[0], prepared.topk_ids.shape[1]
        return ProblemSize(M, N, K, topk, placement.num_global_experts, placement.num_local_experts)

    def _ranges(self, M: int) -> list[ChunkRange]:
        chunkable = self.experts.supports_chunking and self.experts.activation_format is ActivationFormat.STANDARD
        if not chunkable or M == 0:
            return [ChunkRange(0, 0, M)] if M else []
        return chunk_ranges(M, self.chunk_size)

    def _run_experts(self, prepared, weights, placement, out_dtype, a2_scale, trace) -> torch.Tensor:
        problem = self._problem(prepared, weights, placement)
        trace.expert_rows = problem.M
        experts, device = self.experts, prepared.a1q.device
        act_dtype = prepared.a1q.dtype
        whole = experts.workspace_shapes(problem, act_dtype=act_dtype, tokens_meta=prepared.tokens_meta)
        fused_out = torch.empty(whole.output, dtype=out_dtype, device=device)
        ranges = self._ranges(problem.M)
        if not ranges:  # this rank received no tokens
            return fused_out
        once = None
        if self.workspace_policy == "once":  # pre-fix: declared once, at the first chunk's M
            once = experts.workspace_shapes(
                problem.with_M(ranges[0].size), act_dtype=act_dtype, tokens_meta=prepared.tokens_meta
            )
        pool = self._pool(device)
        single = len(ranges) == 1
        for r in ranges:
            meta = prepared.tokens_meta if single else self._chunk_meta(prepared, placement, r)
            sub = problem.with_M(r.size)
            own = experts.workspace_shapes(sub, act_dtype=act_dtype, tokens_meta=meta)
            shapes = own if once is None else once
            views = pool.take(shapes)
            if once is not None and fits_leading_rows(own, once):
                # What upstream did before the fix, and why it usually worked: a smaller chunk of
                # the same backend takes the leading rows of the buffers declared once.
                views = leading_rows(views, own)
            elif once is not None and self.guard:
                raise WorkspaceShapeError(once_mismatch_message(experts, r, once, own, sub))
            out_slice = fused_out if single else slice_rows(fused_out, r, problem.M)
            if (once is None or self.guard) and tuple(out_slice.shape) != own.output:
                raise WorkspaceShapeError(
                    f"{experts.name} declared output {own.output} for chunk {r.index} (tokens "
                    f"[{r.start}, {r.end}), backend {experts.backend_for(sub)}), but the whole-batch "
                    f"output it declared for M={problem.M} ({whole.output}) slices to "
                    f"{tuple(out_slice.shape)}. Every backend of a dispatching experts class must "
                    "declare the same output layout, with dim 0 proportional to M."
                )
            call = ExpertsCall(
                output=out_slice,
                hidden=prepared.a1q[r.start : r.end] if not single else prepared.a1q,
                hidden_scale=slice_scales(prepared.a1q_scale, r.start, r.end),
                topk_ids=prepared.topk_ids[r.start : r.end] if not single else prepared.topk_ids,
                weights=weights,
                workspace13=views.workspace13,
                workspace2=views.workspace2,
                global_num_experts=placement.num_global_experts,
                expert_map=placement.expert_map,
                tokens_meta=meta,
                a2_scale=slice_scales(a2_scale, r.start, r.end),
            )
            backend = experts.apply(call)
            trace.chunks.append(
                ChunkRecord(r.index, r.start, r.end, backend, shapes, tuple(out_slice.shape),
                            self._trace_counts(call, placement, meta))
            )
        trace.peak_workspace_bytes = pool.peak_bytes
        return fused_out

    def _chunk_meta(self, prepared: Prepared, placement: ExpertPlacement, r: ChunkRange):
        meta = prepared.tokens_meta
        if meta is None or self.metadata_policy == "whole_batch":
            return meta
        from moekit.kernels.count import count_expert_num_tokens

        counts = count_expert_num_tokens(
            prepared.topk_ids[r.start : r.end], placement.num_local_experts, placement.expert_map
        )
        # The CPU copy is blocking on purpose: consumers size buffers from it (upstream #20903).
        return ExpertTokensMetadata.from_counts(counts, with_cpu=meta.expert_num_tokens_cpu is not None)

    def _trace_counts(self, call: ExpertsCall, placement: ExpertPlacement, meta):
        if not self.trace_counts:
            return None
        if self.experts.activation_format is ActivationFormat.BATCHED:
            return meta.expert_num_tokens if meta is not None else None
        from moekit.kernels.count import count_expert_num_tokens

        return count_expert_num_tokens(call.topk_ids, placement.num_local_experts, placement.expert_map)
