"""Chunk records and token ranges: which rows a chunk names, and the rows of a scale that belong to it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moekit.errors import ChunkSizeError

if TYPE_CHECKING:
    from moekit.kernels.align import AlignedBlocks


@dataclass(frozen=True)
class Chunk:
    """Rows ``[start, end)`` of chunk number ``index``; which rows depends on the kind of chunk."""

    index: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TokenChunk(Chunk):
    """Tokens ``[start, end)`` of the rows the experts see (the caller's, or those received)."""


@dataclass(frozen=True)
class RowChunk(Chunk):
    """Rows ``[start, end)`` of the batch's expert-sorted ``layout`` (128-row blocks)."""

    layout: AlignedBlocks = None


@dataclass(frozen=True)
class SlabChunk(Chunk):
    """Every slab of the batched format: rows ``[0, end)`` of each local expert's slab."""


def validate_chunk_size(chunk_size) -> int | None:
    """None (one chunk) or a positive int; anything else raises ChunkSizeError."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise ChunkSizeError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if chunk_size <= 0:
        raise ChunkSizeError(f"chunk_size must be > 0 (None means one chunk), got {chunk_size}")
    return chunk_size


def chunk_ranges(M: int, chunk_size: int | None) -> tuple[TokenChunk, ...]:
    """``[s, e)`` token chunks with ``e = min(s + C, M)``; M=0 gives no chunk, C=None one chunk.

    >>> [(c.start, c.end) for c in chunk_ranges(130, 128)]
    [(0, 128), (128, 130)]
    """
    C = validate_chunk_size(chunk_size)
    if isinstance(M, bool) or not isinstance(M, int) or M < 0:
        raise ChunkSizeError(f"M must be an int >= 0, got {M!r}")
    return _ranges(TokenChunk, M, C)


@functools.lru_cache(maxsize=512)  # a pure function of its arguments, asked for on every forward
def _ranges(kind, M: int, C: int | None) -> tuple:
    if M == 0:
        return ()
    if C is None or C >= M:
        return (kind(0, 0, M),)
    return tuple(kind(i, s, min(s + C, M)) for i, s in enumerate(range(0, M, C)))


def slice_scales(scale: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """The rows of a per-token or per-group scale that belong to ``[start, end)``.

    A per-tensor scale (one element) is shared by every chunk and passes whole. Upstream once
    sliced ``a2_scale`` with ``(end, end)`` and handed every chunk an empty scale (#28728).
    """
    if scale is None or scale.numel() == 1:
        return scale
    return scale[start:end]
