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

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.hopper.configs import KernelConfig
from moekit.hopper.gemm_args import GatedOutput, RowWindow, check_gemm_args
from moekit.hopper.launch import LeanLauncher, kept_descriptor, sm_count
from moekit.hopper.pair_blocks import PairBlocks
from moekit.hopper.pdl import pdl_begin
from moekit.kernels.activation import clamp_fp8, quantize_fp8_rows, round_for_store
from moekit.kernels.align import AlignedBlocks, bucket_of
from moekit.kernels.host_math import cdiv
from moekit.kernels.tma import gate_up_descriptor, tma_descriptor, weight_descriptor
from moekit.quant import FP8, FP8_GROUP, FP8_MAX, TINY_SCALE

# The output tile the kernel computes, with its fused epilogue ---------------------------------

# The fp8 formats' constants, as the kernels read them (compile-time globals).
_GROUP = tl.constexpr(FP8_GROUP)
_FP8_MAX = tl.constexpr(FP8_MAX)
_TINY = tl.constexpr(TINY_SCALE)


class _Meta(NamedTuple):
    """The kernel's compile-time parameters (its ``META``): Triton compiles one variant per value."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    TAIL_M: int  # rows of the short tile of an expert's last block (0: none)
    NUM_SMS: int  # programs of the persistent walk (0: one program per tile)
    WARP_SPECIALIZE: bool  # the persistent walk's loop split into producer and consumer warps
    PAIRS_PER_ROW: int  # pairs that share a row of a: topk for GEMM1, 1 for GEMM2
    EVEN_K: bool  # K % BLOCK_K == 0: no mask along K
    IS_FP8: bool  # a and w fp8, dequantized with a_scale and w_scale
    GATED: bool  # silu(gate) * up in the epilogue (GatedOutput)
    INTERLEAVE: bool  # ... from one accumulator whose columns alternate gate, up (KernelConfig.interleave)
    QUANT_OUT: bool  # ... requantized to fp8 (one scale per row of a 128-wide group)
    STATIC_OUT: bool  # ... by a given scale
    W_TMA: bool  # w's tiles through a TMA descriptor
    A_TMA: bool  # a's rows (read by position) through a TMA descriptor
    UPCAST_BF16: bool  # the interpreter's bf16 dot (see _mma)
    DOT_IEEE: bool  # fp32 stays fp32
    FIX_ROUNDING: bool  # the interpreter's fp32 -> bf16 cast (see round_for_store)
    EXPERT_BLOCK: int  # rows per expert id in the layout (the align's BLOCK_M)
    READ_BY_POSITION: bool  # RowWindow.read == "position"
    WRITE_BY_POSITION: bool  # RowWindow.write == "position"
    PAIR_BLOCKS: bool  # blocks is PairBlocks: each pair its own block, its expert read from the ids
    HAS_MAP: bool  # ... through an expert map


@triton.jit
def _mma(acc, a, b, a_s, w_s, IS_FP8: tl.constexpr, UPCAST_BF16: tl.constexpr, DOT_IEEE: tl.constexpr):
    """acc += a @ b, dequantizing fp8 with one activation scale per row and one weight scale per column, or per
    group of consecutive columns (then a group's scale folds into the accumulating FFMA)."""
    if IS_FP8:
        d = tl.dot(a, b).reshape(acc.shape[0], w_s.shape[0], acc.shape[1] // w_s.shape[0])  # w_s's groups of columns
        acc += (d * (a_s[:, None] * w_s[None, :])[:, :, None]).reshape(acc.shape)
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
def _rows_out(out_ptr, out_scale_ptr, strides, offs_m, pair, live, pid_n, N, META: tl.constexpr):
    """Where a tile's rows go: each pair's row of out (or, written by position, the row's place in the
    chunk's workspace) and of the fp8 output's scales; the rows kept."""
    _, out_strides, _, out_scale_strides = strides
    stride_om, stride_on = out_strides
    stride_osm, stride_osg, _, _ = out_scale_strides
    if META.WRITE_BY_POSITION:
        dest = offs_m.to(tl.int64)
        keep = offs_m >= 0  # every position: padding rows get values too (finite, never read back)
    else:
        dest = pair.to(tl.int64)
        keep = live
    offs_n = pid_n * META.BLOCK_N + tl.arange(0, META.BLOCK_N)
    out_ptrs = out_ptr + dest[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = keep[:, None] & (offs_n[None, :] < N)
    # With QUANT_OUT, BLOCK_N is the 128-wide group: program column pid_n owns scale column pid_n.
    out_scale_ptrs = out_scale_ptr + dest * stride_osm + pid_n * stride_osg
    return out_ptrs, out_mask, out_scale_ptrs, keep


@triton.jit
def _tile(
    ptrs,
    strides,
    row0,
    pid_n,
    expert,
    N,
    K,
    numel,
    k_steps,
    BLOCK_M: tl.constexpr,
    A_TMA: tl.constexpr,
    META: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N output tile: rows [row0, row0 + BLOCK_M) of the layout, all of ``expert``.

    ``k_steps`` BLOCK_K steps along K (``cdiv(K, BLOCK_K)``; 0 stores the epilogue of a zero
    accumulator, which the persistent walk uses for another rank's blocks). With ``PAIR_BLOCKS``
    the tile is pair ``row0`` alone (:mod:`moekit.hopper.pair_blocks`).
    """
    a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, sorted_ptr, out_scale_ptr, static_ptr, w_desc, a_desc = ptrs
    in_strides, _, scale_strides, out_scale_strides = strides
    stride_am, stride_ak, stride_we, stride_wn, stride_wk = in_strides
    stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk = scale_strides
    _, _, stride_static, static_div = out_scale_strides
    BLOCK_N: tl.constexpr = META.BLOCK_N
    BLOCK_K: tl.constexpr = META.BLOCK_K
    offs_m = row0 + tl.arange(0, BLOCK_M)
    if META.PAIR_BLOCKS:  # row0 is the tile's one pair; the other rows are padding
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, row0, numel)
    else:
        pair = tl.load(sorted_ptr + offs_m)
    live = pair < numel
    # Padding rows load nothing (masked: zeros, no memory traffic) and columns past N wrap
    # around: every load is in bounds, and those lanes are never stored (or, written by
    # position, never read back).
    if META.READ_BY_POSITION:
        row = offs_m.to(tl.int64)
    else:
        row = tl.where(live, pair // META.PAIRS_PER_ROW, 0).to(tl.int64)
    if META.INTERLEAVE:  # w's rows for product columns gate n, up n, gate n + 1, ... (2 * BLOCK_N)
        j = tl.arange(0, 2 * BLOCK_N)
        col = (pid_n * BLOCK_N + j // 2) % N + (j % 2) * N
    else:
        col = tl.max_contiguous(tl.multiple_of((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N, BLOCK_N), BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + col[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if META.IS_FP8:
        a_scale_ptrs = a_scale_ptr + row * stride_asm
        w_scale_col = col // _GROUP  # gated: one per column (which the compiler folds without TMA)
        if not META.GATED:  # ceil(BLOCK_N / 128) scales, one per 128-column group (past N: never stored)
            w_scale_col = (pid_n * BLOCK_N // _GROUP + tl.arange(0, -(-BLOCK_N // _GROUP))) % tl.cdiv(N, _GROUP)
        w_scale_ptrs = w_scale_ptr + expert * stride_wse + w_scale_col * stride_wsn
        w_up_scale_ptrs = w_scale_ptr + expert * stride_wse + ((col + N) // _GROUP) * stride_wsn
    # TMA: w viewed as [E * rows, K]; rows past this expert's (last column tile) belong to the
    # next expert or are zero-filled past the end, and those columns are never stored.
    w_row = (expert * (2 * N if META.GATED else N) + pid_n * BLOCK_N).to(tl.int32)
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N if META.INTERLEAVE else BLOCK_N], dtype=tl.float32)
    if META.GATED and not META.INTERLEAVE:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_steps):
        if A_TMA:  # rows read by position: the tile's rows are contiguous, one TMA box
            a = a_desc.load([row0, k * BLOCK_K])
        elif META.EVEN_K:
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=live[:, None] & (offs_k[None, :] < K - k * BLOCK_K), other=0.0)
        w_mask = offs_k[:, None] < K - k * BLOCK_K
        if META.IS_FP8:
            # One 1x128 activation scale per row and one 128x128 weight scale per column block.
            group = (k * BLOCK_K) // _GROUP
            a_s = tl.load(a_scale_ptrs + group * stride_ask)
            w_s = tl.load(w_scale_ptrs + group * stride_wsk)
        else:
            a_s = 1.0
            w_s = 1.0
        if META.W_TMA and META.INTERLEAVE:  # a [1, BLOCK_N, 2, BLOCK_K] box of w seen as [E, N, 2, K]
            b = w_desc.load([expert.to(tl.int32), pid_n * BLOCK_N, 0, k * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K).T
        elif META.W_TMA:
            b = w_desc.load([w_row, k * BLOCK_K]).T
        else:
            b = _load(w_ptrs, w_mask, META.EVEN_K)
        acc = _mma(acc, a, b, a_s, w_s, META.IS_FP8, META.UPCAST_BF16, META.DOT_IEEE)
        if META.GATED and not META.INTERLEAVE:  # the up half: the same rows of a times w rows [N, 2N)
            w_up_s = tl.load(w_up_scale_ptrs + group * stride_wsk) if META.IS_FP8 else 1.0
            if META.W_TMA:
                b_up = w_desc.load([w_row + N, k * BLOCK_K]).T
            else:
                b_up = _load(w_ptrs + N * stride_wn, w_mask, META.EVEN_K)
            acc_up = _mma(acc_up, a, b_up, a_s, w_up_s, META.IS_FP8, META.UPCAST_BF16, META.DOT_IEEE)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    # The output's addresses are formed only now: held across the loop they cost registers
    # (about 30 per thread at 128 x 256) that the pipeline needs.
    out_ptrs, out_mask, out_scale_ptrs, keep = _rows_out(
        out_ptr, out_scale_ptr, strides, offs_m, pair, live, pid_n, N, META
    )
    if META.INTERLEAVE:  # each thread holds both columns of a (gate, up) pair: split them apart
        acc, acc_up = tl.split(acc.reshape(BLOCK_M, BLOCK_N, 2))
    if META.GATED:  # silu(gate) * up from the fp32 accumulators
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if META.QUANT_OUT:  # fp8 with one scale per row of this 128-wide group (as moekit.quant)
        if META.STATIC_OUT:
            scale = tl.load(static_ptr + (tl.where(live, pair, 0) // static_div) * stride_static)
            acc = clamp_fp8(acc / scale[:, None], _FP8_MAX)
        else:
            acc, scale = quantize_fp8_rows(acc, _FP8_MAX, _TINY)
        tl.store(out_scale_ptrs, scale, mask=keep)
    if META.FIX_ROUNDING:
        acc = round_for_store(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


# The kernel: one program per tile, or the persistent walk -----------------------------------
#
# One program per tile (``NUM_SMS = 0``) launches a program for each tile of an upper bound on
# the layout's blocks (no host sync): programs past the layout's end return at once, and at large
# M the GPU runs waves of short programs, each paying its own prologue (index loads, the first TMA
# and async copies) and tail. The persistent walk (``KernelConfig(persistent=True)``) launches
# ``min(SMs, tiles)`` programs instead, and each strides over the tiles (``tile = program,
# program + SMs, ...``), reading the layout's used rows on the device::
#
#     used = cdiv(num_tokens_post_padded - row_base, BLOCK_M)     # not num_blocks: no empty programs
#     for tile in range(program_id, used * cdiv(N, BLOCK_N), NUM_SMS):   # flattened with the k-loop
#         pid_m, pid_n = grouped(tile)                            # GROUP_M row blocks share a column sweep
#         expert = expert_ids[pid_m]                              # -1: another rank's, zero k-steps
#         _tile(pid_m, pid_n, expert, k_steps = 0 if expert == -1 else cdiv(K, BLOCK_K))
#
# The k-loop of one tile and the walk over tiles are one flattened loop (``tl.range(flatten=True)``),
# so the software pipeline keeps loading the next tile's operands while this tile's epilogue
# stores. Both compute the same tiles (``_tile`` above), so they give bit-identical results on one
# GPU; a tile is computed by one program, with no split along K (deterministic). The walk has no
# ``TAIL_M`` variant (one tile shape per flattened loop). Under the interpreter it runs with
# :data:`INTERPRETER_SMS` programs, so the CPU tests walk several tiles per program.

INTERPRETER_SMS = 3  # programs of a persistent launch under the interpreter: each walks several tiles


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
    ids_ptr,  # PAIR_BLOCKS only (with map_ptr, num_experts and num_local)
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
    # ((a: m, k; w: e, n, k), (out: pair, n), (fp8 a_scale: m, k; w_scale: e, n, k),
    #  (fp8 out_scale: pair, group; static scale: pair; pairs per static scale))
    strides,
    # Meta-parameters
    META: tl.constexpr,  # _Meta
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)  # nothing is read before the previous kernel completes
    # The layout (moe_align_block_size) is one int32 buffer: sorted pair ids, expert ids, used rows.
    # This call computes its rows from row_base on.
    sorted_ptr = blocks_ptr + row_base
    expert_ids_ptr = blocks_ptr + expert_off + row_base // META.EXPERT_BLOCK
    ptrs = (a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, sorted_ptr, out_scale_ptr, static_ptr, w_desc, a_desc)
    BLOCK_M: tl.constexpr = META.BLOCK_M
    BLOCK_N: tl.constexpr = META.BLOCK_N
    GROUP_M: tl.constexpr = META.GROUP_M
    if META.NUM_SMS > 0:  # the persistent walk
        tl.static_assert(not META.PAIR_BLOCKS, "the persistent kernel walks an aligned layout")
        post = tl.load(blocks_ptr + post_off)
        # A chunk's workspace written by position gets every block (those past the layout: zeros);
        # otherwise only the laid-out blocks are walked.
        if META.WRITE_BY_POSITION:
            used = num_blocks
        else:
            used = tl.minimum(num_blocks, tl.cdiv(tl.maximum(post - row_base, 0), BLOCK_M))
        num_pid_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_pid_n
        k_all = tl.cdiv(K, META.BLOCK_K)
        WALK_WS: tl.constexpr = META.WARP_SPECIALIZE
        for tile in tl.range(tl.program_id(0), used * num_pid_n, META.NUM_SMS, flatten=True, warp_specialize=WALK_WS):
            first_m = (tile // per_group) * GROUP_M
            group_m = tl.minimum(used - first_m, GROUP_M)
            pid_m = first_m + (tile % per_group) % group_m
            pid_n = (tile % per_group) // group_m
            row0 = pid_m * BLOCK_M
            expert = tl.load(expert_ids_ptr + row0 // META.EXPERT_BLOCK).to(tl.int64)
            expert = tl.where(row_base + row0 >= post, -1, expert)
            k_steps = tl.where(expert == -1, 0, k_all)
            _tile(ptrs, strides, row0, pid_n, expert, N, K, numel, k_steps, BLOCK_M, META.A_TMA, META)
    else:  # one program per tile
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
        if META.PAIR_BLOCKS:  # block pid_m is pair pid_m alone (moekit.hopper.pair_blocks): nothing to load
            pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, numel)
            row0 = pid_m
        else:
            pair = tl.load(sorted_ptr + offs_m)
            row0 = pid_m * BLOCK_M
        live = pair < numel  # padding rows hold numel
        out_ptrs, out_mask, out_scale_ptrs, keep = _rows_out(
            out_ptr, out_scale_ptr, strides, offs_m, pair, live, pid_n, N, META
        )
        # The grid is sized by an upper bound (no host sync): blocks past the real ones do no math;
        # a block of another rank's expert (id -1) contributes zeros.
        if META.PAIR_BLOCKS:  # the grid is exact; the expert as the align would place it (-1: a zero row)
            expert = bucket_of(ids_ptr, map_ptr, pid_m, numel, num_experts, num_local, META.HAS_MAP, True, 0)[1]
            expert = expert.to(tl.int64)
        else:
            past_end = row_base + pid_m * BLOCK_M >= tl.load(post_ptr)
            if not META.WRITE_BY_POSITION:
                if past_end:
                    return
            expert = tl.load(expert_ids_ptr + (pid_m * BLOCK_M) // META.EXPERT_BLOCK).to(tl.int64)
            expert = tl.where(past_end, -1, expert)
        if expert == -1:  # (or past the end, for a chunk's workspace rows: zeros, not stale bytes)
            tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty), mask=out_mask)
            if META.QUANT_OUT:
                tl.store(out_scale_ptrs, tl.full([BLOCK_M], _TINY, tl.float32), mask=keep)
            return
        # An expert's last block is often mostly padding (at 256 rows per expert and 128-row blocks,
        # a quarter of all rows): with TAIL_M, a block of at most TAIL_M real rows (always its first
        # rows) runs a TAIL_M-row tile instead. Both tiles are compiled into this kernel.
        SHORT_M: tl.constexpr = META.TAIL_M if META.TAIL_M > 0 else BLOCK_M
        short = False
        if META.TAIL_M > 0 and not META.WRITE_BY_POSITION:
            short = tl.sum(live.to(tl.int32)) <= META.TAIL_M
        k_steps = tl.cdiv(K, META.BLOCK_K)
        if short:  # (a TMA box of a's rows is BLOCK_M rows: the short tile loads them per thread)
            _tile(ptrs, strides, row0, pid_n, expert, N, K, numel, k_steps, SHORT_M, False, META)
        else:
            _tile(ptrs, strides, row0, pid_n, expert, N, K, numel, k_steps, BLOCK_M, META.A_TMA, META)


_GEMM = LeanLauncher(_fused_moe_kernel, pdl=True)
_PERSISTENT = LeanLauncher(_fused_moe_kernel)  # no PDL: the walk ran slower with it (moekit.hopper.pdl)


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
    stride_pair, stride_col = out.stride(1), out.stride(2)
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
    fp8 = a.dtype == FP8
    quant_out = gated is not None and out.dtype == FP8
    static = gated.static_scale if quant_out else None
    out_scale = gated.out_scale if quant_out else out
    static_ptr = out_scale if static is None else static
    if fp8:
        scale_strides = (*a_scale.stride(), *w_scale.stride())
    else:
        a_scale, w_scale, scale_strides = a, w, (0, 0, 0, 0, 0)
    if quant_out:
        static_stride = 0 if static is None or static.numel() == 1 else static.stride(0)
        out_scale_strides = (*out_scale.stride(), static_stride, gated.static_div if static is not None else 1)
    else:
        out_scale_strides = (0, 0, 0, 1)
    strides = ((*a.stride(), *w.stride()), (stride_pair, stride_col), scale_strides, out_scale_strides)
    read_pos = chunk is not None and chunk.read == "position"
    write_pos = chunk is not None and chunk.write == "position"
    # TMA boxes: w as [E * N, K] in [BLOCK_N, BLOCK_K] boxes; activations read by position as [rows, K]
    # in [BLOCK_M, BLOCK_K] boxes (a tile's rows are consecutive there). None where TMA cannot read them.
    # With interleave, w [E, 2N, K] as [E, N, 2, K] in [1, BLOCK_N, 2, BLOCK_K] boxes (rows gate n, up n, ...).
    if config.tma and config.interleave:
        w_desc = kept_descriptor(gate_up_descriptor, w, [1, config.BLOCK_N, 2, config.BLOCK_K])
    else:
        w_desc = kept_descriptor(weight_descriptor, w, [config.BLOCK_N, config.BLOCK_K]) if config.tma else None
    a_desc = kept_descriptor(tma_descriptor, a, [config.BLOCK_M, config.BLOCK_K]) if config.tma and read_pos else None
    num_blocks = (end - start) // config.BLOCK_M
    pairs = isinstance(blocks, PairBlocks)
    emap = blocks.expert_map if pairs else None
    if pairs:  # no layout buffer: the kernel reads the ids (and map) itself
        layout = (blocks.ids, blocks.ids, blocks.ids if emap is None else emap)
        sizes = (0, 0, blocks.global_num_experts, blocks.num_local)
    else:
        layout = (blocks.buffer, blocks.buffer, blocks.buffer)
        sizes = (blocks.expert_offset, blocks.post_offset, 0, 0)
    descriptors = (w if w_desc is None else w_desc, a if a_desc is None else a_desc)
    args = (a, w, out, a_scale, w_scale, layout[0], out_scale, static_ptr, *descriptors, *layout[1:])
    args += (width, K, blocks.numel, num_blocks, start, *sizes, strides)
    sms = 0  # one program per tile; else the persistent walk's programs
    if config.persistent and interpreting():
        sms = INTERPRETER_SMS
    elif config.persistent:
        sms = sm_count(a.device.index if a.device.index is not None else torch.cuda.current_device())
    # What selects the compiled variant: the config, the flags below, the sizes and strides (fixed per
    # layer, except the fp8 scales' strides), the dtype and alignment of every tensor that varies (chunks
    # slice a and out; the layout buffer is fresh). numel, num_blocks and the offsets are not specialized.
    flags = (config, sms, pairs_per_row, gated is not None, quant_out, static is not None, read_pos, write_pos)
    flags += (w_desc is not None, a_desc is not None, pairs, emap is not None, blocks.block_m)
    varying = (a, w, out, *args[3:5]) if fp8 else (a, w, out)  # (+ the fp8 scales)
    varying += args[6:8] if quant_out else ()  # the fp8 output's scales
    varying += args[10:12] if pairs else ()  # the ids and map
    key = (flags, width, K, strides, tuple([(t.dtype, t.data_ptr() % 16) for t in varying]))

    def constexprs() -> dict:  # asked on a key's first launch only
        meta = _Meta(
            BLOCK_M=config.BLOCK_M,
            BLOCK_N=config.BLOCK_N,
            BLOCK_K=config.BLOCK_K,
            GROUP_M=config.GROUP_M,
            TAIL_M=config.TAIL_M,
            NUM_SMS=sms,
            WARP_SPECIALIZE=config.warp_specialize,
            PAIRS_PER_ROW=pairs_per_row,
            EVEN_K=K % config.BLOCK_K == 0,
            IS_FP8=fp8,
            GATED=gated is not None,
            INTERLEAVE=config.interleave,
            QUANT_OUT=quant_out,
            STATIC_OUT=static is not None,
            W_TMA=w_desc is not None,
            A_TMA=a_desc is not None,
            UPCAST_BF16=interpreting() and a.dtype == torch.bfloat16,
            DOT_IEEE=a.dtype == torch.float32,
            FIX_ROUNDING=interpreting(),
            EXPERT_BLOCK=blocks.block_m,
            READ_BY_POSITION=read_pos,
            WRITE_BY_POSITION=write_pos,
            PAIR_BLOCKS=pairs,
            HAS_MAP=emap is not None,
        )
        return dict(META=meta, num_warps=config.num_warps, num_stages=config.num_stages)

    tiles = num_blocks * cdiv(width, config.BLOCK_N)
    launch = _PERSISTENT if sms else _GEMM
    launch((min(tiles, sms) if sms else tiles,), args, key=key, constexprs=constexprs, stream=stream)
    return out
