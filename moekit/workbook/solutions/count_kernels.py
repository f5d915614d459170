"""Exercise 4: count_expert_num_tokens in Triton, the seed's scan and a one-pass histogram."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scan_kernel(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    expert = tl.program_id(0)  # one program per local expert
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        inside = start + offs < numel
        ids = tl.load(ids_ptr + start + offs, mask=inside, other=-1)
        ok = inside & (ids >= 0) & (ids < id_limit)
        if HAS_MAP:
            ids = tl.load(map_ptr + ids, mask=ok, other=-1)
        total += (ok & (ids == expert)).to(tl.int32)
    tl.store(out_ptr + expert, tl.sum(total, axis=0))


@triton.jit
def histogram_kernel(
    ids_ptr,
    map_ptr,
    out_ptr,
    numel,
    id_limit,
    num_local,
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # one tile per program
    inside = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1)  # each id read once
    ok = inside & (ids >= 0) & (ids < id_limit)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=ok, other=-1)
    ok = ok & (ids >= 0) & (ids < num_local)
    hist = tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)  # invalid lanes -> a spare bin
    bins = tl.arange(0, NUM_BINS)
    tl.atomic_add(out_ptr + bins, hist, mask=(bins < num_local) & (hist > 0))
