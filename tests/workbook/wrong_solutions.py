"""Known-wrong solutions, at least two per exercise and at least one per kind of mistake: each
must fail its check, for its reason.

``WRONG[key]`` lists ``(objects, reason)`` or ``(objects, reason, "interpreter")``: the last kind
gives right answers and fails on *how* it ran, which only Triton's interpreter can watch (on a
GPU build the check cannot see it, and the test skips)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.types import WorkspaceShapes
from moekit.workbook.backends import GatedTorchExperts
from moekit.workbook.solutions.align import align_kernel
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


def inputs_upcast_the_rows(hidden, topk_ids, a_scale, start, end):  # .float(): a copy of bf16 rows
    h, i, s = chunk_inputs(hidden, topk_ids, a_scale, start, end)
    return h.float(), i, s


def inputs_copy_the_scale(hidden, topk_ids, a_scale, start, end):  # scales "are small": a copy is cheap
    h, i, s = chunk_inputs(hidden, topk_ids, a_scale, start, end)
    return h, i, None if s is None else s.clone()


def inputs_make_contiguous(hidden, topk_ids, a_scale, start, end):  # "kernels want contiguous rows"
    h, i, s = chunk_inputs(hidden, topk_ids, a_scale, start, end)
    return h.contiguous(), i, s


def inputs_per_token_scale_only(hidden, topk_ids, a_scale, start, end):  # only an [M, 1] scale has rows
    per_token = a_scale is not None and a_scale.dim() == 2 and a_scale.shape[1] == 1
    return hidden[start:end], topk_ids[start:end], a_scale[start:end] if per_token else a_scale


_SEEN = {}


def inputs_memoised(hidden, topk_ids, a_scale, start, end):  # views kept per chunk: the next batch gets the old rows
    key = (tuple(hidden.shape), tuple(topk_ids.shape), start, end, a_scale is None)
    return _SEEN.setdefault(key, chunk_inputs(hidden, topk_ids, a_scale, start, end))


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


class Fp64ScratchExperts(GatedTorchExperts):  # the right shapes in float64 scratch: twice or four times the bytes
    def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
        pairs = problem.M * problem.topk
        return WorkspaceShapes((pairs, problem.N), (pairs, problem.N // 2), (problem.M, problem.topk, problem.K),
                               torch.float64)  # fmt: skip


class HalfNIsKExperts(GatedTorchExperts):  # the activation sized by K: right only when K == N / 2
    def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
        pairs = problem.M * problem.topk
        return WorkspaceShapes((pairs, problem.N), (pairs, problem.K), (problem.M, problem.topk, problem.K), act_dtype)


class TwiceKExperts(GatedTorchExperts):  # GEMM1's output sized 2K: right only when N == 2K
    def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
        pairs = problem.M * problem.topk
        return WorkspaceShapes((pairs, 2 * problem.K), (pairs, problem.N // 2), (problem.M, problem.topk, problem.K),
                               act_dtype)  # fmt: skip


class TokensMetaRowsExperts(GatedTorchExperts):  # rows = the local pairs tokens_meta counts: fewer than M * topk
    def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
        pairs = problem.M * problem.topk
        if tokens_meta is not None:
            pairs = int(tokens_meta.expert_num_tokens.sum())
        return WorkspaceShapes((pairs, problem.N), (pairs, problem.N // 2), (problem.M, problem.topk, problem.K),
                               act_dtype)  # fmt: skip


class HalfPrecisionScratchExperts(GatedTorchExperts):  # "fp16 scratch saves memory": half the bytes under fp32
    def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
        pairs = problem.M * problem.topk
        return WorkspaceShapes((pairs, problem.N), (pairs, problem.N // 2), (problem.M, problem.topk, problem.K),
                               torch.float16)  # fmt: skip


# -- 3. the recount ---------------------------------------------------------------------------


def counts_of_the_whole_batch(topk_ids, start, end, num_local_experts, expert_map=None):  # bug 2
    from moekit.workbook.solutions.recount import chunk_counts

    return chunk_counts(topk_ids, 0, topk_ids.shape[0], num_local_experts, expert_map)


def counts_gather_minus_one(topk_ids, start, end, num_local_experts, expert_map=None):
    ids = topk_ids[start:end].reshape(-1).long()
    if expert_map is not None:
        ids = torch.where(ids < expert_map.numel(), ids, -1)  # past the map: marked empty, like -1 ...
    local = expert_map.long()[ids] if expert_map is not None else ids  # ... but expert_map[-1] is the last entry
    ok = (local >= 0) & (local < num_local_experts)
    return torch.bincount(torch.where(ok, local + 1, 0), minlength=num_local_experts + 1)[1:]


def counts_gather_past_the_map(topk_ids, start, end, num_local_experts, expert_map=None):
    from moekit.workbook.solutions.recount import chunk_counts

    if expert_map is None:
        return chunk_counts(topk_ids, start, end, num_local_experts)
    ids = topk_ids[start:end].reshape(-1).long()
    ok = ids >= 0  # -1 masked, but ids past the map are gathered
    local = expert_map.long()[ids.clamp(min=0)]
    return torch.bincount(torch.where(ok & (local >= 0), local + 1, 0), minlength=num_local_experts + 1)[1:]


def counts_extra_bins(topk_ids, start, end, num_local_experts, expert_map=None):
    from moekit.workbook.solutions.recount import chunk_counts

    if expert_map is not None:
        return chunk_counts(topk_ids, start, end, num_local_experts, expert_map)
    ids = topk_ids[start:end].reshape(-1).long()
    ok = ids >= 0  # -1 masked, but ids >= E_local without a map get bins of their own
    return torch.bincount(torch.where(ok, ids + 1, 0), minlength=num_local_experts + 1)[1:]


def counts_at_least_one_row(topk_ids, start, end, num_local_experts, expert_map=None):
    from moekit.workbook.solutions.recount import chunk_counts

    return chunk_counts(topk_ids, start, max(end, start + 1), num_local_experts, expert_map)  # "no empty slices"


_COUNTED = {}


def counts_memoised(topk_ids, start, end, num_local_experts, expert_map=None):  # bug 2 again, by a cache
    from moekit.workbook.solutions.recount import chunk_counts

    key = (tuple(topk_ids.shape), start, end, num_local_experts, expert_map is None)
    if key not in _COUNTED:
        _COUNTED[key] = chunk_counts(topk_ids, start, end, num_local_experts, expert_map)
    return _COUNTED[key]


def counts_in_int16(topk_ids, start, end, num_local_experts, expert_map=None):  # "counts are small"
    from moekit.workbook.solutions.recount import chunk_counts

    return chunk_counts(topk_ids, start, end, num_local_experts, expert_map).to(torch.int16)


_BY_ADDRESS = {}


def counts_cached_by_address(topk_ids, start, end, num_local_experts, expert_map=None):  # a static buffer refilled
    from moekit.workbook.solutions.recount import chunk_counts

    key = (topk_ids.data_ptr(), tuple(topk_ids.shape), start, end, num_local_experts, expert_map is None)
    if key not in _BY_ADDRESS:
        _BY_ADDRESS[key] = chunk_counts(topk_ids, start, end, num_local_experts, expert_map)
    return _BY_ADDRESS[key].clone()


def counts_through_uint8(topk_ids, start, end, num_local_experts, expert_map=None):  # "ids fit a byte when E < 256"
    from moekit.workbook.solutions.recount import chunk_counts

    limit = expert_map.numel() if expert_map is not None else num_local_experts
    ids = topk_ids[start:end].to(torch.uint8).long() if limit < 256 else topk_ids[start:end]  # 256 + e becomes e
    return chunk_counts(ids, 0, ids.shape[0], num_local_experts, expert_map)


def counts_in_the_ids_dtype(topk_ids, start, end, num_local_experts, expert_map=None):  # int16 ids: int16 counts
    from moekit.workbook.solutions.recount import chunk_counts

    return chunk_counts(topk_ids, start, end, num_local_experts, expert_map).to(topk_ids.dtype)


def counts_through_int32(topk_ids, start, end, num_local_experts, expert_map=None):  # .int(): 2**32 + e is e
    from moekit.workbook.solutions.recount import chunk_counts

    ids = topk_ids[start:end].int()
    return chunk_counts(ids, 0, ids.shape[0], num_local_experts, None if expert_map is None else expert_map.int())


def counts_as_floats(topk_ids, start, end, num_local_experts, expert_map=None):  # torch.histc-style float counts
    from moekit.workbook.solutions.recount import chunk_counts

    return chunk_counts(topk_ids, start, end, num_local_experts, expert_map).float()


def counts_assume_a_contiguous_map(topk_ids, start, end, num_local_experts, expert_map=None):
    ids = topk_ids[start:end].reshape(-1).long()
    if expert_map is not None:  # local id = global id - the first local expert: true of contiguous maps only
        ids = ids - int((expert_map >= 0).nonzero()[0])
    ok = (ids >= 0) & (ids < num_local_experts)
    return torch.bincount(torch.where(ok, ids + 1, 0), minlength=num_local_experts + 1)[1:]


def counts_index_the_map_with_the_ids(topk_ids, start, end, num_local_experts, expert_map=None):  # no .long()
    ids = topk_ids[start:end].reshape(-1)
    limit = expert_map.numel() if expert_map is not None else num_local_experts
    ok = (ids >= 0) & (ids < limit)
    local = expert_map[torch.where(ok, ids, 0)].long() if expert_map is not None else ids.long()
    ok &= (local >= 0) & (local < num_local_experts)
    return torch.bincount(torch.where(ok, local + 1, 0), minlength=num_local_experts + 1)[1:]


def counts_mark_foreign_ids_in_place(topk_ids, start, end, num_local_experts, expert_map=None):
    from moekit.workbook.solutions.recount import chunk_counts

    ids = topk_ids[start:end]  # a view: the caller's ids change
    ids[ids >= (expert_map.numel() if expert_map is not None else num_local_experts)] = -1
    return chunk_counts(topk_ids, start, end, num_local_experts, expert_map)


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
def scan_past_the_map(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                      HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    expert = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        inside = start + offs < numel
        ids = tl.load(ids_ptr + start + offs, mask=inside, other=-1)
        ok = inside & (ids >= 0)  # -1 masked; ids past the map gathered
        if HAS_MAP:
            ids = tl.load(map_ptr + ids, mask=ok, other=-1)
        total += (ok & (ids == expert)).to(tl.int32)
    tl.store(out_ptr + expert, tl.sum(total, axis=0))


@triton.jit
def scan_in_one_program(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                        HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # Right counts, but program 0 walks the ids for every expert and the others do nothing.
    if tl.program_id(0) == 0:
        offs = tl.arange(0, BLOCK)
        for expert in range(0, num_local):
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
def scan_zero_fills_out(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                        HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # Program 0 zero-fills out while the others add to it: on a GPU nothing orders the two.
    expert = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if expert == 0:
        tl.store(out_ptr + offs, 0, mask=offs < num_local)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        inside = start + offs < numel
        ids = tl.load(ids_ptr + start + offs, mask=inside, other=-1)
        ok = inside & (ids >= 0) & (ids < id_limit)
        if HAS_MAP:
            ids = tl.load(map_ptr + ids, mask=ok, other=-1)
        total += (ok & (ids == expert)).to(tl.int32)
    tl.atomic_add(out_ptr + expert, tl.sum(total, axis=0))


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


@triton.jit
def histogram_loops_experts_in_registers(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local, HAS_MAP: tl.constexpr,
                                         BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # Each id loaded once, then compared with every expert: a scan kept in registers.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1)
    ok = inside & (ids >= 0) & (ids < id_limit)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=ok, other=-1)
    for e in range(0, num_local):
        n = tl.sum((ok & (ids == e)).to(tl.int32), axis=0)
        tl.atomic_add(out_ptr + e, n, mask=n > 0)


@triton.jit
def histogram_rereads_by_atomic(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                                HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # A per-expert scan whose re-reads of the ids go through tl.atomic_add(ptr, 0), not tl.load.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    for e in range(0, num_local):
        ids = tl.atomic_add(ids_ptr + offs, 0, mask=inside)
        ok = inside & (ids >= 0) & (ids < id_limit)
        if HAS_MAP:
            ids = tl.load(map_ptr + ids, mask=ok, other=-1)
        n = tl.sum((ok & (ids == e)).to(tl.int32), axis=0)
        tl.atomic_add(out_ptr + e, n, mask=n > 0)


@triton.jit
def histogram_load_add_store(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                             HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # Right in the interpreter (programs run one by one); on a GPU the programs race on out.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1)
    ok = inside & (ids >= 0) & (ids < id_limit)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=ok, other=-1)
    ok = ok & (ids >= 0) & (ids < num_local)
    hist = tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    keep = bins < num_local
    tl.store(out_ptr + bins, tl.load(out_ptr + bins, mask=keep) + hist, mask=keep)


@triton.jit
def histogram_unmasked_bins(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                            HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # Zeros added to the bins past num_local: right counts, but atomics on memory past out.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1)
    ok = inside & (ids >= 0) & (ids < id_limit)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=ok, other=-1)
    ok = ok & (ids >= 0) & (ids < num_local)
    hist = tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    tl.atomic_add(out_ptr + bins, tl.where(bins < num_local, hist, 0))


@triton.jit
def histogram_in_one_program(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                             HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # Each id read once, but program 0 reads them all and the other programs idle.
    if tl.program_id(0) == 0:
        hist = tl.zeros([NUM_BINS], dtype=tl.int32)
        for start in range(0, numel, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < numel
            ids = tl.load(ids_ptr + offs, mask=inside, other=-1)
            ok = inside & (ids >= 0) & (ids < id_limit)
            if HAS_MAP:
                ids = tl.load(map_ptr + ids, mask=ok, other=-1)
            ok = ok & (ids >= 0) & (ids < num_local)
            hist += tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
        bins = tl.arange(0, NUM_BINS)
        tl.store(out_ptr + bins, hist, mask=bins < num_local)


@triton.jit
def histogram_unbounded_ids(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                            HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # Bounds the map's index but not the local id: ids >= num_local reach tl.histogram.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1)
    ok = inside & (ids >= 0) & (ids < id_limit)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=ok, other=-1)
    ok = inside & (ids >= 0)
    hist = tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    tl.atomic_add(out_ptr + bins, hist, mask=(bins < num_local) & (hist > 0))


@triton.jit
def scan_int8_lanes(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.int8)  # "a lane counts a few ids": past 127 it wraps
    for start in range(0, numel, BLOCK):
        inside = start + offs < numel
        ids = tl.load(ids_ptr + start + offs, mask=inside, other=-1)
        ok = inside & (ids >= 0) & (ids < id_limit)
        if HAS_MAP:
            ids = tl.load(map_ptr + ids, mask=ok, other=-1)
        total += (ok & (ids == expert)).to(tl.int8)
    tl.store(out_ptr + expert, tl.sum(total, axis=0))


@triton.jit
def histogram_block_64(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                       HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * 64 + tl.arange(0, 64)  # the tile the old check always launched with
    inside = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1)
    ok = inside & (ids >= 0) & (ids < id_limit)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=ok, other=-1)
    ok = ok & (ids >= 0) & (ids < num_local)
    hist = tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    tl.atomic_add(out_ptr + bins, hist, mask=(bins < num_local) & (hist > 0))


@triton.jit
def histogram_int8_tile(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                        HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1)
    ok = inside & (ids >= 0) & (ids < id_limit)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=ok, other=-1)
    ok = ok & (ids >= 0) & (ids < num_local)
    hist = tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS).to(tl.int8)  # a tile of 256: wraps
    bins = tl.arange(0, NUM_BINS)
    tl.atomic_add(out_ptr + bins, hist, mask=(bins < num_local) & (hist != 0))


@triton.jit
def histogram_32_bins(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                      HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1)
    ok = inside & (ids >= 0) & (ids < id_limit)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=ok, other=-1)
    ok = ok & (ids >= 0) & (ids < num_local)
    hist = tl.histogram(tl.where(ok, ids, 31).to(tl.int32), 32)  # "32 bins": the old check's E stayed below 32
    bins = tl.arange(0, 32)
    tl.atomic_add(out_ptr + bins, hist, mask=(bins < num_local) & (bins < 31) & (hist > 0))


@triton.jit
def scan_stops_a_tile_early(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                            HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    expert = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    for tile in range(0, tl.cdiv(numel - 1, BLOCK)):  # misses the last id when numel % BLOCK == 1
        inside = tile * BLOCK + offs < numel
        ids = tl.load(ids_ptr + tile * BLOCK + offs, mask=inside, other=-1)
        ok = inside & (ids >= 0) & (ids < id_limit)
        if HAS_MAP:
            ids = tl.load(map_ptr + ids, mask=ok, other=-1)
        total += (ok & (ids == expert)).to(tl.int32)
    tl.store(out_ptr + expert, tl.sum(total, axis=0))


@triton.jit
def scan_int32_ids(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        inside = start + offs < numel
        ids = tl.load(ids_ptr + start + offs, mask=inside, other=-1).to(tl.int32)  # 2**32 + e becomes e
        ok = inside & (ids >= 0) & (ids < id_limit)
        if HAS_MAP:
            ids = tl.load(map_ptr + ids, mask=ok, other=-1)
        total += (ok & (ids == expert)).to(tl.int32)
    tl.store(out_ptr + expert, tl.sum(total, axis=0))


@triton.jit
def _histogram_variant(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local, HAS_MAP: tl.constexpr,
                       BLOCK: tl.constexpr, NUM_BINS: tl.constexpr, IDS_INT32: tl.constexpr,
                       BINS_INT8: tl.constexpr, ONE_PAST: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1)
    if IDS_INT32:  # "ids are small": an int64 2**32 + e becomes e
        ids = ids.to(tl.int32)
    ok = inside & (ids >= 0) & (ids < id_limit)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=ok, other=-1)
    ok = ok & (ids >= 0) & (ids < num_local)
    values = tl.where(ok, ids, NUM_BINS - 1)
    if BINS_INT8:  # "bins fit a byte": experts past 127 turn negative
        values = values.to(tl.int8)
    hist = tl.histogram(values.to(tl.int32), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    last = num_local + 1 if ONE_PAST else num_local  # the spare bin is out[num_local] when num_local == NUM_BINS - 1
    tl.atomic_add(out_ptr + bins, hist, mask=(bins < last) & (hist > 0))


@triton.jit
def histogram_int32_ids(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                        HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    _histogram_variant(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local, HAS_MAP, BLOCK, NUM_BINS,
                       True, False, False)  # fmt: skip


@triton.jit
def histogram_int8_bins(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                        HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    _histogram_variant(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local, HAS_MAP, BLOCK, NUM_BINS,
                       False, True, False)  # fmt: skip


@triton.jit
def histogram_adds_the_spare_bin(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                                 HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    _histogram_variant(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local, HAS_MAP, BLOCK, NUM_BINS,
                       False, False, True)  # fmt: skip


@triton.jit
def histogram_256_bins(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local,
                       HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # "256 experts is the most anyone has": the argument ignored
    _histogram_variant(ids_ptr, map_ptr, out_ptr, numel, id_limit, num_local, HAS_MAP, BLOCK, 256, False, False, False)


class HostHistogram:  # kernel[grid](...) runs torch on the host: no Triton kernel at all
    def __getitem__(self, grid):
        from moekit.reference import count_reference

        def run(ids, map_, out, numel, id_limit, num_local, HAS_MAP, BLOCK, NUM_BINS):
            out += count_reference(ids, num_local, map_ if HAS_MAP else None).to(out.dtype)

        return run


def _host_align(ids, sorted_ids, expert_ids, post, cursor, numel, num_experts, BLOCK_M, BLOCK, NUM_BINS):
    local = torch.where((ids >= 0) & (ids < num_experts), ids.long(), num_experts)
    counts = torch.bincount(local, minlength=num_experts + 1)[:num_experts]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    for e, start in enumerate((padded.cumsum(0) - padded).tolist()):
        sorted_ids[start : start + int(counts[e])] = (local == e).nonzero().flatten().to(sorted_ids.dtype)
    expert_ids[: int(padded.sum()) // BLOCK_M] = torch.repeat_interleave(torch.arange(num_experts), padded // BLOCK_M)
    post[0] = padded.sum()


def _no_op():
    pass


class HostAlignBehindJit(type(triton.jit(_no_op))):  # a @triton.jit object whose launch runs torch on the host
    def __getitem__(self, grid):
        return _host_align


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
    # -1 slots are clamped to expert 0 instead of dropped (ids >= num_experts are dropped).
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        inside = start + offs < numel
        ids = tl.maximum(tl.load(ids_ptr + start + offs, mask=inside, other=-1), 0)
        inside = inside & (ids < num_experts)
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
        inside = inside & (ids < num_experts)
        row = tl.atomic_add(cursor_ptr + tl.where(inside, ids, 0), 1, mask=inside)
        tl.store(sorted_ptr + row, pair, mask=inside)


@triton.jit
def _align_pass1(ids_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                 BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr,
                 OVERPAD: tl.constexpr, BLOCKS_EXTRA: tl.constexpr, FIRST_ONLY: tl.constexpr,
                 MIN_ONE: tl.constexpr = False, IDS_INT32: tl.constexpr = False):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < numel, other=-1)
        if IDS_INT32:  # an int64 2**32 + e becomes e
            ids = ids.to(tl.int32)
        ok = (ids >= 0) & (ids < num_experts)
        counts += tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    counts = tl.where(bins < num_experts, counts, 0)
    if OVERPAD:  # one block more than needed when the count is a multiple of BLOCK_M
        padded = tl.where(counts > 0, (counts // BLOCK_M + 1) * BLOCK_M, 0)
    else:
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    tl.store(post_ptr, tl.sum(padded, axis=0))
    tl.store(cursor_ptr + bins, starts)
    for e in range(0, num_experts):
        first = tl.load(cursor_ptr + e) // BLOCK_M
        n = tl.sum(tl.where(bins == e, padded, 0), axis=0) // BLOCK_M
        if FIRST_ONLY:
            n = tl.minimum(n, 1)
        if MIN_ONE:  # a block for every expert, even one with no pairs
            n = tl.maximum(n, 1)
        for b in range(0, n + BLOCKS_EXTRA):
            tl.store(expert_ids_ptr + first + b, e)


@triton.jit
def _align_pass2(ids_ptr, sorted_ptr, cursor_ptr, numel, limit, BLOCK: tl.constexpr, IDS_INT32: tl.constexpr = False):
    offs = tl.arange(0, BLOCK)
    for start in range(0, numel, BLOCK):
        pair = start + offs
        ids = tl.load(ids_ptr + pair, mask=pair < numel, other=-1)
        if IDS_INT32:
            ids = ids.to(tl.int32)
        ok = (ids >= 0) & (ids < limit)
        row = tl.atomic_add(cursor_ptr + tl.where(ok, ids, 0), 1, mask=ok)
        tl.store(sorted_ptr + row, pair, mask=ok)


@triton.jit
def align_overpads_multiples(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                             BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    _align_pass1(ids_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts, BLOCK_M, BLOCK, NUM_BINS,
                 True, 0, False)  # fmt: skip
    _align_pass2(ids_ptr, sorted_ptr, cursor_ptr, numel, num_experts, BLOCK)


@triton.jit
def align_first_block_only(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                           BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    _align_pass1(ids_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts, BLOCK_M, BLOCK, NUM_BINS,
                 False, 0, True)  # fmt: skip
    _align_pass2(ids_ptr, sorted_ptr, cursor_ptr, numel, num_experts, BLOCK)


@triton.jit
def align_expert_ids_one_block_long(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                                    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    _align_pass1(ids_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts, BLOCK_M, BLOCK, NUM_BINS,
                 False, 1, False)  # fmt: skip
    _align_pass2(ids_ptr, sorted_ptr, cursor_ptr, numel, num_experts, BLOCK)


@triton.jit
def align_a_block_for_empty_experts(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                                    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    _align_pass1(ids_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts, BLOCK_M, BLOCK, NUM_BINS,
                 False, 0, False, True)  # fmt: skip
    _align_pass2(ids_ptr, sorted_ptr, cursor_ptr, numel, num_experts, BLOCK)


@triton.jit
def align_bounded_by_the_bins(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                              BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # Pass 2 bounds ids by NUM_BINS, not num_experts: ids in [num_experts, NUM_BINS) take rows
    # from cursor entries past the last run, i.e. past num_tokens_post_padded.
    _align_pass1(ids_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts, BLOCK_M, BLOCK, NUM_BINS,
                 False, 0, False)  # fmt: skip
    _align_pass2(ids_ptr, sorted_ptr, cursor_ptr, numel, NUM_BINS, BLOCK)


@triton.jit
def align_unbounded_ids(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                        BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # Drops -1 only: ids >= num_experts reach the histogram and index the cursor past its end.
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, numel, BLOCK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < numel, other=-1)
        counts += tl.histogram(tl.where(ids >= 0, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
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
        ids = tl.load(ids_ptr + pair, mask=pair < numel, other=-1)
        ok = ids >= 0
        row = tl.atomic_add(cursor_ptr + tl.where(ok, ids, 0), 1, mask=ok)
        tl.store(sorted_ptr + row, pair, mask=ok)


@triton.jit
def align_int16_counts(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                       BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([NUM_BINS], dtype=tl.int16)  # "no expert gets 32768 pairs"
    for start in range(0, numel, BLOCK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < numel, other=-1)
        ok = (ids >= 0) & (ids < num_experts)
        counts += tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS).to(tl.int16)
    bins = tl.arange(0, NUM_BINS)
    counts = tl.where(bins < num_experts, counts, 0).to(tl.int32)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    tl.store(post_ptr, tl.sum(padded, axis=0))
    tl.store(cursor_ptr + bins, starts)
    for e in range(0, num_experts):
        first = tl.load(cursor_ptr + e) // BLOCK_M
        n = tl.sum(tl.where(bins == e, padded, 0), axis=0) // BLOCK_M
        for b in range(0, n):
            tl.store(expert_ids_ptr + first + b, e)
    _align_pass2(ids_ptr, sorted_ptr, cursor_ptr, numel, num_experts, BLOCK)


@triton.jit
def align_one_load_of_1024(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                           BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, 1024)  # "a batch fits one load": the old check's had at most 140 ids
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
    ok = (ids >= 0) & (ids < num_experts)
    counts = tl.histogram(tl.where(ok, ids, NUM_BINS - 1).to(tl.int32), NUM_BINS)
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
    row = tl.atomic_add(cursor_ptr + tl.where(ok, ids, 0), 1, mask=ok)
    tl.store(sorted_ptr + row, offs, mask=ok)


@triton.jit
def align_clears_foreign_ids(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                             BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # Right layout, but it writes -1 over the ids it drops, in the caller's topk_ids.
    offs = tl.arange(0, BLOCK)
    for start in range(0, numel, BLOCK):
        inside = start + offs < numel
        ids = tl.load(ids_ptr + start + offs, mask=inside, other=-1)
        tl.store(ids_ptr + start + offs, tl.where((ids >= 0) & (ids < num_experts), ids, -1), mask=inside)
    _align_pass1(ids_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts, BLOCK_M, BLOCK, NUM_BINS,
                 False, 0, False)  # fmt: skip
    _align_pass2(ids_ptr, sorted_ptr, cursor_ptr, numel, num_experts, BLOCK)


@triton.jit
def align_without_barriers(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                           BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # the hint's two passes, right in the interpreter; on a GPU a thread may load a cursor before it is stored
    _align_pass1(ids_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts, BLOCK_M, BLOCK, NUM_BINS,
                 False, 0, False)  # fmt: skip
    _align_pass2(ids_ptr, sorted_ptr, cursor_ptr, numel, num_experts, BLOCK)


@triton.jit
def align_int32_ids(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    _align_pass1(ids_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts, BLOCK_M, BLOCK, NUM_BINS,
                 False, 0, False, False, True)  # fmt: skip
    tl.debug_barrier()
    _align_pass2(ids_ptr, sorted_ptr, cursor_ptr, numel, num_experts, BLOCK, True)


@triton.jit
def align_marks_the_next_block(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                               BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    # the solution, then -1 ("no expert") in the block after the last: a write past num_tokens_post_padded
    align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, numel, num_experts,
                 BLOCK_M, BLOCK, NUM_BINS)  # fmt: skip
    tl.debug_barrier()
    tl.store(expert_ids_ptr + tl.load(post_ptr) // BLOCK_M, -1)


# -- 6. row plan ------------------------------------------------------------------------------


def rows_one_chunk_per_expert(counts, R, block=128):
    plan, start = [], 0
    for c in counts:
        n = (int(c) + block - 1) // block * block
        if n:
            plan.append((start, start + n))
        start += n
    return plan


def rows_overpad_multiples(counts, R, block=128):
    total = sum((int(c) // block + 1) * block for c in counts if c)  # one block too many at exact multiples
    return [(s, min(s + R, total)) for s in range(0, total, R)]


def rows_unpadded(counts, R):
    return chunk_plan(int(sum(counts)), R)


_PLANNED = {}


def rows_memoised(counts, R, block=128):  # a plan per (experts, R): the next batch gets the old plan
    from moekit.workbook.solutions.row_plan import row_chunk_plan

    return _PLANNED.setdefault((len(counts), R), row_chunk_plan(counts, R, block))


_BY_IDENTITY = {}


def rows_cached_by_identity(counts, R, block=128):  # a plan per list object: refilled counts get the old plan
    from moekit.workbook.solutions.row_plan import row_chunk_plan

    return _BY_IDENTITY.setdefault((id(counts), R), row_chunk_plan(counts, R, block))


def rows_pad_counts_in_place(counts, R, block=128):
    counts[:] = [(int(c) + block - 1) // block * block for c in counts]  # the caller's counts, padded
    total = sum(counts)
    return [(s, min(s + R, total)) for s in range(0, total, R)]


WRONG = {
    "chunk_plan": [
        ((plan_drops_the_short_chunk, chunk_inputs), "chunk_plan"),
        ((chunk_plan, inputs_slice_a_per_tensor_scale), "per-tensor scale"),
        ((chunk_plan, inputs_copy_each_chunk), "copied hidden"),
        ((chunk_plan, inputs_upcast_the_rows), r"copied hidden \(a cast\)"),
        ((chunk_plan, inputs_copy_the_scale), "copied a_scale"),
        ((chunk_plan, inputs_make_contiguous), r"\(strided\).* copied hidden"),
        ((chunk_plan, inputs_per_token_scale_only), r"per-group scale\) returned .* a_scale; expected its rows"),
        ((chunk_plan, inputs_memoised), "called again on new data of the same sizes"),
    ],
    "workspace_shapes": [
        ((FlatOutputExperts,), "IndexError"),
        ((HalfWidthExperts,), "WorkspaceShapeError"),
        ((WholeBatchExperts,), "bytes where this chunk needs"),
        ((Fp64ScratchExperts,), r"of torch.float64 \(act_dtype [^)]*\), \d+ bytes where this chunk needs"),
        ((HalfNIsKExperts,), "WorkspaceShapeError|bytes where this chunk needs"),
        ((TwiceKExperts,), "WorkspaceShapeError|bytes where this chunk needs"),
        ((TokensMetaRowsExperts,), "tokens_meta.*(WorkspaceShapeError|bytes where this chunk needs)"),
        ((HalfPrecisionScratchExperts,), r"of torch.float16 \(act_dtype|differs from the reference"),
    ],
    "recount": [
        ((counts_of_the_whole_batch,), "chunk_counts"),
        ((counts_gather_minus_one,), "expected"),
        ((counts_gather_past_the_map,), "IndexError"),
        ((counts_extra_bins,), "expected"),
        ((counts_at_least_one_row,), r"\[(\d+), \1\)"),
        ((counts_memoised,), "called again on new data of the same sizes"),
        ((counts_in_int16,), "counts of torch.int16; counts are int32 or int64"),
        ((counts_assume_a_contiguous_map,), r"(strided|random) map of rank .* gave"),
        ((counts_index_the_map_with_the_ids,), "IndexError in chunk_counts.* int16 ids"),
        ((counts_mark_foreign_ids_in_place,), "changed its input topk_ids"),
        ((counts_cached_by_address,), "written into the same input|gave"),  # or a freed address reused
        ((counts_through_uint8,), "gave"),
        ((counts_through_int32,), "map of rank .* gave"),  # 2**32 + e is drawn with a map
        ((counts_as_floats,), "counts of torch.float32; counts are int32 or int64"),
        ((counts_in_the_ids_dtype,), "counts of torch.int16; counts are int32 or int64"),
    ],
    "scan_kernel": [
        ((scan_unmasked_gather,), "expected"),
        ((scan_ignores_the_map,), "expected"),
        ((scan_past_the_map,), "expected|outside its tensors|wrote past its tensor"),
        ((scan_in_one_program,), "program 1 read 0 of the", "interpreter"),
        ((scan_zero_fills_out,), "without an atomic", "interpreter"),
        ((scan_int8_lanes,), "36000 pairs to one expert, BLOCK=256: got"),
        ((scan_stops_a_tile_early,), "got"),
        ((scan_int32_ids,), "int64 ids.*got", "interpreter"),  # 2**32 + e is drawn under the interpreter only
    ],
    "histogram_kernel": [
        ((histogram_that_scans,), "reads each id once", "interpreter"),
        ((histogram_unmasked_tail,), "expected"),
        ((histogram_loops_experts_in_registers,), "fixed amount of work per id", "interpreter"),
        ((histogram_rereads_by_atomic,), "an input|atomic_add does not support int16", "interpreter"),
        ((histogram_load_add_store,), "without an atomic", "interpreter"),
        ((histogram_in_one_program,), "all the work in one program", "interpreter"),
        ((histogram_unmasked_bins,), "outside its tensors", "interpreter"),
        ((histogram_unbounded_ids,), "tl.histogram the value|got", "interpreter"),  # 2**32 + e: a wrong count
        ((histogram_block_64,), r"BLOCK=(16|32|128|256): (got|program \d+ read|the kernel read \d+ of the)"),
        ((histogram_int8_tile,), r"BLOCK=(128|256): got"),
        ((histogram_32_bins,), "got"),
        ((histogram_int32_ids,), "int64 ids.*got", "interpreter"),
        ((histogram_int8_bins,), "got|tl.histogram the value"),
        ((histogram_adds_the_spare_bin,), "got|outside its tensors|wrote past its tensor"),
        ((histogram_256_bins,), "got"),
        ((HostHistogram(),), "not a @triton.jit function"),
    ],
    "align_kernel": [
        ((align_without_padding,), "expected"),
        ((align_keeps_empty_slots,), "expected"),
        ((align_overpads_multiples,), "num_tokens_post_padded|outside its tensors|wrote past its tensor"),
        ((align_first_block_only,), "expert_ids of the"),
        ((align_expert_ids_one_block_long,), "wrote past num_tokens_post_padded"),
        ((align_a_block_for_empty_experts,), "wrote past num_tokens_post_padded"),
        ((align_bounded_by_the_bins,), "wrote past num_tokens_post_padded"),
        ((align_unbounded_ids,), "outside its tensors|tl.histogram the value|wrote past (num_tokens_post|its tensor)"),
        ((align_int16_counts,), "36000 pairs to one expert"),
        ((align_one_load_of_1024,), r"num_tokens_post_padded|expert \d+ hold"),
        ((align_clears_foreign_ids,), "changed its input ids|elements of 'ids', an input"),
        ((align_without_barriers,), "no tl.debug_barrier", "interpreter"),
        ((align_marks_the_next_block,), "wrote past num_tokens_post_padded"),
        ((align_int32_ids,), r"expert \d+ hold|num_tokens_post_padded", "interpreter"),
        ((HostAlignBehindJit(_no_op),), "no Triton kernel ran", "interpreter"),
    ],
    "row_plan": [
        ((rows_one_chunk_per_expert,), "every chunk must hold|suffice"),
        ((rows_unpadded,), "tile"),
        ((rows_overpad_multiples,), "must tile"),
        ((rows_memoised,), "called again on new data of the same sizes"),
        ((rows_pad_counts_in_place,), "changed its input counts"),
        ((rows_cached_by_identity,), "written into the same|must tile|suffice|every chunk"),  # or an id reused
    ],
}
