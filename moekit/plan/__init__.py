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

Bug 1's and bug 2's fixes hold in every plan: shapes are declared per chunk, and counts are the
chunk's own.

One module per family: ``chunks`` (the records, ``chunk_ranges``, ``slice_scales``), ``base``
(``Batch`` and the plans' common base), ``tokens``, ``rows`` and ``slabs`` (one planner and its
plan each). The public names are re-exported here: import them from ``moekit.plan``.
"""

from moekit.plan.base import Batch
from moekit.plan.chunks import Chunk, RowChunk, SlabChunk, TokenChunk, chunk_ranges, slice_scales, validate_chunk_size
from moekit.plan.rows import RowPlan, RowPlanner
from moekit.plan.slabs import SlabPlan, SlabPlanner
from moekit.plan.tokens import TokenPlan, TokenPlanner

__all__ = [
    "Batch",
    "Chunk",
    "RowChunk",
    "RowPlan",
    "RowPlanner",
    "SlabChunk",
    "SlabPlan",
    "SlabPlanner",
    "TokenChunk",
    "TokenPlan",
    "TokenPlanner",
    "chunk_ranges",
    "slice_scales",
    "validate_chunk_size",
]
