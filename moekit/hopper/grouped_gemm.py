"""The wing's grouped GEMM over aligned blocks: the book's tiles with TMA, tail tiles, fused epilogues, PDL.

Shapes (numel = M * topk (token, slot) pairs, E local experts, BM = BLOCK_M)::

    a         [rows_a, K]     GEMM1: hidden [M, K] (pair i reads row i // topk)
                              GEMM2: activations [M * topk, K] (pair i reads row i)
    w         [E, N, K]       one [N, K] matrix per expert (w1, or w2 with N = hidden size)
    out       [M, topk, N]    out[m, j] = pair (m, j)'s result, unweighted (GEMM1: workspace13,
                              GEMM2: the experts' output); pairs evenly strided
    blocks    AlignedBlocks   BM-row blocks of pairs, one expert each (moe_align_block_size),
              or PairBlocks   one pair per block, its expert read from topk_ids (decode)
    fp8 only: a_scale [rows_a, K/128] (1x128 groups), w_scale [E, N/128, K/128] (128x128 blocks)

One program computes a ``BLOCK_M x BLOCK_N`` tile: the rows of one block (all the same expert)
times a column slice of that expert's matrix. Rows are gathered through ``sorted_token_ids``,
so nothing is permuted in memory. A block of a remote expert (expert id -1) writes zeros.
GEMM1 can also finish with silu_and_mul (and the fp8 requantization) in its epilogue
(:class:`GatedOutput`), so the ``[M, topk, N]`` product never goes to memory. With
``KernelConfig.tma`` the weight tiles come through a TMA descriptor (fewer registers and
address instructions); the gathered activation rows always use per-thread async copies. The
padding rows of a block load nothing (masked), and with ``KernelConfig.TAIL_M`` a block holding
at most ``TAIL_M`` real rows (an expert's last) runs a ``TAIL_M``-row tile. Side by side with
vLLM's kernel on an H200: ``benchmarks/research/gpu_gemm_vs_vllm.py``; registers, spills and shared
memory of the compiled variants: ``benchmarks.kernel_report.kernel_reports(_fused_moe_kernel)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moekit.device import interpreting
from moekit.hopper.configs import KernelConfig
from moekit.hopper.gemm_args import GatedOutput, RowWindow, check_gemm_args
from moekit.hopper.launch import LeanLauncher, sm_count
from moekit.hopper.pair_blocks import PairBlocks
from moekit.hopper.pdl import pdl_begin
from moekit.kernels.activation import clamp_fp8, quantize_fp8_rows, round_for_store
from moekit.kernels.align import AlignedBlocks, bucket_of
from moekit.kernels.host_math import cdiv
from moekit.kernels.tma import tma_descriptor, weight_descriptor
from moekit.quant import FP8, FP8_GROUP, FP8_MAX, TINY_SCALE

# The output tile both kernels compute, with its fused epilogue ---------------------------------


@triton.jit
def _mma(acc, a, b, a_s, w_s, IS_FP8: tl.constexpr, UPCAST_BF16: tl.constexpr, DOT_IEEE: tl.constexpr):
    """acc += a @ b, dequantizing fp8 with one activation scale per row and one weight scale per column."""
    if IS_FP8:
        acc += tl.dot(a, b) * (a_s[:, None] * w_s[None, :])
    else:
        if UPCAST_BF16:  # the interpreter multiplies bf16 bit patterns in tl.dot
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if DOT_IEEE:  # fp32 stays fp32 (no tf32) so that fp32 results match the reference
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _load(ptrs, mask, EVEN_K: tl.constexpr):
    if EVEN_K:  # no mask: lets the loads vectorize fully
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _tile(
    a_ptr,
    w_ptr,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    sorted_ptr,
    out_scale_ptr,
    static_ptr,
    w_desc,
    a_desc,
    row0,
    pid_n,
    expert,
    N,
    K,
    numel,
    k_steps,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_osm,
    stride_osg,
    stride_static,
    static_div,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAIRS_PER_ROW: tl.constexpr,
    EVEN_K: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_GROUP: tl.constexpr,
    GATED: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    STATIC_OUT: tl.constexpr,
    W_TMA: tl.constexpr,
    A_TMA: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    FIX_ROUNDING: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TINY: tl.constexpr,
    READ_BY_POSITION: tl.constexpr,
    WRITE_BY_POSITION: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr = False,
):
    """One BLOCK_M x BLOCK_N output tile: rows [row0, row0 + BLOCK_M) of the layout, all of ``expert``.

    ``k_steps`` BLOCK_K steps along K (``cdiv(K, BLOCK_K)``; 0 stores the epilogue of a zero
    accumulator, which the persistent kernel uses for another rank's blocks). With ``PAIR_BLOCKS``
    the tile is pair ``row0`` alone (:mod:`moekit.hopper.pair_blocks`).
    """
    offs_m = row0 + tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:  # row0 is the tile's one pair; the other rows are padding
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, row0, numel)
    else:
        pair = tl.load(sorted_ptr + offs_m)
    live = pair < numel
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Padding rows load nothing (masked: zeros, no memory traffic) and columns past N wrap
    # around: every load is in bounds, and those lanes are never stored (or, written by
    # position, never read back).
    if READ_BY_POSITION:
        row = offs_m.to(tl.int64)
    else:
        row = tl.where(live, pair // PAIRS_PER_ROW, 0).to(tl.int64)
    col = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + col[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if IS_FP8:
        a_scale_ptrs = a_scale_ptr + row * stride_asm
        w_scale_ptrs = w_scale_ptr + expert * stride_wse + (col // FP8_GROUP) * stride_wsn
        w_up_scale_ptrs = w_scale_ptr + expert * stride_wse + ((col + N) // FP8_GROUP) * stride_wsn
    # TMA: w viewed as [E * rows, K]; rows past this expert's (last column tile) belong to the
    # next expert or are zero-filled past the end, and those columns are never stored.
    w_row = (expert * (2 * N if GATED else N) + pid_n * BLOCK_N).to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_steps):
        if A_TMA:  # rows read by position: the tile's rows are contiguous, one TMA box
            a = a_desc.load([row0, k * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=live[:, None] & (offs_k[None, :] < K - k * BLOCK_K), other=0.0)
        w_mask = offs_k[:, None] < K - k * BLOCK_K
        if IS_FP8:
            # One 1x128 activation scale per row and one 128x128 weight scale per column block.
            group = (k * BLOCK_K) // FP8_GROUP
            a_s = tl.load(a_scale_ptrs + group * stride_ask)
            w_s = tl.load(w_scale_ptrs + group * stride_wsk)
        else:
            a_s = 1.0
            w_s = 1.0
        if W_TMA:
            b = w_desc.load([w_row, k * BLOCK_K]).T
        else:
            b = _load(w_ptrs, w_mask, EVEN_K)
        acc = _mma(acc, a, b, a_s, w_s, IS_FP8, UPCAST_BF16, DOT_IEEE)
        if GATED:  # the up half: the same rows of a times w rows [N, 2N)
            if IS_FP8:
                w_up_s = tl.load(w_up_scale_ptrs + group * stride_wsk)
            else:
                w_up_s = 1.0
            if W_TMA:
                b_up = w_desc.load([w_row + N, k * BLOCK_K]).T
            else:
                b_up = _load(w_ptrs + N * stride_wn, w_mask, EVEN_K)
            acc_up = _mma(acc_up, a, b_up, a_s, w_up_s, IS_FP8, UPCAST_BF16, DOT_IEEE)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    # The output's addresses are formed only now: held across the loop they cost registers
    # (about 30 per thread at 128 x 256) that the pipeline needs.
    if WRITE_BY_POSITION:
        dest = offs_m.to(tl.int64)
        keep = offs_m >= 0
    else:
        dest = pair.to(tl.int64)
        keep = live
    out_ptrs = out_ptr + dest[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = keep[:, None] & (offs_n[None, :] < N)
    out_scale_ptrs = out_scale_ptr + dest * stride_osm + pid_n * stride_osg
    if GATED:  # silu(gate) * up from the fp32 accumulators
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if QUANT_OUT:  # fp8 with one scale per row of this 128-wide group (as moekit.quant)
        if STATIC_OUT:
            scale = tl.load(static_ptr + (tl.where(live, pair, 0) // static_div) * stride_static)
            acc = clamp_fp8(acc / scale[:, None], FP8_MAX)
        else:
            acc, scale = quantize_fp8_rows(acc, FP8_MAX, TINY)
        tl.store(out_scale_ptrs, scale, mask=keep)
    if FIX_ROUNDING:
        acc = round_for_store(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _weight_descriptor(w: torch.Tensor, config: KernelConfig) -> TensorDescriptor | None:
    """``w`` as ``[E * N, K]`` in ``[BLOCK_N, BLOCK_K]`` boxes, or None where TMA cannot read it."""
    return weight_descriptor(w, [config.BLOCK_N, config.BLOCK_K])


def _rows_descriptor(a: torch.Tensor, config: KernelConfig) -> TensorDescriptor | None:
    """Activations read by position (``[rows, K]`` in ``[BLOCK_M, BLOCK_K]`` boxes: a tile's rows are
    consecutive there), or None where TMA cannot read them."""
    return tma_descriptor(a, [config.BLOCK_M, config.BLOCK_K])


@triton.jit(do_not_specialize=["numel", "num_blocks", "row_base", "expert_off", "post_off", "num_experts", "num_local"])
def _fused_moe_kernel(
    # Pointers
    a_ptr,
    w_ptr,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    blocks_ptr,
    out_scale_ptr,
    static_ptr,
    w_desc,
    a_desc,
    ids_ptr,
    map_ptr,
    # Sizes
    N,
    K,
    numel,
    num_blocks,
    row_base,
    expert_off,
    post_off,
    num_experts,
    num_local,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_osm,
    stride_osg,
    stride_static,
    static_div,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PAIRS_PER_ROW: tl.constexpr,
    EVEN_K: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_GROUP: tl.constexpr,
    GATED: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    STATIC_OUT: tl.constexpr,
    W_TMA: tl.constexpr,
    A_TMA: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    FIX_ROUNDING: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TINY: tl.constexpr,
    EXPERT_BLOCK: tl.constexpr,
    READ_BY_POSITION: tl.constexpr,
    WRITE_BY_POSITION: tl.constexpr,
    TAIL_M: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)  # nothing is read before the previous kernel completes
    # The layout (moe_align_block_size) is one int32 buffer: sorted pair ids, expert ids, used rows.
    # This call computes its rows from row_base on.
    sorted_ptr = blocks_ptr + row_base
    expert_ids_ptr = blocks_ptr + expert_off + row_base // EXPERT_BLOCK
    post_ptr = blocks_ptr + post_off
    # N is the output width: with GATED, w has 2N rows (gate rows [0, N), up rows [N, 2N)).
    # GROUP_M row blocks sweep the columns together: neighbouring blocks are usually the same
    # expert, so its weight tiles come from L2 for all of them.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    # Rows are addressed by pair (token * topk + slot, scattered through sorted_token_ids) or, for
    # a chunk of sorted rows, by position in the chunk (a contiguous workspace of the chunk's rows).
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:  # block pid_m is pair pid_m alone (moekit.hopper.pair_blocks): nothing to load
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, numel)
        row0 = pid_m
    else:
        pair = tl.load(sorted_ptr + offs_m)
        row0 = pid_m * BLOCK_M
    live = pair < numel  # padding rows hold numel
    if WRITE_BY_POSITION:
        dest = offs_m.to(tl.int64)
        keep = offs_m >= 0  # every position: padding rows get values too (finite, never read back)
    else:
        dest = pair.to(tl.int64)
        keep = live
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + dest[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = keep[:, None] & (offs_n[None, :] < N)
    # With QUANT_OUT, BLOCK_N is the 128-wide group: program column pid_n owns scale column pid_n.
    out_scale_ptrs = out_scale_ptr + dest * stride_osm + pid_n * stride_osg
    # The grid is sized by an upper bound (no host sync): blocks past the real ones do no math;
    # a block of another rank's expert (id -1) contributes zeros.
    if PAIR_BLOCKS:  # the grid is exact; the expert as the align would place it (-1: a zero row)
        expert = bucket_of(ids_ptr, map_ptr, pid_m, numel, num_experts, num_local, HAS_MAP, True, 0)[1]
        expert = expert.to(tl.int64)
    else:
        past_end = row_base + pid_m * BLOCK_M >= tl.load(post_ptr)
        if not WRITE_BY_POSITION:
            if past_end:
                return
        expert = tl.load(expert_ids_ptr + (pid_m * BLOCK_M) // EXPERT_BLOCK).to(tl.int64)
        expert = tl.where(past_end, -1, expert)
    if expert == -1:  # (or past the end, for a chunk's workspace rows: zeros, not stale bytes)
        tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty), mask=out_mask)
        if QUANT_OUT:
            tl.store(out_scale_ptrs, tl.full([BLOCK_M], TINY, tl.float32), mask=keep)
        return

    # An expert's last block is often mostly padding (at 256 rows per expert and 128-row blocks,
    # a quarter of all rows): with TAIL_M, a block of at most TAIL_M real rows (always its first
    # rows) runs a TAIL_M-row tile instead. Both tiles are compiled into this kernel.
    SHORT_M: tl.constexpr = TAIL_M if TAIL_M > 0 else BLOCK_M
    short = False
    if TAIL_M > 0 and not WRITE_BY_POSITION:
        short = tl.sum(live.to(tl.int32)) <= TAIL_M
    if short:
        _tile(
            a_ptr,
            w_ptr,
            out_ptr,
            a_scale_ptr,
            w_scale_ptr,
            sorted_ptr,
            out_scale_ptr,
            static_ptr,
            w_desc,
            a_desc,
            row0,
            pid_n,
            expert,
            N,
            K,
            numel,
            tl.cdiv(K, BLOCK_K),
            stride_am,
            stride_ak,
            stride_we,
            stride_wn,
            stride_wk,
            stride_om,
            stride_on,
            stride_asm,
            stride_ask,
            stride_wse,
            stride_wsn,
            stride_wsk,
            stride_osm,
            stride_osg,
            stride_static,
            static_div,
            SHORT_M,
            BLOCK_N,
            BLOCK_K,
            PAIRS_PER_ROW,
            EVEN_K,
            IS_FP8,
            FP8_GROUP,
            GATED,
            QUANT_OUT,
            STATIC_OUT,
            W_TMA,
            False,
            UPCAST_BF16,
            DOT_IEEE,
            FIX_ROUNDING,
            FP8_MAX,
            TINY,
            READ_BY_POSITION,
            WRITE_BY_POSITION,
            PAIR_BLOCKS,
        )
    else:
        _tile(
            a_ptr,
            w_ptr,
            out_ptr,
            a_scale_ptr,
            w_scale_ptr,
            sorted_ptr,
            out_scale_ptr,
            static_ptr,
            w_desc,
            a_desc,
            row0,
            pid_n,
            expert,
            N,
            K,
            numel,
            tl.cdiv(K, BLOCK_K),
            stride_am,
            stride_ak,
            stride_we,
            stride_wn,
            stride_wk,
            stride_om,
            stride_on,
            stride_asm,
            stride_ask,
            stride_wse,
            stride_wsn,
            stride_wsk,
            stride_osm,
            stride_osg,
            stride_static,
            static_div,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            PAIRS_PER_ROW,
            EVEN_K,
            IS_FP8,
            FP8_GROUP,
            GATED,
            QUANT_OUT,
            STATIC_OUT,
            W_TMA,
            A_TMA,
            UPCAST_BF16,
            DOT_IEEE,
            FIX_ROUNDING,
            FP8_MAX,
            TINY,
            READ_BY_POSITION,
            WRITE_BY_POSITION,
            PAIR_BLOCKS,
        )


# The persistent walk -------------------------------------------------------------------------
#
# The grouped GEMM as a persistent kernel: one program per SM walks every (row block, column) tile.
#
# ``_fused_moe_kernel`` launches one program per tile of an upper bound on the layout's blocks (no
# host sync), so at large M the GPU runs waves of short programs, each paying its own prologue
# (index loads, the first TMA and async copies) and tail, and the programs past the layout's end
# still start and return. Here the grid is ``min(SMs, tiles)`` and each program strides over the
# tiles (``tile = program, program + SMs, ...``), reading the layout's used rows on the device::
#
#     used = cdiv(num_tokens_post_padded - row_base, BLOCK_M)     # not num_blocks: no empty programs
#     for tile in range(program_id, used * cdiv(N, BLOCK_N), NUM_SMS):   # flattened with the k-loop
#         pid_m, pid_n = grouped(tile)                            # GROUP_M row blocks share a column sweep
#         expert = expert_ids[pid_m]                              # -1: another rank's, zero k-steps
#         _tile(pid_m, pid_n, expert, k_steps = 0 if expert == -1 else cdiv(K, BLOCK_K))
#
# The k-loop of one tile and the walk over tiles are one flattened loop (``tl.range(flatten=True)``),
# so the software pipeline keeps loading the next tile's operands while this tile's epilogue
# stores. Tiles are the same as ``_fused_moe_kernel``'s (``_tile`` above), so
# the two kernels give bit-identical results on one GPU; a tile is computed by one program, with
# no split along K (deterministic). ``KernelConfig(persistent=True)`` selects it; it has no
# ``TAIL_M`` variant (one tile shape per flattened loop). Under the interpreter it runs with
# :data:`INTERPRETER_SMS` programs, so the CPU tests walk several tiles per program.

INTERPRETER_SMS = 3  # programs of a persistent launch under the interpreter: each walks several tiles


@triton.jit(do_not_specialize=["numel", "num_blocks", "row_base", "expert_off", "post_off", "num_experts", "num_local"])
def _persistent_moe_kernel(
    # Pointers (as _fused_moe_kernel)
    a_ptr,
    w_ptr,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    blocks_ptr,
    out_scale_ptr,
    static_ptr,
    w_desc,
    a_desc,
    ids_ptr,
    map_ptr,  # PAIR_BLOCKS only, which this kernel does not take (the launcher refuses it)
    # Sizes
    N,
    K,
    numel,
    num_blocks,
    row_base,
    expert_off,
    post_off,
    num_experts,
    num_local,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_osm,
    stride_osg,
    stride_static,
    static_div,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PAIRS_PER_ROW: tl.constexpr,
    EVEN_K: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_GROUP: tl.constexpr,
    GATED: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    STATIC_OUT: tl.constexpr,
    W_TMA: tl.constexpr,
    A_TMA: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    FIX_ROUNDING: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TINY: tl.constexpr,
    EXPERT_BLOCK: tl.constexpr,
    READ_BY_POSITION: tl.constexpr,
    WRITE_BY_POSITION: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    NUM_SMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    tl.static_assert(not PAIR_BLOCKS, "the persistent kernel walks an aligned layout")
    sorted_ptr = blocks_ptr + row_base
    expert_ids_ptr = blocks_ptr + expert_off + row_base // EXPERT_BLOCK
    post = tl.load(blocks_ptr + post_off)
    # A chunk's workspace written by position gets every block (those past the layout: zeros);
    # otherwise only the laid-out blocks are walked.
    if WRITE_BY_POSITION:
        used = num_blocks
    else:
        used = tl.minimum(num_blocks, tl.cdiv(tl.maximum(post - row_base, 0), BLOCK_M))
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    k_all = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), used * num_pid_n, NUM_SMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        first_m = (tile // per_group) * GROUP_M
        group_m = tl.minimum(used - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        row0 = pid_m * BLOCK_M
        expert = tl.load(expert_ids_ptr + row0 // EXPERT_BLOCK).to(tl.int64)
        expert = tl.where(row_base + row0 >= post, -1, expert)
        _tile(
            a_ptr,
            w_ptr,
            out_ptr,
            a_scale_ptr,
            w_scale_ptr,
            sorted_ptr,
            out_scale_ptr,
            static_ptr,
            w_desc,
            a_desc,
            row0,
            pid_n,
            expert,
            N,
            K,
            numel,
            tl.where(expert == -1, 0, k_all),
            stride_am,
            stride_ak,
            stride_we,
            stride_wn,
            stride_wk,
            stride_om,
            stride_on,
            stride_asm,
            stride_ask,
            stride_wse,
            stride_wsn,
            stride_wsk,
            stride_osm,
            stride_osg,
            stride_static,
            static_div,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            PAIRS_PER_ROW,
            EVEN_K,
            IS_FP8,
            FP8_GROUP,
            GATED,
            QUANT_OUT,
            STATIC_OUT,
            W_TMA,
            A_TMA,
            UPCAST_BF16,
            DOT_IEEE,
            FIX_ROUNDING,
            FP8_MAX,
            TINY,
            READ_BY_POSITION,
            WRITE_BY_POSITION,
        )


_GEMM = LeanLauncher(_fused_moe_kernel, pdl=True)
_PERSISTENT = LeanLauncher(_persistent_moe_kernel)  # no PDL: it ran slower with it (moekit.hopper.pdl)


def fused_moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    blocks: AlignedBlocks | PairBlocks,
    *,
    pairs_per_row: int,
    config: KernelConfig,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    gated: GatedOutput | None = None,
    chunk: RowWindow | None = None,
    stream: tuple[int, int] | None = None,
    check: bool = True,
) -> torch.Tensor:
    """``out[i] = a[i // pairs_per_row] @ w[expert(i)].T`` for every placed pair i; zeros for remote ones.

    Algorithm (fp32 accumulation; fp8 dequantizes per k-step with the two scales)::

        for block in range(num_tokens_post_padded // BM):
            e = expert_ids[block]
            for i in sorted_token_ids[block * BM : (block + 1) * BM]:
                if i == numel:                     # padding
                    continue
                y = a[i // pairs_per_row] @ w[e].T
                if gated:                          # w = [gate; up]
                    y = silu(y[:H]) * y[H:]        # (then fp8 + group scales if out is fp8)
                out[i] = 0 if e == -1 else y

    Pairs that ``blocks`` did not place (dropped empty slots) are not written.

    Args:
        a: ``[rows, K]`` activations, bf16/fp16/fp32 or fp8 e4m3 (then with ``a_scale``).
        w: ``[E, N, K]`` weights of the same dtype (fp8 with ``w_scale``).
        out: ``[M, topk, N]`` (``[M, topk, N/2]`` when gated) destination with ``M * topk`` =
            ``blocks.numel``, bf16/fp16/fp32 (bf16 for fp8 inputs, or fp8 with
            ``gated.out_scale``); pair (m, j) is addressed through ``out.stride(1)`` and a column
            through ``out.stride(2)``, as upstream's launcher did, so a 2-D ``out`` fails there
            with torch's IndexError (the crash of bug 1; ``ModularKernel``'s guard names it first).
        blocks: from :func:`moekit.kernels.align.moe_align_block_size` with ``config.BLOCK_M``, or
            :func:`moekit.hopper.pair_blocks.pair_blocks` (one pair per block, decode; not with
            ``chunk`` or a persistent config).
        pairs_per_row: pairs that share a row of ``a``: topk for GEMM1, 1 for GEMM2.
        config: tile sizes (:func:`moekit.hopper.configs.get_config`).
        a_scale: fp8 only, float32 ``[rows, K/128]`` (any strides, e.g. column-major).
        w_scale: fp8 only, float32 ``[E, N/128, K/128]``.
        gated: fuse silu_and_mul (and the fp8 requantization) into the epilogue; see
            :class:`GatedOutput`.
        chunk: compute only rows ``[start, end)`` of the layout, addressed as :class:`RowWindow`
            says (``out`` then holds ``end - start`` rows where it is written by position).
        stream: ``(device index, raw CUDA stream)`` for the lean launch (:func:`launch_stream`), or None.
        check: check the arguments first; the experts pass False (the door checked the forward).

    Returns:
        ``out``.

    Raises:
        InvalidInputError: shapes or dtypes do not fit together, or BLOCK_M differs from the blocks'.
        QuantizationError: fp8 without the right scales, K % 128 != 0, or BLOCK_K not dividing 128.
    """
    # Pair (m, j) is at m * stride(0) + j * stride(1) = pair * stride(1), column n at n * stride(2), read
    # first, as upstream's launcher read them: a 2-D out fails right here with torch's IndexError (bug 1).
    stride_pair, o2 = out.stride(1), out.stride(2)
    if check:
        check_gemm_args(a, w, out, blocks, pairs_per_row, config, a_scale, w_scale, gated, chunk)
    start, end = (0, blocks.max_padded) if chunk is None else (chunk.start, chunk.end)
    E, N, K = w.shape
    width = N // 2 if gated is not None else N
    if blocks.numel == 0 or width == 0 or end == start:
        if chunk is not None and chunk.write == "position" and blocks.numel == 0:
            out.zero_()  # a chunk's workspace rows hold zeros, not stale bytes
        return out
    if out.shape[1] == 1:  # topk = 1: a size-1 dim's stride says nothing; pairs step by stride(0)
        stride_pair = out.stride(0)
    quant_out = gated is not None and out.dtype == FP8
    static = gated.static_scale if quant_out else None
    out_scale = gated.out_scale if quant_out else out
    fp8 = a.dtype == FP8
    if fp8:
        scales = (a_scale, w_scale, a_scale.stride(0), a_scale.stride(1), *w_scale.stride())
    else:
        scales = (a, w, 0, 0, 0, 0, 0)
    if quant_out:
        epilogue = (
            out_scale,
            out_scale if static is None else static,
            *out_scale.stride(),
            0 if static is None or static.numel() == 1 else static.stride(0),
            gated.static_div if static is not None else 1,
        )
    else:
        epilogue = (out, out, 0, 0, 0, 1)
    w_desc = _weight_descriptor(w, config) if config.tma else None
    read_pos = chunk is not None and chunk.read == "position"
    write_pos = chunk is not None and chunk.write == "position"
    a_desc = _rows_descriptor(a, config) if config.tma and read_pos else None
    strides = (*a.stride(), *w.stride(), stride_pair, o2, *scales[2:], *epilogue[2:])
    num_blocks = (end - start) // config.BLOCK_M
    pairs = isinstance(blocks, PairBlocks)
    emap = blocks.expert_map if pairs else None
    if pairs:  # no layout buffer: the kernel reads the ids (and map) itself
        layout = (blocks.ids, 0, 0, blocks.global_num_experts, blocks.num_local)
        ids = (blocks.ids, blocks.ids if emap is None else emap)
    else:
        layout = (blocks.buffer, blocks.expert_offset, blocks.post_offset, 0, 0)
        ids = (blocks.buffer, blocks.buffer)
    args = (
        a,
        w,
        out,
        scales[0],
        scales[1],
        layout[0],
        epilogue[0],
        epilogue[1],
        w if w_desc is None else w_desc,
        a if a_desc is None else a_desc,
        *ids,
        width,
        K,
        blocks.numel,
        num_blocks,
        start,
        *layout[1:3],
        *layout[3:],
        *strides,
    )
    # What selects the compiled variant beyond the config and flags: the dtypes, the sizes and strides
    # (fixed per layer, except the fp8 scales' strides), the alignment of every pointer (chunks slice
    # a and out). numel, num_blocks and the offsets are not specialized.
    ptrs = (
        a.data_ptr() % 16,
        out.data_ptr() % 16,
        w.data_ptr() % 16,
        (a_scale.data_ptr() % 16, w_scale.data_ptr() % 16) if fp8 else None,
        (out_scale.data_ptr() % 16, epilogue[1].data_ptr() % 16) if quant_out else None,
        (blocks.ids.dtype, blocks.ids.data_ptr() % 16, None if emap is None else (emap.dtype, emap.data_ptr() % 16))
        if pairs
        else None,
    )
    key = (
        config,
        a.dtype,
        out.dtype,
        pairs_per_row,
        gated is not None,
        quant_out,
        static is not None,
        w_desc is not None,
        a_desc is not None,
        read_pos,
        write_pos,
        blocks.block_m,
        width,
        K,
        strides,
        ptrs,
    )

    def constexprs() -> dict:
        return dict(
            PAIRS_PER_ROW=pairs_per_row,
            EVEN_K=K % config.BLOCK_K == 0,
            IS_FP8=fp8,
            FP8_GROUP=FP8_GROUP,
            GATED=gated is not None,
            QUANT_OUT=quant_out,
            STATIC_OUT=static is not None,
            W_TMA=w_desc is not None,
            A_TMA=a_desc is not None,
            UPCAST_BF16=interpreting() and a.dtype == torch.bfloat16,
            DOT_IEEE=a.dtype == torch.float32,
            FIX_ROUNDING=interpreting(),
            FP8_MAX=FP8_MAX,
            TINY=TINY_SCALE,
            EXPERT_BLOCK=blocks.block_m,
            READ_BY_POSITION=read_pos,
            WRITE_BY_POSITION=write_pos,
            PAIR_BLOCKS=pairs,
            HAS_MAP=emap is not None,
            **config.launch,
        )

    tiles = num_blocks * cdiv(width, config.BLOCK_N)
    if not config.persistent:
        _GEMM((tiles,), args, key=key, constexprs=lambda: dict(constexprs(), TAIL_M=config.TAIL_M), stream=stream)
        return out
    sms = (
        INTERPRETER_SMS
        if interpreting()
        else sm_count(a.device.index if a.device.index is not None else torch.cuda.current_device())
    )
    _PERSISTENT(
        (min(tiles, sms),),
        args,
        key=(key, sms),
        constexprs=lambda: dict(constexprs(), NUM_SMS=sms, WARP_SPECIALIZE=config.warp_specialize),
        stream=stream,
    )
    return out
