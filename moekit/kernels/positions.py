"""Rows of one chunk of the expert-sorted layout (``ModularKernel(chunk_by="rows")``), moved by
their position in the chunk: gathered from the tokens into a contiguous buffer (the DeepGEMM
layout of the chunk) and scattered back to each (token, slot) row of the output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.kernels.host_math import cdiv, next_power_of_2


@triton.jit
def _gather_positions_kernel(
    # Pointers
    a1q_ptr,
    a1q_scale_ptr,
    sorted_ptr,
    a_ptr,
    a_scale_ptr,
    # Sizes
    rows,
    numel,
    topk,
    K,
    G,
    stride_xm,
    stride_sm,
    stride_sg,
    stride_am,
    stride_asm,
    stride_asg,
    # Meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    pair = tl.load(sorted_ptr + r, mask=rmask, other=numel)
    live = pair < numel  # padding rows become zeros (with zero scales)
    token = tl.where(live, pair // topk, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kmask = k0 + offs_k < K
        x = tl.load(
            a1q_ptr + token[:, None] * stride_xm + k0 + offs_k[None, :], mask=live[:, None] & kmask[None, :], other=0.0
        )
        tl.store(a_ptr + r[:, None] * stride_am + k0 + offs_k[None, :], x, mask=rmask[:, None] & kmask[None, :])
    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    s = tl.load(
        a1q_scale_ptr + token[:, None] * stride_sm + g[None, :] * stride_sg,
        mask=live[:, None] & gmask[None, :],
        other=0.0,
    )
    tl.store(a_scale_ptr + r[:, None] * stride_asm + g[None, :] * stride_asg, s, mask=rmask[:, None] & gmask[None, :])


def gather_positions(
    a1q: torch.Tensor,
    a1q_scale: torch.Tensor,
    sorted_ids: torch.Tensor,
    *,
    numel: int,
    topk: int,
    out: torch.Tensor,
    out_scale: torch.Tensor,
) -> None:
    """``out[r] = a1q[sorted_ids[r] // topk]`` (and its scales) for a chunk of sorted rows.

    In plain Python::

        for r, pair in enumerate(sorted_ids):          # one chunk of moe_align_block_size's rows
            out[r], out_scale[r] = (a1q[pair // topk], a1q_scale[pair // topk]) if pair < numel else (0, 0)

    Args:
        a1q: fp8 ``[M, K]``; a1q_scale: fp32 ``[M, K/128]`` (any strides).
        sorted_ids: int32 ``[rows]``, pair indices (``numel`` for padding).
        out: fp8 ``[rows, K]`` (unit column stride); out_scale: fp32 ``[rows, K/128]`` (any strides,
            column-major for deep_gemm).
    """
    rows, K = out.shape
    G = out_scale.shape[1]
    if rows == 0:
        return
    BLOCK_R = 8
    _gather_positions_kernel[(cdiv(rows, BLOCK_R),)](
        a1q,
        a1q_scale,
        sorted_ids,
        out,
        out_scale,
        rows,
        numel,
        topk,
        K,
        G,
        a1q.stride(0),
        a1q_scale.stride(0),
        a1q_scale.stride(1),
        out.stride(0),
        out_scale.stride(0),
        out_scale.stride(1),
        BLOCK_R=BLOCK_R,
        BLOCK_K=min(next_power_of_2(K), 1024),
        BLOCK_G=next_power_of_2(G),
    )


@triton.jit
def _scatter_positions_kernel(
    # Pointers
    rows_ptr,
    sorted_ptr,
    expert_ids_ptr,
    out_ptr,
    # Sizes
    rows,
    numel,
    K,
    stride_rm,
    stride_om,
    # Meta-parameters
    EXPERT_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    pair = tl.load(sorted_ptr + r, mask=rmask, other=numel)
    live = rmask & (pair < numel)
    local = tl.load(expert_ids_ptr + r // EXPERT_BLOCK, mask=rmask, other=-1) >= 0  # -1: another rank's
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kmask = k0 + offs_k < K
        x = tl.load(
            rows_ptr + r[:, None] * stride_rm + k0 + offs_k[None, :],
            mask=(live & local)[:, None] & kmask[None, :],
            other=0.0,
        )
        dst = out_ptr + pair.to(tl.int64)[:, None] * stride_om + k0 + offs_k[None, :]
        tl.store(dst, x.to(out_ptr.dtype.element_ty), mask=live[:, None] & kmask[None, :])


def scatter_positions(
    rows: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    numel: int,
    expert_block: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out.view(-1, K)[sorted_ids[r]] = rows[r]`` for a chunk of sorted rows; zeros for rows of a
    block whose expert id is -1 (another rank's expert, or kept empty slots). Padding is skipped.

    Args:
        rows: ``[R, >=K]`` GEMM2 output of the chunk (unit column stride).
        sorted_ids: int32 ``[R]`` pair per row; expert_ids: int32, one per ``expert_block`` rows.
        out: the whole-batch output, ``numel`` rows of ``K`` (``[M, topk, K]``), written in place.
    """
    K = out.shape[-1]
    flat = out.view(-1, K)
    R = sorted_ids.numel()
    if R:
        BLOCK_R = 8
        _scatter_positions_kernel[(cdiv(R, BLOCK_R),)](
            rows,
            sorted_ids,
            expert_ids,
            flat,
            R,
            numel,
            K,
            rows.stride(0),
            flat.stride(0),
            EXPERT_BLOCK=expert_block,
            BLOCK_R=BLOCK_R,
            BLOCK_K=min(next_power_of_2(K), 1024),
        )
    return out


__all__ = ["gather_positions", "scatter_positions"]
