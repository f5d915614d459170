"""The output tile both grouped GEMM kernels compute, with its fused epilogue.

``fused_moe`` runs one program per tile; ``persistent_gemm`` one program per SM, walking the
tiles. See :mod:`moekit.hopper.grouped_gemm` for the shapes, the layout and the epilogue's options.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.kernels.activation import clamp_fp8, quantize_fp8_rows, round_for_store


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
