"""``moe_align_block_size``: sort (token, slot) pairs by expert and pad each expert to a block.

Shapes (M tokens, topk slots, numel = M * topk pairs, E global experts, BM = block_m)::

    topk_ids                [M, topk]      global expert ids; -1 = empty slot
    sorted_token_ids        int32 [max_padded]    flat pair index (token * topk + slot), numel = pad
    expert_ids              int32 [max_blocks]    local expert of each BM-row block, -1 = zeros
    num_tokens_post_padded  int32 [1]             rows actually used (a multiple of BM)

Pairs are sorted into buckets: bucket ``g`` for global expert g when it lives on this rank, and
one last bucket ``E`` for pairs whose expert lives elsewhere (its blocks get expert id -1: the
GEMMs write zeros there). Empty slots are dropped, or kept in bucket E with ``keep_empty``.

Inputs of one tile (``numel <= TILE``, decode) take one launch of one program. Larger inputs
take three launches, each spread over many programs, and never a host sync (the kernels live in
:mod:`moekit.kernels.align_kernels`):

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from moekit.device import interpreting
from moekit.errors import InvalidInputError
from moekit.kernels.align_kernels import (  # by name: patching them on this module reaches the launcher
    _align_count_kernel,
    _align_scan_kernel,
    _align_scatter_kernel,
    _align_small_kernel,
)
from moekit.validate import check_expert_map, check_ids

TILE = 128  # pairs per program of the count and scatter kernels; the one-program path's limit
_FILL = 1024  # entries per store when filling past the last block
_MAX_NUMEL = 2**31 - 2**20  # int32 positions, with room for the padding


@dataclass
class AlignedBlocks:
    """The block layout the grouped GEMM walks (see the module docstring for shapes).

    Only the first ``num_tokens_post_padded`` entries of ``sorted_token_ids`` and the first
    ``num_tokens_post_padded / block_m`` of ``expert_ids`` are used; the rest hold ``numel`` and
    -1. Sizes come from an upper bound, so nothing here needed a host sync. The three tensors
    are views of one allocation.
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
    small = numel <= TILE
    num_tiles = 0 if small else triton.cdiv(numel, TILE)
    # One allocation: outputs, then (three-launch path) counts [E + 1, num_tiles] and totals
    # [E + 1]. Each piece starts on a 128-byte boundary.
    sizes = (max_padded, max_blocks, 1, 0 if small else (E + 1) * num_tiles, 0 if small else E + 1)
    begin = [0]
    for n in sizes:
        begin.append(begin[-1] + triton.cdiv(n, 32) * 32)
    buffer = torch.empty(begin[-1], dtype=torch.int32, device=device)
    views = (buffer[b : b + n] for b, n in zip(begin[:-1], sizes, strict=True))
    sorted_ids, expert_ids, post, counts, totals = views
    out = AlignedBlocks(sorted_ids, expert_ids, post, block_m, numel)
    if numel == 0:
        post.zero_()
        return out
    # One spare bin for dropped pairs; tl.histogram wants at least 32 bins.
    NUM_BINS = max(32, triton.next_power_of_2(E + 2))
    flags = dict(HAS_MAP=expert_map is not None, KEEP_EMPTY=keep_empty, NUM_BINS=NUM_BINS)
    ids = topk_ids.reshape(-1)
    dims = (numel, E, num_local)
    pad_w = max(16, block_m)
    if small:
        _align_small_kernel[(1,)](
            ids, expert_map, sorted_ids, expert_ids, post, *dims, max_padded, max_blocks,
            BLOCK_M=block_m, TILE=max(16, triton.next_power_of_2(numel)), PAD_W=pad_w, FILL=_FILL, **flags,
            num_warps=4 if NUM_BINS <= 256 else 8,
        )  # fmt: skip
        return out
    _align_count_kernel[(num_tiles,)](ids, expert_map, counts, *dims, num_tiles, TILE=TILE, **flags)
    scan_block = min(1024, max(16, triton.next_power_of_2(num_tiles)))
    _align_scan_kernel[(E + 1,)](counts, totals, num_tiles, BLOCK=scan_block, num_warps=4)
    owned = triton.next_power_of_2(triton.cdiv(E + 1, num_tiles))
    _align_scatter_kernel[(num_tiles,)](
        ids, expert_map, counts, totals, sorted_ids, expert_ids, post, *dims, num_tiles, max_padded, max_blocks,
        BLOCK_M=block_m, TILE=TILE, OWNED=owned, PAD_W=pad_w, FILL=_FILL, **flags,
    )  # fmt: skip
    return out
