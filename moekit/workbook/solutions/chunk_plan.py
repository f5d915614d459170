"""Exercise 1: the chunk plan, and each chunk's views of the batch."""

from __future__ import annotations


def chunk_plan(M, C):
    """``[(start, end), ...]`` covering ``range(M)`` in steps of C (C=None: one chunk; M=0: none)."""
    if M == 0:
        return []
    step = M if C is None else C
    return [(s, min(s + step, M)) for s in range(0, M, step)]


def chunk_inputs(hidden, topk_ids, a_scale, start, end):
    """The chunk's rows of ``hidden`` and ``topk_ids`` (views), and its scale: the rows of a
    per-token scale, or the whole of a per-tensor one (one element, shared by every chunk)."""
    scale = a_scale if a_scale is None or a_scale.numel() == 1 else a_scale[start:end]
    return hidden[start:end], topk_ids[start:end], scale
