"""The align's output as the GEMMs read it: `AlignedBlocks`, its buffer's sizes, and chunk counts.

:class:`AlignedBlocks` views one int32 buffer; ``_AlignShape`` holds where each piece of it starts for
one size; ``launch_chunk_counts`` counts the pairs per expert in each chunk of the sorted rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekit.kernels.host_math import cdiv
from moekit.kernels.launch import LeanLauncher, int_spec


class AlignedBlocks:
    """The block layout the grouped GEMM walks (shapes: :mod:`moekit.kernels.align`).

    Only the first ``num_tokens_post_padded`` entries of ``sorted_token_ids`` and the first
    ``num_tokens_post_padded / block_m`` of ``expert_ids`` are used; the rest hold ``numel`` and
    -1. Sizes come from an upper bound, so nothing here needed a host sync. All three live in one
    int32 ``buffer`` (sorted ids at 0, expert ids at ``expert_offset``, the used rows at
    ``post_offset``); the kernels take the buffer and the offsets, so a launch makes no views.
    With ``counts`` asked for, the buffer also holds the pairs per local expert (``counts``).
    """

    def __init__(self, buffer: torch.Tensor, shape: _AlignShape):
        self.buffer, self.shape = buffer, shape
        self.max_padded, self.max_blocks, self.block_m, self.numel = shape.max_padded, shape.max_blocks, shape.block_m, shape.numel
        self.expert_offset, self.post_offset = shape.expert_off, shape.post_off

    def __repr__(self) -> str:
        return f"AlignedBlocks(numel={self.numel}, block_m={self.block_m}, max_padded={self.max_padded})"

    @functools.cached_property
    def sorted_token_ids(self) -> torch.Tensor:
        return self.buffer[: self.max_padded]

    @functools.cached_property
    def expert_ids(self) -> torch.Tensor:
        return self.buffer[self.expert_offset : self.expert_offset + self.max_blocks]

    @functools.cached_property
    def num_tokens_post_padded(self) -> torch.Tensor:
        return self.buffer[self.post_offset : self.post_offset + 1]

    @functools.cached_property
    def counts(self) -> torch.Tensor | None:
        """int32 ``[num_local]`` pairs per local expert (as ``count_expert_num_tokens``), or None."""
        sh = self.shape
        return self.buffer[sh.local_off : sh.local_off + sh.num_local] if sh.counts else None


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: cheap as (part of) a launch key
class _AlignShape:
    """Everything about one align launch that follows from the sizes alone (remembered per size)."""

    numel: int
    E: int
    num_local: int
    block_m: int
    counts: bool
    max_padded: int
    max_blocks: int
    expert_off: int
    post_off: int
    local_off: int
    counts_off: int
    totals_off: int
    size: int
    small: bool
    medium: bool
    num_tiles: int
    num_bins: int
    local_bins: int
    medium_local_bins: int
    tile: int
    scan_block: int
    owned: int
    spec: tuple  # the integer classes that select a compiled variant


def _round32(n: int) -> int:
    return -(-n // 32) * 32  # pieces of the buffer start on 128-byte boundaries


@triton.jit(do_not_specialize=["numel", "expert_off", "post_off"])  # they follow M: no recompiles
def _chunk_counts_kernel(
    # Pointers
    layout_ptr, out_ptr,
    # Sizes
    numel, expert_off, post_off, rows_per_chunk, num_local,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
):
    # One program per block of the layout: its live rows go to its chunk's count of its expert.
    b = tl.program_id(0)
    row0 = b * BLOCK_M
    if row0 < tl.load(layout_ptr + post_off):
        expert = tl.load(layout_ptr + expert_off + b)
        if expert >= 0:  # -1: another rank's expert (or kept empty slots)
            pairs = tl.load(layout_ptr + row0 + tl.arange(0, BLOCK_M))
            live = tl.sum((pairs < numel).to(tl.int32), axis=0)
            tl.atomic_add(out_ptr + (row0 // rows_per_chunk) * num_local + expert, live, sem="relaxed")


_CHUNK_COUNTS = LeanLauncher(_chunk_counts_kernel)


def launch_chunk_counts(blocks: AlignedBlocks, rows_per_chunk: int, num_local: int, *,
                        stream: tuple[int, int] | None = None) -> torch.Tensor:  # fmt: skip
    """int32 ``[num_chunks, num_local]``: the pairs of every local expert in each chunk of
    ``rows_per_chunk`` sorted rows of ``blocks`` (a multiple of ``blocks.block_m``); one launch for
    every chunk of a plan, no host sync. Rows past the used ones (and padding rows) count nothing."""
    num_chunks = cdiv(blocks.max_padded, rows_per_chunk)
    out = torch.zeros((num_chunks, num_local), dtype=torch.int32, device=blocks.buffer.device)
    if blocks.numel == 0 or num_chunks == 0:
        return out
    key = (blocks.block_m, int_spec(rows_per_chunk), int_spec(num_local))  # sizes that follow M are not specialized
    _CHUNK_COUNTS((blocks.max_blocks,), (blocks.buffer, out, blocks.numel, blocks.expert_offset, blocks.post_offset,
                                         rows_per_chunk, num_local), key=key, stream=stream,
                  constexprs=lambda: dict(BLOCK_M=blocks.block_m))  # fmt: skip
    return out


def max_padded_size(numel: int, num_buckets: int, block_m: int) -> int:
    """Rows the layout can need: every non-empty bucket (at most ``min(numel, buckets)``) pads
    by less than ``block_m``; rounded up to whole blocks."""
    bound = numel + min(numel, num_buckets) * (block_m - 1)
    return cdiv(bound, block_m) * block_m
