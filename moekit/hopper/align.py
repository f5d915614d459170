"""The align's fast paths: small inputs in one launch, and every launch without Triton's binding.

:mod:`moekit.kernels.align` aligns with three launches (count, scan, scatter). For a few pairs
each of those is mostly launch latency, so here:

- up to ``SMALL_MAX`` pairs (at most one tile: decode) one program does all three steps
  (``_align_one_launch_kernel`` with ``ONE_PROGRAM``);
- up to ``MEDIUM_MAX`` pairs one launch of ``numel / TILE`` programs, each counting all the pairs
  itself (the same kernel without it: steps 1 and 2 folded into 3);
- past that the book's three kernels run, launched by :class:`~moekit.hopper.launch.LeanLauncher`.

The one-launch kernel waits on the previous kernel with PDL (:mod:`moekit.hopper.pdl`). Every path
writes exactly the book's layout into the book's :class:`~moekit.kernels.align.AlignedBlocks` (the
buffer is sized by the book's :class:`~moekit.kernels.align.AlignShape`; the one-launch paths leave
its scratch counts unused).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekit.hopper.launch import LeanLauncher, int_spec
from moekit.hopper.pdl import pdl_begin
from moekit.kernels.align import (
    FILL_STEP,
    TILE,
    AlignedBlocks,
    AlignShape,
    align_count_kernel,
    align_scan_kernel,
    align_scatter_kernel,
    align_shape,
    bucket_of,
    fill_tail,
    pad,
    pad_owned,
    place,
    rank_in_tile,
)

SMALL_MAX = TILE  # up to this many pairs, one program does everything (at most TILE)
MEDIUM_MAX = 1024  # up to this many, one launch of numel / TILE programs (count and scan folded in)
_CHUNK = 1024  # pairs per histogram step of that launch
# Sizes change with every M: specializing on them (== 1, % 16) would only add compiles.
_SIZES = ["numel", "max_padded", "max_blocks"]


@triton.jit(do_not_specialize=_SIZES)
def _align_one_launch_kernel(
    # Pointers
    ids_ptr,
    map_ptr,
    out_ptr,
    # Sizes
    numel,
    E,
    num_local,
    max_padded,
    max_blocks,
    expert_off,
    post_off,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    HAS_MAP: tl.constexpr,
    KEEP_EMPTY: tl.constexpr,
    NUM_BINS: tl.constexpr,
    TILE: tl.constexpr,
    PAD_W: tl.constexpr,
    FILL: tl.constexpr,
    ONE_PROGRAM: tl.constexpr,
    CHUNK: tl.constexpr,  # (numel / TILE programs only, as OWNED)
    OWNED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)  # nothing is read before the previous kernel completes
    sorted_ptr = out_ptr
    expert_ids_ptr = out_ptr + expert_off
    post_ptr = out_ptr + post_off
    if ONE_PROGRAM:
        # All three steps in one program, for inputs of one tile (decode): one launch instead of three.
        offs = tl.arange(0, TILE)
        bins = tl.arange(0, NUM_BINS)
        bucket, expert = bucket_of(ids_ptr, map_ptr, offs, numel, E, num_local, HAS_MAP, KEEP_EMPTY, NUM_BINS - 1)
        keep = bucket <= E
        # A one-hot sum, not tl.histogram: a tile this small is spread thinner than one element per thread.
        totals = tl.sum(((bucket[:, None] == bins[None, :]) & (bins[None, :] <= E)).to(tl.int32), axis=0)
        padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        starts = tl.cumsum(padded, axis=0) - padded
        post = tl.sum(padded, axis=0)
        b = tl.where(keep, bucket, 0)
        pos = rank_in_tile(bucket, TILE)
        row = tl.gather(starts, b, 0) + pos
        place(sorted_ptr, expert_ids_ptr, offs, row, pos, expert, keep, BLOCK_M)
        # The last pair of each bucket writes the bucket's padding right after itself.
        total = tl.gather(totals, b, 0)
        n_pad = tl.where(keep & (pos == total - 1), tl.gather(padded, b, 0) - total, 0)
        pad(sorted_ptr, row + 1, n_pad, numel, PAD_W)
        tl.store(post_ptr, post)
        fill_tail(sorted_ptr, expert_ids_ptr, post, numel, max_padded, max_blocks, 0, 1, BLOCK_M, FILL)
    else:
        # The count and the scan folded into the scatter, for a few thousand pairs: every program
        # histograms all of them itself (the totals) and those before its tile (its offsets), so
        # one launch replaces three; the ids are re-read from L2, numel / TILE times in all.
        t = tl.program_id(0)
        nprog = tl.num_programs(0)
        drop = NUM_BINS - 1  # dropped pairs' bin, never a real bucket (NUM_BINS > E + 1)
        bins = tl.arange(0, NUM_BINS)
        totals = tl.zeros([NUM_BINS], dtype=tl.int32)
        before = tl.zeros([NUM_BINS], dtype=tl.int32)
        for c0 in range(0, numel, CHUNK):
            every = c0 + tl.arange(0, CHUNK)
            b_all, _ = bucket_of(ids_ptr, map_ptr, every, numel, E, num_local, HAS_MAP, KEEP_EMPTY, drop)
            totals += tl.histogram(b_all, NUM_BINS)
            before += tl.histogram(tl.where(every < t * TILE, b_all, drop), NUM_BINS)
        totals = tl.where(bins <= E, totals, 0)
        padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        starts = tl.cumsum(padded, axis=0) - padded
        post = tl.sum(padded, axis=0)

        idx = t * TILE + tl.arange(0, TILE)
        bucket, expert = bucket_of(ids_ptr, map_ptr, idx, numel, E, num_local, HAS_MAP, KEEP_EMPTY, drop)
        keep = bucket <= E
        b = tl.where(keep, bucket, 0)
        pos = tl.gather(before, b, 0) + rank_in_tile(bucket, TILE)
        place(sorted_ptr, expert_ids_ptr, idx, tl.gather(starts, b, 0) + pos, pos, expert, keep, BLOCK_M)

        pad_owned(sorted_ptr, totals, padded, starts, t, nprog, numel, E, OWNED, PAD_W)
        if t == 0:
            tl.store(post_ptr, post)
        fill_tail(sorted_ptr, expert_ids_ptr, post, numel, max_padded, max_blocks, t, nprog, BLOCK_M, FILL)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per size (_path_of)
class _Path:
    """Which path one size takes, and what its launches need beyond the book's shape."""

    book: AlignShape  # sizes and offsets, as the book's launch_align computes them
    spec: tuple  # everything of these sizes that selects a compiled variant (the launch keys)
    programs: int  # of the one launch: 1 (small), numel / TILE (medium), or 0: the book's three launches
    consts: dict  # constexprs beyond the ids' flags: the one-launch kernel's (with warps), or the scatter's


@functools.lru_cache(maxsize=4096)
def _path_of(numel: int, E: int, num_local: int, block_m: int, small_max: int, medium_max: int) -> _Path:
    sh = align_shape(numel, E, num_local, block_m)
    small = numel <= min(small_max, TILE)
    medium = not small and numel <= medium_max
    tile = max(16, triton.next_power_of_2(numel)) if small else TILE  # pairs per program
    # Warps of the one-launch kernel. The one-program kernel on the H200 (E=128, graphs of the kernel alone,
    # µs for 1/2/4/8 warps, benchmarks/results/checks/align-small-warps-*): a 64-pair tile 6.2/3.5/4.9/4.9,
    # a 128-pair tile 13.6/7.2/4.7/15.1, 8-32 pairs best or level at 4; reproduced in a second round.
    warps = 8 if sh.num_bins > 256 else 2 if small and tile == 64 else 4
    # The constexprs that follow from the sizes, and how Triton specializes the specialized ints (the
    # others, do_not_specialize, only by their width: max_padded bounds numel and max_blocks).
    spec = (small, medium, block_m, tile, warps, sh.num_bins, sh.owned, sh.scan_block, sh.max_padded >= 2**31)
    spec += tuple(int_spec(v) for v in (E, num_local, sh.expert_off, sh.post_off, sh.counts_off, sh.totals_off))
    consts = dict(BLOCK_M=block_m, TILE=tile, PAD_W=max(16, block_m), FILL=FILL_STEP, OWNED=sh.owned)
    if not (small or medium):
        return _Path(sh, spec, 0, consts)
    return _Path(sh, spec, 1 if small else sh.num_tiles, dict(consts, CHUNK=_CHUNK, ONE_PROGRAM=small, num_warps=warps))


_ONE_LAUNCH = LeanLauncher(_align_one_launch_kernel, pdl=True)
_COUNT = LeanLauncher(align_count_kernel)
_SCAN = LeanLauncher(align_scan_kernel)
_SCATTER = LeanLauncher(align_scatter_kernel)


def launch_align(
    topk_ids: torch.Tensor,
    block_m: int,
    global_num_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    num_local_experts: int | None = None,
    keep_empty: bool = False,
    stream: tuple[int, int] | None = None,
) -> AlignedBlocks:
    """:func:`moekit.kernels.align.launch_align` (unchecked: callers checked with
    ``check_layout_args``), by the fastest path for its size; ``stream`` as from
    :func:`moekit.hopper.launch.launch_stream` (None: the current one)."""
    numel, E = topk_ids.numel(), global_num_experts
    num_local = num_local_experts if num_local_experts is not None else E
    path = _path_of(numel, E, num_local, block_m, SMALL_MAX, MEDIUM_MAX)
    sh = path.book
    buf = torch.empty(sh.size, dtype=torch.int32, device=topk_ids.device)
    out = AlignedBlocks(buf, sh)
    if numel == 0:
        out.num_tokens_post_padded.zero_()
        return out
    has_map = expert_map is not None
    flags = dict(HAS_MAP=has_map, KEEP_EMPTY=keep_empty, NUM_BINS=sh.num_bins)
    dims = (numel, E, num_local)
    # The ids may be a chunk's slice (any alignment), the map any int dtype; the buffer is fresh (aligned).
    map_spec = None if not has_map else (expert_map.dtype, expert_map.data_ptr() % 16 == 0)
    key = (path.spec, keep_empty, topk_ids.dtype, topk_ids.data_ptr() % 16 == 0, map_spec)
    ptrs = (topk_ids, expert_map, buf)
    consts = lambda: dict(flags, **path.consts)
    if path.programs:  # one launch: of one program, or of numel / TILE
        args = (*ptrs, *dims, sh.max_padded, sh.max_blocks, sh.expert_off, sh.post_off)
        _ONE_LAUNCH((path.programs,), args, key=key, stream=stream, constexprs=consts)
        return out
    grid = (sh.num_tiles,)
    offsets = (sh.expert_off, sh.post_off, sh.counts_off, sh.totals_off)
    args = (*ptrs, *dims, sh.num_tiles, sh.counts_off)
    _COUNT(grid, args, key=key, stream=stream, constexprs=lambda: dict(TILE=TILE, **flags))
    args = (buf, sh.num_tiles, sh.counts_off, sh.totals_off)
    _SCAN((E + 1,), args, key=key, stream=stream, constexprs=lambda: dict(BLOCK=sh.scan_block, num_warps=4))
    args = (*ptrs, *dims, sh.num_tiles, sh.max_padded, sh.max_blocks, *offsets)
    _SCATTER(grid, args, key=key, stream=stream, constexprs=consts)
    return out


__all__ = ["MEDIUM_MAX", "SMALL_MAX", "launch_align"]
