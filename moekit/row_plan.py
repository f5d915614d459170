"""The second chunk plan, ``ModularKernel(chunk_by="rows")``: chunks of expert-sorted rows.

::

      layout = moe_align_block_size(ids, 128)               # once: (token, slot) rows sorted by
                                                             # expert, each expert padded to 128
      for (s, e) in row_ranges(layout, R):                   # R sorted rows per chunk
          shapes = experts.row_workspace_shapes(e - s)       # per chunk, bounded by R
          meta = count_expert_num_tokens(ids of rows [s, e)) # the chunk's own counts
          experts.apply(rows [s, e) -> output[pairs of those rows])

Each chunk holds a contiguous run of experts, so every expert's weights are read about once
(twice for an expert cut by a boundary), while each token chunk reads again the weights of
every expert it touches. Every (token, slot) row lives in exactly one chunk and writes its own
row of the ``[M, topk, K]`` output, which finalize weights and sums: deterministic. The plan is
moekit's own; no upstream chunk loop cuts this axis.
"""

from __future__ import annotations

import torch

from moekit.chunking import ChunkRange
from moekit.errors import ChunkSizeError, InvalidInputError
from moekit.policies import chunk_metadata
from moekit.trace import ChunkRecord
from moekit.types import ExpertsCall, MoEWeights

ROW_BLOCK = 128  # rows per block of the sorted layout: DeepGEMM's m-alignment, and every Triton tile divides it


def expert_bytes(weights: MoEWeights) -> int:
    """Bytes of one expert's w1 and w2 (and their block scales): what a chunk reads per expert it touches."""
    total = sum(t[0].numel() * t.element_size() for t in (weights.w1, weights.w2) if t.shape[0])
    scales = sum(t[0].numel() * 4 for t in (weights.w1_scale, weights.w2_scale) if t is not None and t.shape[0])
    return total + scales


def check_row_plan(chunk_size, experts, workspace_policy: str) -> None:
    """Raise a named error unless the row plan can run: R a multiple of ROW_BLOCK, experts that
    take sorted-row chunks, and workspaces declared per chunk."""
    if chunk_size is None or chunk_size % ROW_BLOCK:
        raise ChunkSizeError(
            f"chunk_by='rows' needs chunk_size = sorted rows per chunk, a multiple of {ROW_BLOCK} (the "
            f"layout's block), got {chunk_size}"
        )
    if not experts.supports_row_chunks:
        raise InvalidInputError(f"{experts.name} does not support chunks of sorted rows (chunk_by='rows')")
    if workspace_policy != "per_chunk":
        raise InvalidInputError(
            f"chunk_by='rows' declares workspaces per chunk; workspace_policy must be 'per_chunk', "
            f"got {workspace_policy!r}"
        )


def run_row_chunks(kernel, problem, prepared, weights, placement, out_dtype, a2_scale, pool, trace) -> torch.Tensor:
    """The chunk loop of ``kernel`` (a ModularKernel) over R sorted rows at a time; ``problem``
    is the sizes the experts see (the rows after prepare)."""
    from moekit.kernels.align import moe_align_block_size
    from moekit.kernels.count import count_expert_num_tokens
    from moekit.kernels.fused_moe import RowChunk

    experts, act = kernel.experts, prepared.a1q.dtype
    trace.expert_rows = problem.M
    ids = prepared.topk_ids
    layout = moe_align_block_size(ids, ROW_BLOCK, placement.global_num_experts, placement.expert_map,
                                  num_local_experts=placement.num_local_experts, keep_empty=True)  # fmt: skip
    whole = experts.row_workspace_shapes(kernel.chunk_size, problem, act_dtype=act)
    fused_out = torch.empty(whole.output, dtype=out_dtype, device=prepared.a1q.device)
    # The layout's length is a bound from sizes alone (no sync); chunks past its used rows
    # find no rows and return at once, on the device.
    total = layout.sorted_token_ids.numel() if ids.numel() else 0
    padded_ids = torch.cat([ids.reshape(-1), ids.new_full((1,), -1)])  # a padding row's pair has no expert
    per_expert, R = expert_bytes(weights), kernel.chunk_size
    want_counts = prepared.tokens_meta is not None or kernel.trace_counts
    for r in [ChunkRange(i, s, min(s + R, total)) for i, s in enumerate(range(0, total, R))]:
        chunk_ids = padded_ids[layout.sorted_token_ids[r.start : r.end]]
        counts = None
        if want_counts:
            counts = count_expert_num_tokens(chunk_ids, placement.num_local_experts, placement.expert_map)
        meta = chunk_metadata(kernel.metadata_policy, prepared.tokens_meta, counts, single=False)
        shapes = experts.row_workspace_shapes(r.size, problem, act_dtype=act)
        buffers = pool.take(shapes)
        call = ExpertsCall(
            output=fused_out, hidden=prepared.a1q, hidden_scale=prepared.a1q_scale, topk_ids=ids, weights=weights,
            workspace13=buffers.workspace13, workspace2=buffers.workspace2, problem=problem, shapes=shapes,
            placement=placement, tokens_meta=meta, a2_scale=a2_scale, guard=kernel.guard, layout=layout,
            rows=RowChunk(r.start, r.end),
        )  # fmt: skip
        backend = experts.backend_for_rows(r.size, problem)
        record = ChunkRecord(r.index, r.start, r.end, backend, shapes, tuple(fused_out.shape), counts,
                             completed=False, expert_bytes=per_expert)  # fmt: skip
        trace.chunks.append(record)
        record.backend = experts.apply(call)
        record.completed, record.note = True, experts.why(problem)
    trace.peak_workspace_bytes = pool.peak_bytes
    return fused_out


__all__ = ["ROW_BLOCK", "check_row_plan", "expert_bytes", "run_row_chunks"]
