"""Exercise 5: moe_align_block_size in Triton: sort (token, slot) pairs by expert, pad to BLOCK_M."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    post_ptr,
    cursor_ptr,
    numel,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
):
    # One program. Pass 1: pairs per expert (ids outside [0, num_experts) are skipped).
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < numel, other=-1)
        ok = (ids >= 0) & (ids < num_experts)
        counts += tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    counts = tl.where(bins < num_experts, counts, 0)
    # Each expert's run, padded to whole blocks, starts where the previous one ends.
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    tl.store(post_ptr, tl.sum(padded, axis=0))
    tl.store(cursor_ptr + bins, starts)
    tl.debug_barrier()  # one thread stored what another loads: on a GPU the threads wait here for each other
    # Block b of the layout belongs to the expert whose run holds row b * BLOCK_M.
    for e in range(0, num_experts):
        first = tl.load(cursor_ptr + e) // BLOCK_M
        n = (tl.sum(tl.where(bins == e, padded, 0), axis=0)) // BLOCK_M
        for b in range(0, n):
            tl.store(expert_ids_ptr + first + b, e)
    tl.debug_barrier()  # every start is read before pass 2 moves the cursors
    # Pass 2: each pair takes the next free row of its expert (sorted_ptr holds numel = padding).
    for start in range(0, numel, BLOCK):
        pair = start + offs
        ids = tl.load(ids_ptr + pair, mask=pair < numel, other=-1)
        ok = (ids >= 0) & (ids < num_experts)
        row = tl.atomic_add(cursor_ptr + tl.where(ok, ids, 0), 1, mask=ok)
        tl.store(sorted_ptr + row, pair, mask=ok)
