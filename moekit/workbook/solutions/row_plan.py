"""Exercise 6: a chunk plan along the sorted rows, so each expert's weights are read about once."""

from __future__ import annotations

from moekit.types import ALIGN_M


def row_chunk_plan(counts, R, block=ALIGN_M):
    """``[(start, end), ...]`` of sorted-layout rows, at most R each (R a multiple of ``block``),
    covering every expert's padded run (expert e's rows come after expert e-1's)."""
    total = sum((int(c) + block - 1) // block * block for c in counts)
    return [(s, min(s + R, total)) for s in range(0, total, R)]
