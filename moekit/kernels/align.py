"""``moe_align_block_size``: sort (token, slot) pairs by expert and pad each expert to a block.

Shapes (M tokens, topk slots, numel = M * topk pairs, E global experts, BM = block_m)::

    topk_ids                [M, topk]      global expert ids; -1 = empty slot
    sorted_token_ids        int32 [max_padded]    flat pair index (token * topk + slot), numel = pad
    expert_ids              int32 [max_blocks]    local expert of each BM-row block, -1 = zeros
    num_tokens_post_padded  int32 [1]             rows actually used (a multiple of BM)

Pairs are sorted into buckets: bucket ``g`` for global expert g when it lives on this rank, and
one last bucket ``E`` for pairs whose expert lives elsewhere (its blocks get expert id -1: the
GEMMs write zeros there). Empty slots are dropped, or kept in bucket E with ``keep_empty``.

Inputs of one tile (``numel <= SMALL_MAX = TILE``, decode) take one launch of one program. Up to
``MEDIUM_MAX`` pairs take one launch of ``numel / TILE`` programs, each counting all the pairs
itself (``_align_medium_kernel``: steps 1 and 2 below folded into 3). Larger inputs take three
launches, each spread over many programs, and never a host sync:

1. ``_align_count_kernel``, one program per tile of ``TILE`` pairs: the tile's histogram,
   stored bucket-major, ``counts[bucket, tile]``.
2. ``_align_scan_kernel``, one program per bucket: an exclusive prefix sum along its row, in
   place (where each tile starts writing inside the bucket), and the bucket's total.
3. ``_align_scatter_kernel``, one program per tile: every program rebuilds the bucket starts
   from the E + 1 totals (a short cumsum), then places its pairs at ``start[bucket] +
   offset[bucket, tile] + (earlier pairs of the bucket in the tile)``. A pair that lands on the
   first row of a block writes that block's expert id (every block starts with a pair: padding
   only ends a bucket). Program t also writes the padding of buckets t, t + num_tiles, ... and
   its share of everything past the last block.

That order is stable: within a bucket, pairs keep their flat order. So the result is
deterministic, and equal to a stable sort by bucket.

This module picks the path and launches it; the kernels are in :mod:`moekit.kernels.align_kernels`,
the layout they fill (:class:`AlignedBlocks`) in :mod:`moekit.kernels.align_layout`.
"""

from __future__ import annotations

import functools

import torch

from moekit.errors import InvalidInputError
from moekit.kernels.align_kernels import (
    _align_count_kernel,
    _align_medium_kernel,
    _align_scan_kernel,
    _align_scatter_kernel,
    _align_small_kernel,
)
from moekit.kernels.align_layout import AlignedBlocks, _AlignShape, _round32, max_padded_size
from moekit.kernels.host_math import cdiv, next_power_of_2
from moekit.kernels.launch import LeanLauncher, int_spec
from moekit.validate import (
    check_expert_map,
    check_flag,
    check_ids,
    check_kernel_device,
    check_numel,
    check_positive_int,
)

TILE = 128  # pairs per program of the count and scatter kernels; the one-program path's limit
SMALL_MAX = TILE  # up to this many pairs, one program does everything (at most TILE)
MEDIUM_MAX = 1024  # up to this many, one launch of numel / TILE programs (count and scan folded in)
_CHUNK = 1024  # pairs per histogram step of that launch
_FILL = 1024  # entries per store when filling past the last block
MAX_BLOCK_M = 1024  # a block's padding is written by one tile of block_m lanes


@functools.lru_cache(maxsize=4096)
def _align_shape(numel: int, E: int, num_local: int, block_m: int, counts: bool, small_max: int,
                 medium_max: int) -> _AlignShape:  # fmt: skip
    max_padded = max_padded_size(numel, E + 1, block_m)
    small = numel <= min(small_max, TILE)
    medium = not small and numel <= medium_max
    num_tiles = 0 if small else cdiv(numel, TILE)
    expert_off = _round32(max_padded)
    post_off = expert_off + _round32(max_padded // block_m)
    local_off = post_off + 32
    # One allocation: outputs and local counts, then (three-launch path) counts [E + 1, num_tiles]
    # and totals [E + 1].
    counts_off = local_off + _round32(num_local)
    one_launch = small or medium  # no scratch counts or totals
    totals_off = counts_off + (0 if one_launch else _round32((E + 1) * num_tiles))
    size = totals_off + (0 if one_launch else _round32(E + 1))
    spec = (int_spec(expert_off), int_spec(post_off), int_spec(num_tiles), int_spec(counts_off), int_spec(totals_off))
    return _AlignShape(
        numel, E, num_local, block_m, counts, max_padded, max_padded // block_m, expert_off, post_off, local_off,
        counts_off, totals_off, size, small, medium, num_tiles, max(32, next_power_of_2(E + 2)),
        max(16, next_power_of_2(num_local)), max(16, next_power_of_2(num_local + 1)),
        max(16, next_power_of_2(numel)) if small else TILE,
        min(1024, max(16, next_power_of_2(num_tiles))), next_power_of_2(cdiv(E + 1, num_tiles)) if num_tiles else 1,
        spec,
    )  # fmt: skip


def check_layout_args(topk_ids, block_m, global_num_experts, expert_map, num_local_experts, keep_empty) -> None:
    """The checks of moe_align_block_size (and of moekit.kernels.pair_blocks.pair_blocks)."""
    check_ids(topk_ids, rank=None)
    check_positive_int(block_m, "block_m")
    check_positive_int(global_num_experts, "global_num_experts")
    if block_m & (block_m - 1) or block_m > MAX_BLOCK_M:
        raise InvalidInputError(f"block_m must be a power of two <= {MAX_BLOCK_M}, got {block_m}")
    if num_local_experts is not None:
        check_positive_int(num_local_experts, "num_local_experts")
        if num_local_experts > global_num_experts:
            raise InvalidInputError(
                f"num_local_experts={num_local_experts} > global_num_experts={global_num_experts}"
            )
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
    return launch_align(topk_ids, block_m, global_num_experts, expert_map, num_local_experts=num_local_experts,
                        keep_empty=keep_empty)  # fmt: skip


def _small_warps(sh: _AlignShape) -> int:
    """Warps of the one-program kernel. On the H200 (E=128, graphs of the kernel alone, µs for 1/2/4/8
    warps, benchmarks/results/checks/align-small-warps-*): a 64-pair tile 6.2/3.5/4.9/4.9, a 128-pair
    tile 13.6/7.2/4.7/15.1, 8-32 pairs best or level at 4; reproduced in a second round."""
    if sh.num_bins > 256:
        return 8
    return 2 if sh.tile == 64 else 4


_SMALL = LeanLauncher(_align_small_kernel, pdl=True)
_MEDIUM = LeanLauncher(_align_medium_kernel, pdl=True)
_COUNT = LeanLauncher(_align_count_kernel, pdl=True)
_SCAN = LeanLauncher(_align_scan_kernel, pdl=True)
_SCATTER = LeanLauncher(_align_scatter_kernel, pdl=True)


def launch_align(
    topk_ids: torch.Tensor,
    block_m: int,
    global_num_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    num_local_experts: int | None = None,
    keep_empty: bool = False,
    counts: bool = False,
    stream: tuple[int, int] | None = None,
) -> AlignedBlocks:
    """:func:`moe_align_block_size` without its checks, for callers that checked the ids already.
    ``counts=True`` also writes the pairs per local expert (``AlignedBlocks.counts``), for free."""
    numel, E = topk_ids.numel(), global_num_experts
    num_local = num_local_experts if num_local_experts is not None else E
    sh = _align_shape(numel, E, num_local, block_m, counts, SMALL_MAX, MEDIUM_MAX)
    buf = torch.empty(sh.size, dtype=torch.int32, device=topk_ids.device)
    out = AlignedBlocks(buf, sh)
    if numel == 0:
        out.num_tokens_post_padded.zero_()
        if counts:
            out.counts.zero_()
        return out
    has_map = expert_map is not None
    flags = dict(HAS_MAP=has_map, KEEP_EMPTY=keep_empty, NUM_BINS=sh.num_bins)
    dims = (numel, E, num_local)
    # Sizes are specialized by value class (sh.spec); the ids may be a chunk's slice (any alignment),
    # the map any int dtype.
    key = (sh, keep_empty, topk_ids.dtype, topk_ids.data_ptr() % 16,
           None if not has_map else (expert_map.dtype, expert_map.data_ptr() % 16))  # fmt: skip
    if sh.small:
        _SMALL((1,), (topk_ids, expert_map, buf, *dims, sh.max_padded, sh.max_blocks, sh.expert_off, sh.post_off,
                      sh.local_off), key=key, stream=stream, constexprs=lambda: dict(
                   BLOCK_M=block_m, TILE=sh.tile, PAD_W=max(16, block_m), FILL=_FILL, LOCAL_COUNTS=counts,
                   LOCAL_BINS=sh.local_bins, **flags, num_warps=_small_warps(sh)))  # fmt: skip
        return out
    if sh.medium:
        _MEDIUM((sh.num_tiles,), (topk_ids, expert_map, buf, *dims, sh.max_padded, sh.max_blocks, sh.expert_off,
                                  sh.post_off, sh.local_off), key=key, stream=stream, constexprs=lambda: dict(
                    BLOCK_M=block_m, TILE=TILE, CHUNK=_CHUNK, OWNED=sh.owned, PAD_W=max(16, block_m), FILL=_FILL,
                    LOCAL_COUNTS=counts, LOCAL_BINS=sh.medium_local_bins, **flags,
                    num_warps=4 if sh.num_bins <= 256 else 8))  # fmt: skip
        return out
    _COUNT((sh.num_tiles,), (topk_ids, expert_map, buf, *dims, sh.num_tiles, sh.counts_off, sh.local_off), key=key,
           stream=stream, constexprs=lambda: dict(TILE=TILE, LOCAL_COUNTS=counts, LOCAL_BINS=sh.local_bins, **flags))
    _SCAN((E + 1,), (buf, expert_map, sh.num_tiles, sh.counts_off, sh.totals_off, E, num_local, sh.local_off),
          key=key, stream=stream,
          constexprs=lambda: dict(BLOCK=sh.scan_block, HAS_MAP=has_map, LOCAL_COUNTS=counts, num_warps=4))
    _SCATTER((sh.num_tiles,), (topk_ids, expert_map, buf, *dims, sh.num_tiles, sh.max_padded, sh.max_blocks,
                               sh.expert_off, sh.post_off, sh.counts_off, sh.totals_off), key=key, stream=stream,
             constexprs=lambda: dict(BLOCK_M=block_m, TILE=TILE, OWNED=sh.owned, PAD_W=max(16, block_m), FILL=_FILL,
                                     **flags))  # fmt: skip
    return out
