"""Pure functions for splitting M tokens into chunks and slicing per-chunk inputs.

Why chunk at all? A fused-MoE layer's workspaces scale with M x topk x N. Chunking bounds them by
C instead of M (and, upstream, kept 32-bit index arithmetic in range at very large M). The cost
is more, smaller GEMMs, which re-read the same expert weights once per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.errors import ChunkSizeError


@dataclass(frozen=True)
class ChunkRange:
    """Tokens ``[start, end)`` of chunk number ``index``."""

    index: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def validate_chunk_size(chunk_size) -> int | None:
    """None (one chunk) or a positive int; anything else raises ChunkSizeError."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise ChunkSizeError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if chunk_size <= 0:
        raise ChunkSizeError(f"chunk_size must be > 0 (None means one chunk), got {chunk_size}")
    return chunk_size


def chunk_ranges(M: int, chunk_size: int | None) -> list[ChunkRange]:
    """``[s, e)`` ranges with ``e = min(s + C, M)``; M=0 gives no chunk, C=None one chunk.

    >>> [(r.start, r.end) for r in chunk_ranges(130, 128)]
    [(0, 128), (128, 130)]
    """
    C = validate_chunk_size(chunk_size)
    if M < 0:
        raise ChunkSizeError(f"M must be >= 0, got {M}")
    if M == 0:
        return []
    if C is None or C >= M:
        return [ChunkRange(0, 0, M)]
    return [ChunkRange(i, s, min(s + C, M)) for i, s in enumerate(range(0, M, C))]


def slice_scales(scale: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """The rows of a per-token or per-group scale that belong to ``[start, end)``.

    A per-tensor scale (one element) is shared by every chunk and passes whole. Upstream once
    sliced ``a2_scale`` with ``(end, end)`` and handed every chunk an empty scale (#28728).
    """
    if scale is None or scale.numel() == 1:
        return scale
    return scale[start:end]


def slice_rows(t: torch.Tensor, r: ChunkRange, M: int) -> torch.Tensor:
    """Rows of ``t`` for chunk ``r``, where dim 0 of ``t`` is ``M * factor`` (factor >= 1)."""
    if M == 0:
        return t[:0]
    factor = t.shape[0] // M
    return t[r.start * factor : r.end * factor]
