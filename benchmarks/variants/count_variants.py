"""The Triton kernels of every ``count_histogram`` variant (see :mod:`benchmarks.variants.count_histogram`).

``_program_counts`` is the binner (one partial histogram per program, grid-stride over tiles);
``_count_histogram_kernel`` finishes the ``memset`` variant and
``_count_histogram_single_launch_kernel`` the one-launch ``ticket`` and ``partials`` variants.
The variant registry, the scratch cache and the launcher stay in ``count_histogram``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_tile(ids_ptr, t, num_tiles, numel, BLOCK: tl.constexpr):
    # A tile past the last one (a prefetch) reads nothing; clamping t keeps its int32 offsets in range.
    idx = tl.minimum(t, num_tiles - 1) * BLOCK + tl.arange(0, BLOCK)
    end = tl.where(t < num_tiles, numel, 0)
    return tl.load(ids_ptr + idx, mask=idx < end, other=-1)  # -1: an empty slot, never counted


@triton.jit
def _to_local(ids, map_ptr, id_limit, num_local, HAS_MAP: tl.constexpr):
    # Compare in the ids' own dtype: casting an int64 id to int32 first could wrap it into range.
    ok = (ids >= 0) & (ids < id_limit)
    local = tl.where(ok, ids, 0)
    if HAS_MAP:
        # A masked gather, never an `if` on a tensor; lanes with a bad id read nothing.
        local = tl.load(map_ptr + local, mask=ok, other=-1)
        ok = ok & (local >= 0) & (local < num_local)
    return tl.where(ok, local, 0).to(tl.int32), ok


@triton.jit
def _program_counts(
    ids_ptr, map_ptr, row_ptr, numel, id_limit, num_local,
    HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr,
    BINNER: tl.constexpr, MASKED: tl.constexpr, PREFETCH: tl.constexpr,
):
    """This program's partial histogram of its tiles (grid-stride), int32 [NUM_BINS]."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    num_tiles = tl.cdiv(numel, BLOCK)
    bins = tl.arange(0, NUM_BINS)
    hist = tl.zeros([NUM_BINS], dtype=tl.int32)
    if BINNER == "onehot":
        cells = tl.zeros([BLOCK, NUM_BINS], dtype=tl.int32)
    if PREFETCH:
        ahead = _load_tile(ids_ptr, pid, num_tiles, numel, BLOCK)
    for t in range(pid, num_tiles, step):
        if PREFETCH:  # the next tile's load is in flight while this one is counted
            ids = ahead
            ahead = _load_tile(ids_ptr, t + step, num_tiles, numel, BLOCK)
        else:
            ids = _load_tile(ids_ptr, t, num_tiles, numel, BLOCK)
        local, ok = _to_local(ids, map_ptr, id_limit, num_local, HAS_MAP)
        if BINNER == "histogram":
            # On a GPU tl.histogram keeps only the low log2(NUM_BINS) bits of each value, so every
            # value it sees must be a valid bin: invalid lanes are masked, or sent to a spare bin.
            if MASKED:
                hist += tl.histogram(local, NUM_BINS, mask=ok)
            else:
                hist += tl.histogram(tl.where(ok, local, NUM_BINS - 1), NUM_BINS)
        elif BINNER == "onehot":
            cells += ((local[:, None] == bins[None, :]) & ok[:, None]).to(tl.int32)
        else:
            tl.atomic_add(row_ptr + local, tl.full([BLOCK], 1, tl.int32), mask=ok, sem="relaxed")
    if BINNER == "onehot":
        hist = tl.sum(cells, axis=0)
    if BINNER == "atomics":
        tl.debug_barrier()  # all of this program's adds are done before its row is read back
        hist = tl.atomic_xchg(row_ptr + bins, tl.zeros([NUM_BINS], dtype=tl.int32), sem="relaxed")
    return hist


@triton.jit
def _sum_rows(rows_ptr, num_rows, NUM_BINS: tl.constexpr, ROWS: tl.constexpr):
    bins = tl.arange(0, NUM_BINS)
    r = tl.arange(0, ROWS)
    total = tl.zeros([NUM_BINS], dtype=tl.int32)
    for r0 in range(0, num_rows, ROWS):
        rows = r0 + r
        # .cg: read the rows from L2, where the other programs' stores landed, not from L1.
        part = tl.load(rows_ptr + rows[:, None] * NUM_BINS + bins[None, :], mask=(rows < num_rows)[:, None],
                       other=0, cache_modifier=".cg")
        total += tl.sum(part, axis=0)
    return total


@triton.jit
def _count_histogram_kernel(
    # Pointers
    ids_ptr, map_ptr, out_ptr,
    # Sizes
    numel, id_limit, num_local,
    # Meta-parameters
    HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr, MASKED: tl.constexpr,
):
    # The "memset" variant: `out` was zero-filled by a separate launch.
    hist = _program_counts(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                           HAS_MAP, BLOCK, NUM_BINS, "histogram", MASKED, False)
    bins = tl.arange(0, NUM_BINS)
    # One atomic per non-empty bin per program. Integer adds are exact and commute, so the
    # result does not depend on the order the programs finish in.
    tl.atomic_add(out_ptr + bins, hist, mask=(bins < num_local) & (hist > 0), sem="relaxed")


@triton.jit
def _count_histogram_single_launch_kernel(
    # Pointers
    ids_ptr, map_ptr, out_ptr, rows_ptr, acc_ptr, counter_ptr,
    # Sizes
    numel, id_limit, num_local,
    # Meta-parameters
    HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr, MASKED: tl.constexpr,
    BINNER: tl.constexpr, FINISH: tl.constexpr, PREFETCH: tl.constexpr, SOLO: tl.constexpr,
    SUM_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    row_ptr = rows_ptr + pid * NUM_BINS
    hist = _program_counts(ids_ptr, map_ptr, row_ptr, numel, id_limit, num_local,
                           HAS_MAP, BLOCK, NUM_BINS, BINNER, MASKED, PREFETCH)
    bins = tl.arange(0, NUM_BINS)
    keep = bins < num_local
    if SOLO:  # one program: its histogram is the answer
        tl.store(out_ptr + bins, hist, mask=keep)
    else:
        if FINISH == "ticket":
            tl.atomic_add(acc_ptr + bins, hist, mask=keep & (hist > 0), sem="relaxed")
        else:
            tl.store(row_ptr + bins, hist)
        # Every thread's add (or store) happens before this program's ticket, and the ticket's
        # release/acquire makes all of them visible to the program that draws the last one.
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:
            if FINISH == "ticket":  # read and re-zero in one atomic, ready for the next call
                total = tl.atomic_xchg(acc_ptr + bins, tl.zeros([NUM_BINS], dtype=tl.int32), mask=keep,
                                       sem="relaxed")
            else:
                total = _sum_rows(rows_ptr, tl.num_programs(0), NUM_BINS, SUM_ROWS)
            tl.store(out_ptr + bins, total, mask=keep)
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed")
