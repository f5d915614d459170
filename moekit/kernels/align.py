"""``moe_align_block_size``: sort (token, slot) pairs by expert and pad each expert to a block.

Shapes (M tokens, topk slots, numel = M * topk pairs, E global experts, BM = block_m)::

    topk_ids                [M, topk]      global expert ids; -1 = empty slot
    sorted_token_ids        int32 [max_padded]    flat pair index (token * topk + slot), numel = pad
    expert_ids              int32 [max_blocks]    local expert of each BM-row block, -1 = zeros
    num_tokens_post_padded  int32 [1]             rows actually used (a multiple of BM)

Pairs are sorted into buckets: bucket ``g`` for global expert g when it lives on this rank, and
one last bucket ``E`` for pairs whose expert lives elsewhere (its blocks get expert id -1: the
GEMMs write zeros there). Empty slots are dropped, or kept in bucket E with ``keep_empty``.

Three launches, each spread over many programs, and never a host sync:

1. ``align_count_kernel``, one program per tile of ``TILE`` pairs: the tile's histogram,
   stored bucket-major, ``counts[bucket, tile]``.
2. ``align_scan_kernel``, one program per bucket: an exclusive prefix sum along its row, in
   place (where each tile starts writing inside the bucket), and the bucket's total.
3. ``align_scatter_kernel``, one program per tile: every program rebuilds the bucket starts
   from the E + 1 totals (a short cumsum), then places its pairs at ``start[bucket] +
   offset[bucket, tile] + (earlier pairs of the bucket in the tile)``. A pair that lands on the
   first row of a block writes that block's expert id (every block starts with a pair: padding
   only ends a bucket). Program t also writes the padding of buckets t, t + num_tiles, ... and
   its share of everything past the last block.

That order is stable: within a bucket, pairs keep their flat order. So the result is
deterministic, and equal to a stable sort by bucket.

The file reads in that order: the layout the kernels fill (:class:`AlignedBlocks`, its sizes),
the per-pair steps the kernels share, the three kernels, then the host side (checks, launches).
The Hopper wing adds the fast paths of small inputs (one program, or one launch) and
launches these same kernels without Triton's per-call binding; its layouts equal these.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekit.errors import InvalidInputError
from moekit.validate import (
    check_expert_map,
    check_flag,
    check_ids,
    check_kernel_device,
    check_num_experts,
    check_numel,
    check_positive_int,
)

TILE = 128  # pairs per program of the count and scatter kernels
MAX_BLOCK_M = 1024  # a block's padding is written by one tile of block_m lanes
FILL_STEP = 1024  # entries per store when filling past the last block
# Sizes change with every M: specializing on them (== 1, % 16) would only add compiles.
_SIZES = ["numel", "num_tiles", "max_padded", "max_blocks"]


# The layout -------------------------------------------------------------------------------------


class AlignedBlocks:
    """The block layout the grouped GEMM walks (shapes: the module docstring).

    Only the first ``num_tokens_post_padded`` entries of ``sorted_token_ids`` and the first
    ``num_tokens_post_padded / block_m`` of ``expert_ids`` are used; the rest hold ``numel`` and
    -1. Sizes come from an upper bound, so nothing here needed a host sync. All three live in one
    int32 ``buffer`` (sorted ids at 0, expert ids at ``expert_offset``, the used rows at
    ``post_offset``); the kernels take the buffer and the offsets, so a launch makes no views.
    """

    def __init__(self, buffer: torch.Tensor, shape: AlignShape):
        self.buffer, self.shape = buffer, shape
        self.max_padded, self.max_blocks = shape.max_padded, shape.max_blocks
        self.block_m, self.numel = shape.block_m, shape.numel
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


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per size (align_shape)
class AlignShape:
    """Everything about one align that follows from the sizes alone.

    The buffer holds, at these int32 offsets: sorted ids (0), expert ids (``expert_off``), the used
    rows (``post_off``), the scratch counts ``[E + 1, num_tiles]`` (``counts_off``) and the bucket
    totals ``[E + 1]`` (``totals_off``); ``size`` entries in all.
    """

    numel: int
    E: int
    num_local: int
    block_m: int
    max_padded: int  # max_padded_size(numel, E + 1, block_m)
    max_blocks: int
    expert_off: int
    post_off: int
    counts_off: int
    totals_off: int
    size: int
    num_tiles: int  # programs of the count and scatter kernels
    num_bins: int  # histogram bins: a power of two > E + 1 (the last one takes dropped pairs)
    scan_block: int  # tiles per step of the scan
    owned: int  # buckets whose padding one scatter program writes (a power of two)


def max_padded_size(numel: int, num_buckets: int, block_m: int) -> int:
    """Rows the layout can need: every non-empty bucket (at most ``min(numel, buckets)``) pads
    by less than ``block_m``; rounded up to whole blocks."""
    bound = numel + min(numel, num_buckets) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def _round32(n: int) -> int:
    return -(-n // 32) * 32  # pieces of the buffer start on 128-byte boundaries


@functools.lru_cache(maxsize=4096)
def align_shape(numel: int, E: int, num_local: int, block_m: int) -> AlignShape:
    """The :class:`AlignShape` of these sizes (the same object for the same sizes)."""
    max_padded = max_padded_size(numel, E + 1, block_m)
    num_tiles = triton.cdiv(numel, TILE)
    expert_off = _round32(max_padded)
    post_off = expert_off + _round32(max_padded // block_m)
    counts_off = post_off + 32
    totals_off = counts_off + _round32((E + 1) * num_tiles)
    return AlignShape(
        numel=numel,
        E=E,
        num_local=num_local,
        block_m=block_m,
        max_padded=max_padded,
        max_blocks=max_padded // block_m,
        expert_off=expert_off,
        post_off=post_off,
        counts_off=counts_off,
        totals_off=totals_off,
        size=totals_off + _round32(E + 1),
        num_tiles=num_tiles,
        num_bins=max(32, triton.next_power_of_2(E + 2)),
        scan_block=min(1024, max(16, triton.next_power_of_2(num_tiles))),
        owned=triton.next_power_of_2(triton.cdiv(E + 1, num_tiles)) if num_tiles else 1,
    )


# The steps every align kernel shares (the wing's fast paths too) -----------------------


@triton.jit
def bucket_of(ids_ptr, map_ptr, idx, numel, E, num_local, HAS_MAP: tl.constexpr, KEEP_EMPTY: tl.constexpr, DROP):
    """(bucket, local expert) of each pair: bucket g with g's local id for a local expert; E with
    -1 for a remote one (or a kept empty slot); DROP for a dropped one."""
    live = idx < numel
    g = tl.load(ids_ptr + idx, mask=live, other=-1)
    # Compare in the ids' own dtype: an int64 id cast to int32 first could wrap into range.
    valid = live & (g >= 0) & (g < E)
    if HAS_MAP:  # compare the map's entry in its own dtype too: 2**32 + 1 must not wrap to 1
        entry = tl.load(map_ptr + tl.where(valid, g, 0), mask=valid, other=-1)
        local = valid & (entry >= 0) & (entry < num_local)
        e = tl.where(local, entry, -1).to(tl.int32)
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
def rank_in_tile(bucket, TILE: tl.constexpr):
    """Earlier pairs of the same bucket in the tile (what keeps the order stable)."""
    offs = tl.arange(0, TILE)
    same = (bucket[None, :] == bucket[:, None]) & (offs[None, :] < offs[:, None])
    return tl.sum(same.to(tl.int32), axis=1)


@triton.jit
def place(sorted_ptr, expert_ids_ptr, idx, row, pos, expert, keep, BLOCK_M: tl.constexpr):
    """Pair idx goes to ``row``, the ``pos``-th row of its bucket. Padding only ends a bucket, so
    every block starts with a pair: the pair on a block's first row writes the block's expert."""
    tl.store(sorted_ptr + row, idx, mask=keep)
    tl.store(expert_ids_ptr + row // BLOCK_M, expert, mask=keep & (pos % BLOCK_M == 0))


@triton.jit
def pad(sorted_ptr, first, count, numel, PAD_W: tl.constexpr):
    """``sorted[first[i] + k] = numel`` for ``k < count[i]`` (count < BLOCK_M <= PAD_W)."""
    k = tl.arange(0, PAD_W)
    pos = first[:, None] + k[None, :]
    tl.store(sorted_ptr + pos, numel + tl.zeros_like(pos), mask=k[None, :] < count[:, None])


@triton.jit
def pad_owned(sorted_ptr, totals, padded, starts, t, nprog, numel, E, OWNED: tl.constexpr, PAD_W: tl.constexpr):
    """Program t of nprog pads buckets t, t + nprog, ...: rows [start + total, start + padded)."""
    owned = t + nprog * tl.arange(0, OWNED)
    ob = tl.minimum(owned, E)
    ob_total = tl.gather(totals, ob, 0)
    n_pad = tl.where(owned <= E, tl.gather(padded, ob, 0) - ob_total, 0)
    pad(sorted_ptr, tl.gather(starts, ob, 0) + ob_total, n_pad, numel, PAD_W)


@triton.jit
def fill_tail(
    sorted_ptr,
    expert_ids_ptr,
    post,
    numel,
    max_padded,
    max_blocks,
    pid,
    nprog,
    BLOCK_M: tl.constexpr,
    FILL: tl.constexpr,
):
    """Past the last block: sorted ids hold numel and expert ids -1. Program ``pid`` of ``nprog``
    takes every nprog-th chunk of FILL entries."""
    offs = tl.arange(0, FILL)
    for p0 in range(post + pid * FILL, max_padded, nprog * FILL):
        p = p0 + offs
        tl.store(sorted_ptr + p, numel + tl.zeros_like(p), mask=p < max_padded)
    for j0 in range(post // BLOCK_M + pid * FILL, max_blocks, nprog * FILL):
        j = j0 + offs
        tl.store(expert_ids_ptr + j, tl.full([FILL], -1, tl.int32), mask=j < max_blocks)


# The three kernels ------------------------------------------------------------------------------


@triton.jit(do_not_specialize=_SIZES)
def align_count_kernel(
    # Pointers
    ids_ptr,
    map_ptr,
    out_ptr,
    # Sizes
    numel,
    E,
    num_local,
    num_tiles,
    counts_off,
    # Meta-parameters
    HAS_MAP: tl.constexpr,
    KEEP_EMPTY: tl.constexpr,
    NUM_BINS: tl.constexpr,
    TILE: tl.constexpr,
):
    """Step 1: the histogram of tile ``t``, stored bucket-major: ``counts[bucket, t]``."""
    counts_ptr = out_ptr + counts_off
    t = tl.program_id(0)
    idx = t * TILE + tl.arange(0, TILE)
    bucket, _ = bucket_of(ids_ptr, map_ptr, idx, numel, E, num_local, HAS_MAP, KEEP_EMPTY, NUM_BINS - 1)
    # Dropped pairs land in the last bin, which is never a real bucket (NUM_BINS > E + 1).
    hist = tl.histogram(bucket, NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    # Bucket-major: the scan reads one contiguous row per bucket.
    tl.store(counts_ptr + bins * num_tiles + t, hist, mask=bins <= E)


@triton.jit(do_not_specialize=_SIZES)
def align_scan_kernel(
    # Pointers
    out_ptr,
    # Sizes
    num_tiles,
    counts_off,
    totals_off,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    """Step 2: bucket ``b``'s row of counts becomes where each tile starts in it; then its total."""
    counts_ptr = out_ptr + counts_off
    totals_ptr = out_ptr + totals_off
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
def align_scatter_kernel(
    # Pointers
    ids_ptr,
    map_ptr,
    out_ptr,
    # Sizes
    numel,
    E,
    num_local,
    num_tiles,
    max_padded,
    max_blocks,
    expert_off,
    post_off,
    counts_off,
    totals_off,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    HAS_MAP: tl.constexpr,
    KEEP_EMPTY: tl.constexpr,
    NUM_BINS: tl.constexpr,
    TILE: tl.constexpr,
    OWNED: tl.constexpr,
    PAD_W: tl.constexpr,
    FILL: tl.constexpr,
):
    """Step 3: tile ``t``'s pairs to their rows; its buckets' padding; its share of the tail."""
    sorted_ptr = out_ptr
    expert_ids_ptr = out_ptr + expert_off
    post_ptr = out_ptr + post_off
    offsets_ptr = out_ptr + counts_off
    totals_ptr = out_ptr + totals_off
    t = tl.program_id(0)
    nprog = tl.num_programs(0)
    bins = tl.arange(0, NUM_BINS)
    totals = tl.load(totals_ptr + bins, mask=bins <= E, other=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    post = tl.sum(padded, axis=0)

    idx = t * TILE + tl.arange(0, TILE)
    bucket, expert = bucket_of(ids_ptr, map_ptr, idx, numel, E, num_local, HAS_MAP, KEEP_EMPTY, NUM_BINS - 1)
    keep = bucket <= E
    b = tl.where(keep, bucket, 0)
    pos = tl.load(offsets_ptr + b * num_tiles + t, mask=keep, other=0) + rank_in_tile(bucket, TILE)
    place(sorted_ptr, expert_ids_ptr, idx, tl.gather(starts, b, 0) + pos, pos, expert, keep, BLOCK_M)

    pad_owned(sorted_ptr, totals, padded, starts, t, nprog, numel, E, OWNED, PAD_W)
    if t == 0:
        tl.store(post_ptr, post)
    fill_tail(sorted_ptr, expert_ids_ptr, post, numel, max_padded, max_blocks, t, nprog, BLOCK_M, FILL)


# The host side ----------------------------------------------------------------------------------


def check_layout_args(topk_ids, block_m, global_num_experts, expert_map, num_local_experts, keep_empty) -> None:
    """The checks of moe_align_block_size (and of the wing's pair blocks)."""
    check_ids(topk_ids, rank=None)
    check_positive_int(block_m, "block_m")
    check_num_experts(global_num_experts, "global_num_experts")
    if block_m & (block_m - 1) or block_m > MAX_BLOCK_M:
        raise InvalidInputError(f"block_m must be a power of two <= {MAX_BLOCK_M}, got {block_m}")
    if num_local_experts is not None:
        check_num_experts(num_local_experts, "num_local_experts")
        if num_local_experts > global_num_experts:
            raise InvalidInputError(f"num_local_experts={num_local_experts} > global_num_experts={global_num_experts}")
    check_flag(keep_empty, "keep_empty")
    check_numel(topk_ids)
    if max_padded_size(topk_ids.numel(), global_num_experts + 1, block_m) >= 2**31:
        raise InvalidInputError(
            f"{topk_ids.numel()} pairs padded to blocks of {block_m} for {global_num_experts} experts pass int32 positions"
        )
    check_kernel_device(topk_ids, "topk_ids")
    if expert_map is not None:
        check_expert_map(expert_map, device=topk_ids.device)
        if expert_map.numel() != global_num_experts:
            raise InvalidInputError(
                f"expert_map must have global_num_experts={global_num_experts} entries, got {expert_map.numel()}"
            )


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_m: int,
    global_num_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    num_local_experts: int | None = None,
    keep_empty: bool = False,
) -> AlignedBlocks:
    """Sort the (token, slot) pairs by expert; pad every expert's run to a multiple of ``block_m``.

    The algorithm, in plain Python (``bucket`` as in the module docstring)::

        buckets = [[] for _ in range(E + 1)]           # one per global expert, plus "remote"
        for i, g in enumerate(topk_ids.flatten()):     # i = token * topk + slot
            if g < 0 or g >= E:                        # empty slot (kept in E if keep_empty)
                continue
            local = expert_map[g] if expert_map is not None else g
            buckets[g if local >= 0 else E].append(i)
        sorted_token_ids, expert_ids = [], []
        for b, pairs in enumerate(buckets):
            pad = -len(pairs) % block_m
            sorted_token_ids += pairs + [numel] * pad
            expert_ids += [local_of(b)] * ((len(pairs) + pad) // block_m)   # -1 for bucket E
        num_tokens_post_padded = len(sorted_token_ids)

    Worked example: 3 tokens, topk = 2, E = 4, ``block_m = 4``, numel = 6::

        topk_ids = [[2, 0],      pairs 0, 1
                    [2, 3],      pairs 2, 3
                    [-1, 2]]     pairs 4, 5 (pair 4 is empty)

        expert 0 <- pair 1          -> [1, 6, 6, 6]     (3 pads of value numel = 6)
        expert 2 <- pairs 0, 2, 5   -> [0, 2, 5, 6]
        expert 3 <- pair 3          -> [3, 6, 6, 6]
        sorted_token_ids[:12] = [1, 6, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6]
        expert_ids[:3] = [0, 2, 3];  num_tokens_post_padded = [12]

    On rank 1 of 2 (``expert_map = [-1, -1, 0, 1]``) experts 0 and 1 live elsewhere: pair 1 goes
    to the remote bucket, whose block has expert id -1, and experts 2, 3 become local 0, 1::

        sorted_token_ids[:12] = [0, 2, 5, 6, 3, 6, 6, 6, 1, 6, 6, 6];  expert_ids[:3] = [0, 1, -1]

    Args:
        topk_ids: contiguous int32/int64 ``[M, topk]`` (or ``[numel]``) global expert ids.
        block_m: rows per GEMM block, a power of two.
        global_num_experts: E, the number of global experts (the length of ``expert_map``).
        expert_map: optional int ``[E]``: global id -> local id, -1 where the expert is remote.
        num_local_experts: experts on this rank; a map entry outside ``[0, num_local_experts)``
            (or, without a map, an id >= it) counts as remote. Defaults to E.
        keep_empty: send empty slots (ids < 0 or >= E) to the remote bucket instead of
            dropping them, so that every pair has a row and the GEMMs write zeros for it.

    Returns:
        :class:`AlignedBlocks`; ``sorted_token_ids`` has ``max_padded_size(numel, E + 1,
        block_m)`` entries, a bound computed on the host from sizes alone.

    Raises:
        InvalidIdsError: ids or map not signed-integer and contiguous.
        InvalidInputError: a bad ``block_m``/``global_num_experts``, or a map of the wrong length.
    """
    check_layout_args(topk_ids, block_m, global_num_experts, expert_map, num_local_experts, keep_empty)
    return launch_align(
        topk_ids, block_m, global_num_experts, expert_map, num_local_experts=num_local_experts, keep_empty=keep_empty
    )


def launch_align(
    topk_ids: torch.Tensor,
    block_m: int,
    global_num_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    num_local_experts: int | None = None,
    keep_empty: bool = False,
) -> AlignedBlocks:
    """:func:`moe_align_block_size` without its checks, for callers that checked the ids already."""
    numel, E = topk_ids.numel(), global_num_experts
    num_local = num_local_experts if num_local_experts is not None else E
    sh = align_shape(numel, E, num_local, block_m)
    buf = torch.empty(sh.size, dtype=torch.int32, device=topk_ids.device)
    out = AlignedBlocks(buf, sh)
    if numel == 0:
        out.num_tokens_post_padded.zero_()
        return out
    flags = dict(HAS_MAP=expert_map is not None, KEEP_EMPTY=keep_empty, NUM_BINS=sh.num_bins, TILE=TILE)
    align_count_kernel[(sh.num_tiles,)](
        topk_ids, expert_map, buf, numel, E, num_local, sh.num_tiles, sh.counts_off, **flags
    )
    align_scan_kernel[(E + 1,)](buf, sh.num_tiles, sh.counts_off, sh.totals_off, BLOCK=sh.scan_block, num_warps=4)
    align_scatter_kernel[(sh.num_tiles,)](
        topk_ids,
        expert_map,
        buf,
        numel,
        E,
        num_local,
        sh.num_tiles,
        sh.max_padded,
        sh.max_blocks,
        sh.expert_off,
        sh.post_off,
        sh.counts_off,
        sh.totals_off,
        BLOCK_M=block_m,
        OWNED=sh.owned,
        PAD_W=max(16, block_m),
        FILL=FILL_STEP,
        **flags,
    )
    return out


# The row plan's counts --------------------------------------------------------------------------


@triton.jit(do_not_specialize=["numel", "expert_off", "post_off"])  # they follow M: no recompiles
def chunk_counts_kernel(
    # Pointers
    layout_ptr,
    out_ptr,
    # Sizes
    numel,
    expert_off,
    post_off,
    rows_per_chunk,
    num_local,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
):
    """One program per block of the layout: its live rows go to its chunk's count of its expert."""
    b = tl.program_id(0)
    row0 = b * BLOCK_M
    if row0 < tl.load(layout_ptr + post_off):
        expert = tl.load(layout_ptr + expert_off + b)
        if expert >= 0:  # -1: another rank's expert (or kept empty slots)
            pairs = tl.load(layout_ptr + row0 + tl.arange(0, BLOCK_M))
            live = tl.sum((pairs < numel).to(tl.int32), axis=0)
            tl.atomic_add(out_ptr + (row0 // rows_per_chunk) * num_local + expert, live, sem="relaxed")


def launch_chunk_counts(blocks: AlignedBlocks, rows_per_chunk: int, num_local: int) -> torch.Tensor:
    """int32 ``[num_chunks, num_local]``: the pairs of every local expert in each chunk of
    ``rows_per_chunk`` sorted rows of ``blocks`` (a multiple of ``blocks.block_m``); one launch for
    every chunk of a plan, no host sync. Rows past the used ones (and padding rows) count nothing."""
    num_chunks = triton.cdiv(blocks.max_padded, rows_per_chunk)
    out = torch.zeros((num_chunks, num_local), dtype=torch.int32, device=blocks.buffer.device)
    if blocks.numel == 0 or num_chunks == 0:
        return out
    chunk_counts_kernel[(blocks.max_blocks,)](
        blocks.buffer,
        out,
        blocks.numel,
        blocks.expert_offset,
        blocks.post_offset,
        rows_per_chunk,
        num_local,
        BLOCK_M=blocks.block_m,
    )
    return out
