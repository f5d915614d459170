"""The Triton kernels behind :func:`moekit.kernels.align.moe_align_block_size`.

The module docstring of :mod:`moekit.kernels.align` describes the algorithm: a one-program path
(``_align_small_kernel``) for inputs of one tile, and count / scan / scatter kernels for larger
ones. The launcher, its checks and the tile sizes live there; these kernels take them as
arguments.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Sizes change with every M: specializing on them (== 1, % 16) would only add compiles.
_SIZES = ["numel", "num_tiles", "max_padded", "max_blocks"]


@triton.jit
def _bucket_of(ids_ptr, map_ptr, idx, numel, E, num_local, HAS_MAP: tl.constexpr, KEEP_EMPTY: tl.constexpr, DROP):
    """(bucket, local expert) of each pair: bucket g with g's local id for a local expert; E with
    -1 for a remote one (or a kept empty slot); DROP for a dropped one."""
    live = idx < numel
    g = tl.load(ids_ptr + idx, mask=live, other=-1)
    # Compare in the ids' own dtype: an int64 id cast to int32 first could wrap into range.
    valid = live & (g >= 0) & (g < E)
    if HAS_MAP:
        e = tl.load(map_ptr + tl.where(valid, g, 0), mask=valid, other=-1).to(tl.int32)
        local = valid & (e >= 0) & (e < num_local)
    else:
        e = g.to(tl.int32)
        local = valid & (g < num_local)
    bucket = tl.where(local, g, E).to(tl.int32)
    if KEEP_EMPTY:
        bucket = tl.where(live, bucket, DROP)
    else:
        bucket = tl.where(valid, bucket, DROP)
    return bucket, tl.where(local, e, -1)


@triton.jit
def _rank_in_tile(bucket, TILE: tl.constexpr):
    """Earlier pairs of the same bucket in the tile (what keeps the order stable)."""
    offs = tl.arange(0, TILE)
    same = (bucket[None, :] == bucket[:, None]) & (offs[None, :] < offs[:, None])
    return tl.sum(same.to(tl.int32), axis=1)


@triton.jit
def _place(sorted_ptr, expert_ids_ptr, idx, row, pos, expert, keep, BLOCK_M: tl.constexpr):
    """Pair idx goes to ``row``, the ``pos``-th row of its bucket. Padding only ends a bucket, so
    every block starts with a pair: the pair on a block's first row writes the block's expert."""
    tl.store(sorted_ptr + row, idx, mask=keep)
    tl.store(expert_ids_ptr + row // BLOCK_M, expert, mask=keep & (pos % BLOCK_M == 0))


@triton.jit
def _pad(sorted_ptr, first, count, numel, PAD_W: tl.constexpr):
    """``sorted[first[i] + k] = numel`` for ``k < count[i]`` (count < BLOCK_M <= PAD_W)."""
    k = tl.arange(0, PAD_W)
    pos = first[:, None] + k[None, :]
    tl.store(sorted_ptr + pos, numel + tl.zeros_like(pos), mask=k[None, :] < count[:, None])


@triton.jit
def _fill_tail(sorted_ptr, expert_ids_ptr, post, numel, max_padded, max_blocks, pid, nprog,
               BLOCK_M: tl.constexpr, FILL: tl.constexpr):  # fmt: skip
    """Past the last block: sorted ids hold numel and expert ids -1. Program ``pid`` of ``nprog``
    takes every nprog-th chunk of FILL entries."""
    offs = tl.arange(0, FILL)
    for p0 in range(post + pid * FILL, max_padded, nprog * FILL):
        p = p0 + offs
        tl.store(sorted_ptr + p, numel + tl.zeros_like(p), mask=p < max_padded)
    for j0 in range(post // BLOCK_M + pid * FILL, max_blocks, nprog * FILL):
        j = j0 + offs
        tl.store(expert_ids_ptr + j, tl.full([FILL], -1, tl.int32), mask=j < max_blocks)


@triton.jit(do_not_specialize=_SIZES)
def _align_count_kernel(
    # Pointers
    ids_ptr, map_ptr, counts_ptr,
    # Sizes
    numel, E, num_local, num_tiles,
    # Meta-parameters
    HAS_MAP: tl.constexpr, KEEP_EMPTY: tl.constexpr, NUM_BINS: tl.constexpr, TILE: tl.constexpr,
):
    t = tl.program_id(0)
    idx = t * TILE + tl.arange(0, TILE)
    bucket, _ = _bucket_of(ids_ptr, map_ptr, idx, numel, E, num_local, HAS_MAP, KEEP_EMPTY, NUM_BINS - 1)
    # Dropped pairs land in the last bin, which is never a real bucket (NUM_BINS > E + 1).
    hist = tl.histogram(bucket, NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    # Bucket-major: the scan reads one contiguous row per bucket.
    tl.store(counts_ptr + bins * num_tiles + t, hist, mask=bins <= E)


@triton.jit(do_not_specialize=_SIZES)
def _align_scan_kernel(
    # Pointers
    counts_ptr, totals_ptr,
    # Sizes
    num_tiles,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = counts_ptr + b * num_tiles
    carry = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    for t0 in range(0, num_tiles, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        c = tl.load(row + t, mask=t < num_tiles, other=0)
        # Exclusive prefix over tiles: where tile t starts writing inside bucket b.
        tl.store(row + t, tl.cumsum(c, axis=0) - c + carry, mask=t < num_tiles)
        carry += tl.sum(c, axis=0)
    tl.store(totals_ptr + b, carry)


@triton.jit(do_not_specialize=_SIZES)
def _align_scatter_kernel(
    # Pointers
    ids_ptr, map_ptr, offsets_ptr, totals_ptr, sorted_ptr, expert_ids_ptr, post_ptr,
    # Sizes
    numel, E, num_local, num_tiles, max_padded, max_blocks,
    # Meta-parameters
    BLOCK_M: tl.constexpr, HAS_MAP: tl.constexpr, KEEP_EMPTY: tl.constexpr, NUM_BINS: tl.constexpr,
    TILE: tl.constexpr, OWNED: tl.constexpr, PAD_W: tl.constexpr, FILL: tl.constexpr,
):
    t = tl.program_id(0)
    nprog = tl.num_programs(0)
    bins = tl.arange(0, NUM_BINS)
    totals = tl.load(totals_ptr + bins, mask=bins <= E, other=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    post = tl.sum(padded, axis=0)

    idx = t * TILE + tl.arange(0, TILE)
    bucket, expert = _bucket_of(ids_ptr, map_ptr, idx, numel, E, num_local, HAS_MAP, KEEP_EMPTY, NUM_BINS - 1)
    keep = bucket <= E
    b = tl.where(keep, bucket, 0)
    pos = tl.load(offsets_ptr + b * num_tiles + t, mask=keep, other=0) + _rank_in_tile(bucket, TILE)
    _place(sorted_ptr, expert_ids_ptr, idx, tl.gather(starts, b, 0) + pos, pos, expert, keep, BLOCK_M)

    # This program's buckets (t, t + nprog, ...): rows [start + total, start + padded) are padding.
    owned = t + nprog * tl.arange(0, OWNED)
    ob = tl.minimum(owned, E)
    ob_total = tl.gather(totals, ob, 0)
    n_pad = tl.where(owned <= E, tl.gather(padded, ob, 0) - ob_total, 0)
    _pad(sorted_ptr, tl.gather(starts, ob, 0) + ob_total, n_pad, numel, PAD_W)
    if t == 0:
        tl.store(post_ptr, post)
    _fill_tail(sorted_ptr, expert_ids_ptr, post, numel, max_padded, max_blocks, t, nprog, BLOCK_M, FILL)


@triton.jit(do_not_specialize=_SIZES)
def _align_small_kernel(
    # Pointers
    ids_ptr, map_ptr, sorted_ptr, expert_ids_ptr, post_ptr,
    # Sizes
    numel, E, num_local, max_padded, max_blocks,
    # Meta-parameters
    BLOCK_M: tl.constexpr, HAS_MAP: tl.constexpr, KEEP_EMPTY: tl.constexpr, NUM_BINS: tl.constexpr,
    TILE: tl.constexpr, PAD_W: tl.constexpr, FILL: tl.constexpr,
):
    # All three steps in one program, for inputs of one tile (decode): one launch instead of three.
    offs = tl.arange(0, TILE)
    bins = tl.arange(0, NUM_BINS)
    bucket, expert = _bucket_of(ids_ptr, map_ptr, offs, numel, E, num_local, HAS_MAP, KEEP_EMPTY, NUM_BINS - 1)
    keep = bucket <= E
    # A one-hot sum, not tl.histogram: a tile this small is spread thinner than one element per thread.
    totals = tl.sum(((bucket[:, None] == bins[None, :]) & (bins[None, :] <= E)).to(tl.int32), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    post = tl.sum(padded, axis=0)
    b = tl.where(keep, bucket, 0)
    pos = _rank_in_tile(bucket, TILE)
    row = tl.gather(starts, b, 0) + pos
    _place(sorted_ptr, expert_ids_ptr, offs, row, pos, expert, keep, BLOCK_M)
    # The last pair of each bucket writes the bucket's padding right after itself.
    total = tl.gather(totals, b, 0)
    n_pad = tl.where(keep & (pos == total - 1), tl.gather(padded, b, 0) - total, 0)
    _pad(sorted_ptr, row + 1, n_pad, numel, PAD_W)
    tl.store(post_ptr, post)
    _fill_tail(sorted_ptr, expert_ids_ptr, post, numel, max_padded, max_blocks, 0, 1, BLOCK_M, FILL)
