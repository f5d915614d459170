"""The chunked fused-MoE modular kernel (the behaviour fixed by vLLM PR #20392).

::

    [router] -> prepare (quantize, dispatch) -> experts, chunk by chunk -> finalize (combine)

    forward(hidden [M, K], w1, w2, topk_weights, topk_ids)
      prepared = prepare_finalize.prepare(...)              # a1q, scales, tokens_meta, ids
      plan = planner.plan(...)                              # chunks, and the whole-batch output
      for chunk in plan.chunks:                             # (s, e) in chunk_ranges(M, C)
          counts = count_expert_num_tokens(ids[s:e])        # per chunk: the bug-2 fix
          shapes = experts.workspace_shapes(M=e-s)          # per chunk: the bug-1 fix
          ws13, ws2 = pool.take(shapes)                     # reused memory, grows on demand
          backend = experts.apply(output[s:e], a1q[s:e], ..., ws13, ws2, counts)
          trace.add(chunk, backend, shapes, counts)
      return prepare_finalize.finalize(output, prepared)    # [M, K]

Two policies replay the pre-fix loop for teaching (the strategy classes at the end of this
file); neither is the default. The chunk loop existed in this form for about a month before the fix: #19168 added it
to the modular kernel on 2025-06-11, #20392 fixed it on 2025-07-10.

- ``workspace_policy="once"``: shapes declared once, for the first chunk, serve every chunk.
- ``metadata_policy="whole_batch"``: every chunk receives the whole batch's tokens per expert.

``guard=True`` (the default) adds moekit's own checks, which upstream did not have: a chunk whose
workspace layout or output slice differs from what its backend declared raises
WorkspaceShapeError before the experts run, and experts that consume ``tokens_meta`` check that
it describes their rows. ``guard=False`` runs as upstream did, so the failures are upstream's.

The plan is chosen once, in the constructor (:mod:`moekit.plan`): chunks of tokens (the seed's),
chunks of expert-sorted rows (``chunk_by="rows"``, moekit's own), or, for batched-format experts,
one call over every expert slab. The same loop runs them all. Arguments are checked once, at the
door (:meth:`ModularKernel.forward`); nothing inside the loop checks them again.
"""

from __future__ import annotations

import threading

import torch

from moekit.errors import FormatMismatchError, InvalidInputError, MoekitError, QuantizationError, WorkspaceShapeError
from moekit.experts.base import Experts
from moekit.plan import Batch, Chunk, RowPlanner, SlabPlanner, TokenPlanner, validate_chunk_size
from moekit.prepare_finalize.base import PrepareFinalize
from moekit.trace import Trace
from moekit.types import (
    ActivationFormat,
    ExpertPlacement,
    ExpertTokensMetadata,
    MoEWeights,
    Prepared,
    ProblemSize,
    WorkspaceShapes,
    problem_size,
)
from moekit.validate import (
    check_flag,
    check_id_range,
    check_kernel_device,
    check_moe_inputs,
    check_placement,
    check_scale_values,
)
from moekit.workspace import WorkspacePool

CHUNK_BY = ("tokens", "rows")


class ModularKernel:
    """prepare -> experts per chunk -> finalize.

    Args:
        prepare_finalize: a :class:`PrepareFinalize` (its activation format must match the
            experts' format; checked here).
        experts: an :class:`Experts` (its settings are read once, here).
        chunk_size: tokens per chunk, or None for one chunk. None is the default: chunking
            only bounds workspace memory and it costs speed (each chunk re-reads the weights of
            the experts it touches). Upstream removed the loop in 2026 (#34086), once chunked
            prefill had made it unnecessary (``moekit.history``).
        chunk_by: ``"tokens"`` (chunks of C tokens, as upstream) or ``"rows"`` (chunks of
            ``chunk_size`` expert-sorted rows, a multiple of 128; see :mod:`moekit.plan`). Needs
            experts with ``supports_row_chunks`` and ``workspace_policy="per_chunk"``.
        workspace_policy: ``"per_chunk"`` (the fix) or ``"once"`` (pre-fix, for teaching).
        metadata_policy: ``"per_chunk"`` (the fix) or ``"whole_batch"`` (pre-fix).
        guard: moekit's stricter checks (see the module docstring); False replays upstream.
        trace_counts: record tokens per expert for each chunk (the count kernel, launched once per
            chunk and shared with the per-chunk metadata; no host sync).
        pool: a :class:`WorkspacePool` to share between layers; by default each kernel has its own.

    A kernel (and a pool) serves one forward at a time: concurrent calls from several threads
    take turns on the pool's lock, so they are correct, not parallel. :attr:`last_trace` is per
    thread: each thread reads the trace of its own last call. Inference only: no gradient flows
    through the kernels, and a forward that would need one raises.
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
        self.guard, self.trace_counts = check_flag(guard, "guard"), check_flag(trace_counts, "trace_counts")
        chunk_size = validate_chunk_size(chunk_size)
        check_policy(chunk_by, CHUNK_BY, "chunk_by")
        check_policy(workspace_policy, WORKSPACE_POLICIES, "workspace_policy")
        check_policy(metadata_policy, METADATA_POLICIES, "metadata_policy")
        self.prepare_finalize, self.experts, self.pool, self.chunk_by = prepare_finalize, experts, pool, chunk_by
        self._given_pool = pool is not None  # a caller's pool is never replaced: a call on another device is refused
        if experts.activation_format is ActivationFormat.BATCHED and chunk_by == "tokens":
            self.planner = SlabPlanner()
        elif chunk_by == "rows":
            self.planner = RowPlanner(chunk_size, experts, workspace_policy)
        else:
            self.planner = TokenPlanner(chunk_size)
        self.chunk_size = chunk_size
        self.workspaces = (
            PerChunkWorkspaces() if workspace_policy == "per_chunk" else DeclaredOnceWorkspaces(experts, guard=guard)
        )
        self.metadata = METADATA_POLICIES[metadata_policy]()
        self._local = threading.local()

    @property
    def workspace_policy(self) -> str:
        return self.workspaces.name

    @property
    def metadata_policy(self) -> str:
        return self.metadata.name

    @property
    def last_trace(self) -> Trace | None:
        """The trace of this thread's last forward (None before one, or after a call refused at the door)."""
        return getattr(self._local, "trace", None)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_local"]  # traces stay with the process that made them
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

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
        expert_map: torch.Tensor | ExpertPlacement | None = None,
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
            expert_map: int ``[E_global]``, global -> local id, -1 for experts on other ranks; its
                values are read on every call. Or a ``moekit.owned_placement(map, E_local)``: a
                private copy checked once, so a forward reads nothing back for it.
            global_num_experts: E_global (defaults to the map's length, else E_local).
            w1_scale, w2_scale: 128x128 block scales for fp8 weights.
            a2_scale: optional static scale for requantizing the intermediate activations to fp8:
                per-tensor (one element) or per-token ``[M]`` (sliced per chunk); its values are read
                on every call, unless it is a ``moekit.owned_scale(scale)``.

        Raises:
            InvalidInputError, InvalidIdsError, QuantizationError: bad arguments (checked here,
                before anything is written, whatever M is). Under a collective prepare/finalize the
                other ranks are told, so that they raise too.
            WorkspaceShapeError: an experts class declared buffers that do not fit a chunk.
        """
        self._local.trace = None
        try:
            weights, placement, problem = self._door(
                hidden, w1, w2, topk_weights, topk_ids, expert_map, global_num_experts, w1_scale, w2_scale, a2_scale
            )
        except MoekitError as error:
            if self.prepare_finalize.collective:
                self.prepare_finalize.refuse(error)
            raise
        M, K = hidden.shape
        trace = Trace(
            M, self.chunk_size, self.experts.name, self.workspace_policy, self.metadata_policy, chunk_by=self.chunk_by
        )
        self._local.trace = trace
        if M == 0 and not self.prepare_finalize.collective:  # upstream divided by zero here (#26523)
            return hidden.new_empty((0, K))
        pool = self.pool if self._given_pool else self._own_pool(hidden.device)
        with pool.borrowed() as pool:
            pool.follow()
            prepared = self.prepare_finalize.prepare(
                hidden, topk_weights, topk_ids, quant=self.experts.quant, placement=placement
            )
            out_dtype = self.experts.compute_dtype(hidden.dtype)
            batch = Batch(
                prepared, weights, placement, self._rows_problem(prepared, problem), out_dtype, a2_scale, self.guard
            )
            fused_out = self._experts_pass(batch, pool, trace)
            output = torch.empty((M, K), dtype=hidden.dtype, device=hidden.device)
            return self.prepare_finalize.finalize(fused_out, prepared, output=output)

    __call__ = forward

    def _experts_pass(self, batch: Batch, pool: WorkspacePool, trace: Trace) -> torch.Tensor:
        """The loop of the module docstring: each chunk is counted, sized, handed its buffers, run and recorded."""
        plan = self.planner.plan(self.experts, batch, pool)
        trace.expert_rows, whole_meta = batch.problem.M, batch.prepared.tokens_meta
        for chunk in plan.chunks:
            counts = self._counts(plan, chunk, whole_meta)  # count_expert_num_tokens(ids[s:e]): bug 2's fix
            meta = self.metadata.tokens_meta(whole_meta, counts, single=plan.single)
            own = plan.shapes(chunk, meta)  # experts.workspace_shapes(M=e-s): bug 1's fix
            given = self.workspaces.given(own, chunk, plan)
            call = plan.call(chunk, pool.take(given), own, counts, meta)
            record = trace.add(chunk, plan.backend(chunk), given, own, call.output, counts, batch.weights.expert_bytes)
            backend = plan.run(self.experts, call)
            record.finish(backend, self.experts.why(call.problem))
        trace.peak_workspace_bytes = pool.peak_bytes
        return plan.output

    def _counts(self, plan, chunk, whole_meta) -> torch.Tensor | None:
        """This chunk's rows per local expert, counted once (for its metadata, its experts and its
        trace), or None when nobody asks. One chunk of every row keeps prepare's counts: they are its own."""
        if plan.single and whole_meta is not None:
            return whole_meta.expert_num_tokens
        if self.trace_counts or self.experts.uses_tokens_meta or (whole_meta is not None and self.metadata.recounts):
            return plan.count(chunk)
        return None

    # ----------------------------------------------------------------------------------------
    def _door(
        self, hidden, w1, w2, topk_weights, topk_ids, expert_map, global_num_experts, w1_scale, w2_scale, a2_scale
    ) -> tuple[MoEWeights, ExpertPlacement, ProblemSize]:
        """Every argument, once, before anything runs (also when M is 0)."""
        check_moe_inputs(hidden, w1, w2, topk_weights, topk_ids)
        if hidden.is_meta:  # no values to check there (the map's, the scales'): the device is the mistake
            check_kernel_device(hidden, "hidden")
        if hidden.dtype not in self.experts.act_dtypes:  # fp64 into a Triton GEMM was inf, silently
            names = ", ".join(str(d).removeprefix("torch.") for d in self.experts.act_dtypes)
            raise InvalidInputError(f"{self.experts.name} computes in {names}; hidden is {hidden.dtype}")
        weights = MoEWeights(w1, w2, w1_scale, w2_scale)
        collective = self.prepare_finalize.collective  # an all-to-all reads the map's values in its own exchange
        placement = check_placement(w1, expert_map, global_num_experts, hidden.device, values=not collective)
        if expert_map is not None and not self.experts.supports_expert_map:
            raise InvalidInputError(f"{self.experts.name} does not support an expert_map")
        check_id_range(topk_ids, placement.global_num_experts)
        E, N, K = w1.shape
        M, topk = topk_ids.shape
        problem = problem_size(M, N, K, topk, placement.global_num_experts, placement.num_local_experts)
        self.experts.check(problem, weights, a2_scale=a2_scale)
        if a2_scale is not None:
            check_scale_values(a2_scale, "a2_scale")
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
        check_kernel_device(hidden, "hidden")  # last, so that a call's other mistakes are named on any machine
        if self._given_pool:
            self.pool.check_device(hidden.device, whose="the pool given to this ModularKernel")
        return weights, placement, problem

    def _own_pool(self, device: torch.device) -> WorkspacePool:
        """This kernel's own pool, on the call's device (a call on another device gets a new one)."""
        pool = self.pool
        if pool is None or not pool.serves(device):
            pool = self.pool = WorkspacePool(device)
        return pool

    def _rows_problem(self, prepared: Prepared, problem: ProblemSize) -> ProblemSize:
        """The sizes the experts see: the caller's, or the rows after a dispatch (received rows, or
        the slab height of the batched format)."""
        if not self.prepare_finalize.dispatches:
            return problem
        rows = prepared.a1q.shape[1 if self.experts.activation_format is ActivationFormat.BATCHED else 0]
        return ProblemSize(
            rows,
            problem.N,
            problem.K,
            prepared.topk_ids.shape[1],
            problem.global_num_experts,
            problem.num_local_experts,
        )


# ----------------------------------------------------------------------------------------------
# What the loop hands each chunk: its workspaces and its tokens per expert.
#
# Each question has two answers, one small strategy each. The first is PR #20392's fix and the
# default; the second replays the parent commit (41060c6e0), for teaching:
#
# - workspaces: the fix computes workspace_shapes(M=e-s) per chunk, so each chunk gets what its
#   backend declared for its M; "once" calls workspace_shapes(M=C) once and every chunk carves its
#   caches out of those buffers (prefix views, as upstream's _resize_cache did).
# - tokens per expert: the fix recounts count_expert_num_tokens(ids[s:e]) per chunk; "whole_batch"
#   hands every chunk the counts that prepare returned for all M.
#
# Under "once" a smaller chunk of the same backend fits in the leading elements of the buffers
# declared for the first chunk, which is why the pre-fix loop worked until a dispatching experts
# class switched backend between chunks. moekit's guard (on by default) refuses a chunk whose own
# layout differs from the one declared once, before the experts run; with the guard off the chunk
# runs in those buffers, as upstream's did.


def same_layout(own: WorkspaceShapes, declared: WorkspaceShapes) -> bool:
    """Whether ``own`` is ``declared`` with at most as many rows: the same backend at a smaller M."""
    if own.dtype != declared.dtype:
        return False
    pairs = ((own.workspace13, declared.workspace13), (own.workspace2, declared.workspace2))
    return all(len(a) == len(b) and (not a or (a[1:] == b[1:] and a[0] <= b[0])) for a, b in pairs)


class PerChunkWorkspaces:
    """The fix: every chunk gets the buffers it declared."""

    name = "per_chunk"

    def given(self, own: WorkspaceShapes, chunk: Chunk, plan) -> WorkspaceShapes:
        return own


class DeclaredOnceWorkspaces:
    """Before the fix: the shapes declared for the first chunk serve every chunk."""

    name = "once"

    def __init__(self, experts, *, guard: bool):
        self.experts, self.guard = experts, guard  # the experts are named in the guard's message

    def given(self, own: WorkspaceShapes, chunk: Chunk, plan) -> WorkspaceShapes:
        declared = plan.declared_once()
        if self.guard and not same_layout(own, declared):
            raise WorkspaceShapeError(self._message(own, declared, chunk, plan))
        return declared

    def _message(self, own: WorkspaceShapes, d: WorkspaceShapes, chunk: Chunk, plan) -> str:
        return (
            f"workspace_policy='once': {self.experts.name} declared its workspaces once, for the first chunk, as "
            f"workspace13={d.workspace13}, workspace2={d.workspace2} ({d.dtype}). Chunk {chunk.index} "
            f"(tokens [{chunk.start}, {chunk.end}), M={chunk.size}) runs backend '{plan.backend(chunk)}', "
            f"which declares workspace13={own.workspace13}, workspace2={own.workspace2}. This is "
            "bug 1 of vLLM PR #20392: a dispatching experts class may change backend between "
            "chunks, so workspace shapes must be computed per chunk (workspace_policy='per_chunk'). "
            "(moekit's guard; upstream had no such check: ModularKernel(guard=False) replays it.)"
        )


class PerChunkCounts:
    """The fix: a chunk is handed its own tokens per expert (recounted; prepare's for one chunk of every row)."""

    name = "per_chunk"
    recounts = True

    def tokens_meta(self, whole: ExpertTokensMetadata | None, counts, *, single: bool) -> ExpertTokensMetadata | None:
        if whole is None or single:
            return whole
        # The CPU copy is blocking on purpose: consumers size buffers from it (upstream #20903).
        return ExpertTokensMetadata.from_counts(counts, with_cpu=whole.expert_num_tokens_cpu is not None)


class WholeBatchCounts:
    """Before the fix: every chunk is handed the counts prepare returned for the whole batch."""

    name = "whole_batch"
    recounts = False

    def tokens_meta(self, whole: ExpertTokensMetadata | None, counts, *, single: bool) -> ExpertTokensMetadata | None:
        return whole


WORKSPACE_POLICIES = ("per_chunk", "once")
METADATA_POLICIES = {"per_chunk": PerChunkCounts, "whole_batch": WholeBatchCounts}


def check_policy(value, allowed, name: str) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise InvalidInputError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value
