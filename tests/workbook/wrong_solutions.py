"""Known-wrong solutions, at least two per exercise: each must fail its check, for its reason."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.types import WorkspaceShapes
from moekit.workbook.backends import GatedTorchExperts
from moekit.workbook.solutions.chunk_plan import chunk_inputs, chunk_plan

# -- 1. the chunk plan ------------------------------------------------------------------------


def plan_drops_the_short_chunk(M, C):
    step = max(M if C is None else C, 1)
    return [(s, s + step) for s in range(0, M - M % step, step)]


def inputs_slice_a_per_tensor_scale(hidden, topk_ids, a_scale, start, end):  # vLLM #28728
    return hidden[start:end], topk_ids[start:end], None if a_scale is None else a_scale[start:end]


def inputs_copy_each_chunk(hidden, topk_ids, a_scale, start, end):
    h, i, s = chunk_inputs(hidden, topk_ids, a_scale, start, end)
    return h.clone(), i.clone(), s


# -- 2. workspace shapes ----------------------------------------------------------------------


class FlatOutputExperts(GatedTorchExperts):  # DeepGEMM's pre-fix output rule: 2-D
    def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
        pairs = problem.M * problem.topk
        return WorkspaceShapes((pairs, problem.N), (pairs, problem.N // 2), (pairs, problem.K), act_dtype)


class HalfWidthExperts(GatedTorchExperts):  # workspace13 sized for the activation, not GEMM1
    def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
        pairs = problem.M * problem.topk
        return WorkspaceShapes((pairs, problem.N // 2), (pairs, problem.N // 2), (problem.M, problem.topk, problem.K),
                               act_dtype)  # fmt: skip


class WholeBatchExperts(GatedTorchExperts):  # workspaces for a fixed, large batch: every chunk
    def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
        big = 512 * problem.topk
        return WorkspaceShapes((big, problem.N), (big, problem.N // 2), (problem.M, problem.topk, problem.K), act_dtype)


# -- 3. the recount ---------------------------------------------------------------------------


def counts_of_the_whole_batch(topk_ids, start, end, num_local_experts, expert_map=None):  # bug 2
    from moekit.workbook.solutions.recount import chunk_counts

    return chunk_counts(topk_ids, 0, topk_ids.shape[0], num_local_experts, expert_map)


def counts_gather_minus_one(topk_ids, start, end, num_local_experts, expert_map=None):
    ids = topk_ids[start:end].reshape(-1).long()
    local = expert_map.long()[ids] if expert_map is not None else ids  # expert_map[-1]: the last entry
    ok = (local >= 0) & (local < num_local_experts)
    return torch.bincount(torch.where(ok, local + 1, 0), minlength=num_local_experts + 1)[1:]


# -- 4. count kernels ---------------------------------------------------------------------------


@triton.jit
def scan_unmasked_gather(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                         HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    expert = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        inside = start + offs < numel
        ids = tl.load(ids_ptr + start + offs, mask=inside, other=-1)
        if HAS_MAP:
            ids = tl.load(map_ptr + ids, mask=inside)  # reads the map at -1
        total += (inside & (ids == expert)).to(tl.int32)
    tl.store(out_ptr + expert, tl.sum(total, axis=0))


@triton.jit
def scan_ignores_the_map(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                         HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    expert = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < numel, other=-1)
        total += (ids == expert).to(tl.int32)
    tl.store(out_ptr + expert, tl.sum(total, axis=0))


@triton.jit
def histogram_that_scans(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                         HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # Right answers, but every program re-reads its tile once per expert.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    for e in range(0, num_local):
        ids = tl.load(ids_ptr + offs, mask=inside, other=-1)
        ok = inside & (ids >= 0) & (ids < id_limit)
        if HAS_MAP:
            ids = tl.load(map_ptr + ids, mask=ok, other=-1)
        tl.atomic_add(out_ptr + e, tl.sum((ok & (ids == e)).to(tl.int32), axis=0))


@triton.jit
def histogram_unmasked_tail(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                            HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs)  # reads past the last id
    ok = (ids >= 0) & (ids < id_limit)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=ok, other=-1)
    ok = ok & (ids >= 0) & (ids < num_local)
    hist = tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    tl.atomic_add(out_ptr + bins, hist, mask=(bins < num_local) & (hist > 0))


# -- 5. align ---------------------------------------------------------------------------------


@triton.jit
def align_without_padding(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                          BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < numel, other=-1)
        ok = (ids >= 0) & (ids < num_experts)
        counts += tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    counts = tl.where(bins < num_experts, counts, 0)
    starts = tl.cumsum(counts, axis=0) - counts  # runs not padded to BLOCK_M
    tl.store(post_ptr, tl.sum(counts, axis=0))
    tl.store(cursor_ptr + bins, starts)
    for start in range(0, numel, BLOCK):
        pair = start + offs
        ids = tl.load(ids_ptr + pair, mask=pair < numel, other=-1)
        ok = (ids >= 0) & (ids < num_experts)
        row = tl.atomic_add(cursor_ptr + tl.where(ok, ids, 0), 1, mask=ok)
        tl.store(sorted_ptr + row, pair, mask=ok)


@triton.jit
def align_keeps_empty_slots(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                            BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # -1 slots are clamped to expert 0 instead of dropped.
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        inside = start + offs < numel
        ids = tl.maximum(tl.load(ids_ptr + start + offs, mask=inside, other=-1), 0)
        counts += tl.histogram(tl.where(inside, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    tl.store(post_ptr, tl.sum(padded, axis=0))
    tl.store(cursor_ptr + bins, starts)
    for e in range(0, num_experts):
        first = tl.load(cursor_ptr + e) // BLOCK_M
        n = tl.sum(tl.where(bins == e, padded, 0), axis=0) // BLOCK_M
        for b in range(0, n):
            tl.store(expert_ids_ptr + first + b, e)
    for start in range(0, numel, BLOCK):
        pair = start + offs
        inside = pair < numel
        ids = tl.maximum(tl.load(ids_ptr + pair, mask=inside, other=-1), 0)
        row = tl.atomic_add(cursor_ptr + ids, 1, mask=inside)
        tl.store(sorted_ptr + row, pair, mask=inside)


# -- 6. row plan ------------------------------------------------------------------------------


def rows_one_chunk_per_expert(counts, R, block=128):
    plan, start = [], 0
    for c in counts:
        n = (int(c) + block - 1) // block * block
        if n:
            plan.append((start, start + n))
        start += n
    return plan


def rows_unpadded(counts, R):
    return chunk_plan(int(sum(counts)), R)


WRONG = {
    "chunk_plan": [
        ((plan_drops_the_short_chunk, chunk_inputs), "chunk_plan"),
        ((chunk_plan, inputs_slice_a_per_tensor_scale), "per-tensor scale"),
        ((chunk_plan, inputs_copy_each_chunk), "copied the rows"),
    ],
    "workspace_shapes": [
        ((FlatOutputExperts,), "IndexError"),
        ((HalfWidthExperts,), "WorkspaceShapeError"),
        ((WholeBatchExperts,), "not the batch"),
    ],
    "recount": [
        ((counts_of_the_whole_batch,), "chunk_counts"),
        ((counts_gather_minus_one,), "expected"),
    ],
    "scan_kernel": [((scan_unmasked_gather,), "expected"), ((scan_ignores_the_map,), "expected")],
    "histogram_kernel": [((histogram_that_scans,), "reads each id once"), ((histogram_unmasked_tail,), "expected")],
    "align_kernel": [((align_without_padding,), "expected"), ((align_keeps_empty_slots,), "expected")],
    "row_plan": [((rows_one_chunk_per_expert,), "every chunk must hold"), ((rows_unpadded,), "tile")],
}
