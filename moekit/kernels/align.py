"""``moe_align_block_size``: sort (token, slot) pairs by expert and pad each expert to a block.

Shapes (M tokens, topk slots, numel = M * topk pairs, E global experts, BM = block_m)::

    topk_ids                [M, topk]      global expert ids; -1 = empty slot
    sorted_token_ids        int32 [max_padded]    flat pair index (token * topk + slot), numel = pad
    expert_ids              int32 [max_blocks]    local expert of each BM-row block, -1 = zeros
    num_tokens_post_padded  int32 [1]             rows actually used (a multiple of BM)

Pairs are sorted into buckets: bucket ``g`` for global expert g when it lives on this rank, and
one last bucket ``E`` for pairs whose expert lives elsewhere (its blocks get expert id -1: the
GEMMs write zeros there). Empty slots are dropped, or kept in bucket E with ``keep_empty``.

Three launches for large inputs, one for small ones (decode), never a host sync:

1. ``_align_count_kernel``: one program per tile of 128 pairs; a histogram of the tile's buckets.
2. ``_align_scan_kernel``: one program; prefix sums over tiles (where each tile writes inside
   each bucket) and over buckets (where each padded bucket starts); block experts and padding.
3. ``_align_scatter_kernel``: one program per tile; a pair goes to
   ``start[bucket] + tile_offset[tile, bucket] + (earlier pairs of its bucket in the tile)``.

That order is stable: within a bucket, pairs keep their flat order. So the result is
deterministic, and equal to a stable sort by bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.errors import InvalidInputError
from moekit.validate import check_expert_map, check_ids

TILE = 128  # pairs per program of the count and scatter kernels
_MAX_NUMEL = 2**31 - 2**20  # int32 positions, with room for the padding


@dataclass
class AlignedBlocks:
    """The block layout the grouped GEMM walks (see the module docstring for shapes).

    Only the first ``num_tokens_post_padded`` entries of ``sorted_token_ids`` and the first
    ``num_tokens_post_padded / block_m`` of ``expert_ids`` are used; the rest hold ``numel`` and
    -1. Sizes come from an upper bound, so nothing here needed a host sync.
    """

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    block_m: int
    numel: int

    @property
    def max_blocks(self) -> int:
        return self.expert_ids.numel()


def max_padded_size(numel: int, num_buckets: int, block_m: int) -> int:
    """Rows the layout can need: every non-empty bucket (at most ``min(numel, buckets)``) pads
    by less than ``block_m``; rounded up to whole blocks."""
    bound = numel + min(numel, num_buckets) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _bucket_of(ids_ptr, map_ptr, idx, numel, E, num_local, HAS_MAP: tl.constexpr, KEEP_EMPTY: tl.constexpr, DROP):
    """Bucket of each pair: its global expert if local, E if remote (or empty and kept), else DROP."""
    live = idx < numel
    g = tl.load(ids_ptr + idx, mask=live, other=-1)
    # Compare in the ids' own dtype: an int64 id cast to int32 first could wrap into range.
    valid = live & (g >= 0) & (g < E)
    local = valid
    if HAS_MAP:
        e = tl.load(map_ptr + tl.where(valid, g, 0), mask=valid, other=-1)
        local = valid & (e >= 0) & (e < num_local)
    else:
        local = valid & (g < num_local)
    bucket = tl.where(local, g, E).to(tl.int32)
    if KEEP_EMPTY:
        return tl.where(live, bucket, DROP)
    return tl.where(valid, bucket, DROP)


@triton.jit
def _align_count_kernel(
    # Pointers
    ids_ptr, map_ptr, counts_ptr,
    # Sizes
    numel, E, num_local,
    # Meta-parameters
    HAS_MAP: tl.constexpr, KEEP_EMPTY: tl.constexpr, NUM_BINS: tl.constexpr, TILE: tl.constexpr,
):
    t = tl.program_id(0)
    idx = t * TILE + tl.arange(0, TILE)
    bucket = _bucket_of(ids_ptr, map_ptr, idx, numel, E, num_local, HAS_MAP, KEEP_EMPTY, NUM_BINS - 1)
    # Dropped pairs land in the last bin, which is never a real bucket (NUM_BINS > E + 1).
    hist = tl.histogram(bucket, NUM_BINS)
    tl.store(counts_ptr + t * NUM_BINS + tl.arange(0, NUM_BINS), hist)


@triton.jit
def _finish(
    starts, totals, padded, map_ptr, sorted_ptr, expert_ids_ptr, post_ptr,
    numel, E, max_padded, max_blocks,
    BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """Given each bucket's start, pair count and padded size: write the block experts, the
    padding entries of ``sorted_token_ids``, and ``num_tokens_post_padded``."""
    bins = tl.arange(0, NUM_BINS)
    total = tl.sum(padded, axis=0)
    tl.store(post_ptr, total)
    ends = starts + padded
    # Block j belongs to the bucket whose [start, end) holds row j * BLOCK_M: the number of
    # buckets ending at or before that row (empty buckets end where the next one starts).
    for j0 in range(0, max_blocks, 64):
        j = j0 + tl.arange(0, 64)
        row = j * BLOCK_M
        b = tl.sum(((ends[None, :] <= row[:, None]) & (bins[None, :] < E + 1)).to(tl.int32), axis=1)
        e = tl.where(b < E, b, -1)
        if HAS_MAP:
            e = tl.load(map_ptr + tl.where(b < E, b, 0), mask=b < E, other=-1).to(tl.int32)
        tl.store(expert_ids_ptr + j, e, mask=j < max_blocks)
    # Padding inside each bucket: rows [start + count, start + padded) hold the pad value.
    for k0 in range(0, BLOCK_M, 16):
        k = k0 + tl.arange(0, 16)
        pos = (starts + totals)[:, None] + k[None, :]
        tl.store(sorted_ptr + pos, numel + tl.zeros_like(pos), mask=k[None, :] < (padded - totals)[:, None])
    # Everything past the last block.
    for p0 in range(total, max_padded, 1024):
        p = p0 + tl.arange(0, 1024)
        tl.store(sorted_ptr + p, numel + tl.zeros_like(p), mask=p < max_padded)


@triton.jit
def _align_scan_kernel(
    # Pointers
    counts_ptr, offsets_ptr, starts_ptr, map_ptr, sorted_ptr, expert_ids_ptr, post_ptr,
    # Sizes
    num_tiles, numel, E, max_padded, max_blocks,
    # Meta-parameters
    BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, HAS_MAP: tl.constexpr, TILES_PER_STEP: tl.constexpr,
):
    bins = tl.arange(0, NUM_BINS)
    carry = tl.zeros([NUM_BINS], dtype=tl.int32)
    for t0 in range(0, num_tiles, TILES_PER_STEP):
        t = t0 + tl.arange(0, TILES_PER_STEP)
        ptrs = t[:, None] * NUM_BINS + bins[None, :]
        c = tl.load(counts_ptr + ptrs, mask=t[:, None] < num_tiles, other=0)
        # Exclusive prefix over tiles: where tile t starts writing inside each bucket.
        tl.store(offsets_ptr + ptrs, tl.cumsum(c, axis=0) - c + carry[None, :], mask=t[:, None] < num_tiles)
        carry += tl.sum(c, axis=0)
    totals = tl.where(bins < E + 1, carry, 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    tl.store(starts_ptr + bins, starts)
    _finish(starts, totals, padded, map_ptr, sorted_ptr, expert_ids_ptr, post_ptr,
            numel, E, max_padded, max_blocks, BLOCK_M, NUM_BINS, HAS_MAP)


@triton.jit
def _align_scatter_kernel(
    # Pointers
    ids_ptr, map_ptr, offsets_ptr, starts_ptr, sorted_ptr,
    # Sizes
    numel, E, num_local,
    # Meta-parameters
    HAS_MAP: tl.constexpr, KEEP_EMPTY: tl.constexpr, NUM_BINS: tl.constexpr, TILE: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.arange(0, TILE)
    idx = t * TILE + offs
    bucket = _bucket_of(ids_ptr, map_ptr, idx, numel, E, num_local, HAS_MAP, KEEP_EMPTY, NUM_BINS - 1)
    keep = bucket < NUM_BINS - 1
    # Rank inside the tile: earlier pairs of the same bucket (this is what keeps the order stable).
    same = (bucket[None, :] == bucket[:, None]) & (offs[None, :] < offs[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    b = tl.where(keep, bucket, 0)
    base = tl.load(starts_ptr + b, mask=keep, other=0) + tl.load(offsets_ptr + t * NUM_BINS + b, mask=keep, other=0)
    tl.store(sorted_ptr + base + rank, idx, mask=keep)


@triton.jit
def _align_small_kernel(
    # Pointers
    ids_ptr, map_ptr, sorted_ptr, expert_ids_ptr, post_ptr,
    # Sizes
    numel, E, num_local, max_padded, max_blocks,
    # Meta-parameters
    BLOCK_M: tl.constexpr, HAS_MAP: tl.constexpr, KEEP_EMPTY: tl.constexpr, NUM_BINS: tl.constexpr,
    TILE: tl.constexpr,
):
    # All three steps in one program, for inputs of one tile (decode): one launch instead of three.
    offs = tl.arange(0, TILE)
    bins = tl.arange(0, NUM_BINS)
    bucket = _bucket_of(ids_ptr, map_ptr, offs, numel, E, num_local, HAS_MAP, KEEP_EMPTY, NUM_BINS - 1)
    keep = bucket < NUM_BINS - 1
    onehot = (bucket[:, None] == bins[None, :]) & (bins[None, :] < E + 1)
    totals = tl.sum(onehot.to(tl.int32), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    same = (bucket[None, :] == bucket[:, None]) & (offs[None, :] < offs[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    base = tl.sum(tl.where(onehot, starts[None, :], 0), axis=1)
    tl.store(sorted_ptr + base + rank, offs, mask=keep)
    _finish(starts, totals, padded, map_ptr, sorted_ptr, expert_ids_ptr, post_ptr,
            numel, E, max_padded, max_blocks, BLOCK_M, NUM_BINS, HAS_MAP)


def _check(topk_ids, block_m, num_experts, expert_map, num_local_experts) -> None:
    check_ids(topk_ids, rank=None)
    for name, value in (("block_m", block_m), ("num_experts", num_experts)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
    if block_m & (block_m - 1):
        raise InvalidInputError(f"block_m must be a power of two, got {block_m}")
    if topk_ids.numel() > _MAX_NUMEL:
        raise InvalidInputError(f"at most {_MAX_NUMEL} pairs per call (int32 positions), got {topk_ids.numel()}")
    if topk_ids.device.type == "cpu" and not interpreting():
        raise InvalidInputError("topk_ids is on the CPU but Triton compiles for CUDA; move it to the GPU")
    if expert_map is not None:
        check_expert_map(expert_map, num_local_experts=num_local_experts or num_experts, device=topk_ids.device)
        if expert_map.numel() != num_experts:
            raise InvalidInputError(f"expert_map must have num_experts={num_experts} entries, got {expert_map.numel()}")


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_m: int,
    num_experts: int,
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
        num_experts: E, the number of global experts (the length of ``expert_map``).
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
        InvalidInputError: a bad ``block_m``/``num_experts``, or a map of the wrong length.
    """
    _check(topk_ids, block_m, num_experts, expert_map, num_local_experts)
    E, numel, device = num_experts, topk_ids.numel(), topk_ids.device
    num_local = num_local_experts if num_local_experts is not None else E
    max_padded = max_padded_size(numel, E + 1, block_m)
    max_blocks = max_padded // block_m
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    post = torch.zeros(1, dtype=torch.int32, device=device)
    out = AlignedBlocks(sorted_ids, expert_ids, post, block_m, numel)
    if numel == 0:
        return out
    # One spare bin for dropped pairs; tl.histogram wants at least 32 bins.
    NUM_BINS = max(32, triton.next_power_of_2(E + 2))
    flags = dict(HAS_MAP=expert_map is not None, KEEP_EMPTY=keep_empty, NUM_BINS=NUM_BINS)
    ids = topk_ids.reshape(-1)
    if numel <= TILE:
        _align_small_kernel[(1,)](
            ids, expert_map, sorted_ids, expert_ids, post, numel, E, num_local, max_padded, max_blocks,
            BLOCK_M=block_m, TILE=max(16, triton.next_power_of_2(numel)), **flags,
            num_warps=4 if NUM_BINS <= 256 else 8,
        )  # fmt: skip
        return out
    num_tiles = triton.cdiv(numel, TILE)
    scratch = torch.empty(2 * num_tiles * NUM_BINS + NUM_BINS, dtype=torch.int32, device=device)
    counts = scratch[: num_tiles * NUM_BINS]
    offsets = scratch[num_tiles * NUM_BINS : 2 * num_tiles * NUM_BINS]
    starts = scratch[2 * num_tiles * NUM_BINS :]
    _align_count_kernel[(num_tiles,)](ids, expert_map, counts, numel, E, num_local, TILE=TILE, **flags)
    _align_scan_kernel[(1,)](
        counts, offsets, starts, expert_map, sorted_ids, expert_ids, post,
        num_tiles, numel, E, max_padded, max_blocks,
        BLOCK_M=block_m, NUM_BINS=NUM_BINS, HAS_MAP=expert_map is not None,
        TILES_PER_STEP=max(1, 8192 // NUM_BINS), num_warps=8,
    )  # fmt: skip
    _align_scatter_kernel[(num_tiles,)](
        ids, expert_map, offsets, starts, sorted_ids, numel, E, num_local, TILE=TILE, **flags
    )
    return out
