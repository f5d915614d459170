"""Gather the rows of the contiguous layout back to ``[M, topk, K]`` (the inverse of the permute).

Layout and shapes: the module docstring of :mod:`moekit.kernels.permute`, which also re-exports
:func:`unpermute_from_contiguous`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.errors import InvalidInputError


@triton.jit
def _gather_rows_kernel(
    # Pointers
    rows_ptr, inv_perm_ptr, out_ptr,
    # Sizes
    K, topk, stride_rm, stride_om, stride_oj,
    # Meta-parameters
    TOPK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, TOPK)
    jmask = j < topk
    row = tl.load(inv_perm_ptr + m * topk + j, mask=jmask, other=-1).to(tl.int64)
    has = row >= 0
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kmask = k0 + offs_k < K
        x = tl.load(rows_ptr + row[:, None] * stride_rm + k0 + offs_k[None, :], mask=has[:, None] & kmask[None, :], other=0.0)
        dst = out_ptr + m * stride_om + j[:, None] * stride_oj + k0 + offs_k[None, :]
        tl.store(dst, x.to(out_ptr.dtype.element_ty), mask=jmask[:, None] & kmask[None, :])


def unpermute_from_contiguous(rows: torch.Tensor, inv_perm: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """Gather the layout's rows back to ``out [M, topk, K]``; slots with no row get zeros.

    In plain Python::

        for m, j in pairs:
            r = inv_perm[m * topk + j]
            out[m, j] = rows[r] if r >= 0 else 0

    Upstream (2025-07) computed the rows of non-local experts with expert 0's weights and
    relied on their router weights being 0 at finalize; moekit writes zeros instead, as its
    Triton experts do, so the result is right whatever those weights are.

    Args:
        rows: ``[M_sum, >=K]`` GEMM2 output (unit column stride). inv_perm: int32 ``[M * topk]``.
        out: ``[M, topk, K]`` (unit last stride), written in place and returned.
    """
    if out.dim() != 3 or out.stride(2) != 1 or rows.dim() != 2 or rows.stride(1) != 1:
        raise InvalidInputError(
            f"expected rows [M_sum, K] and out [M, topk, K] with unit last strides, got "
            f"{tuple(rows.shape)} {rows.stride()} and {tuple(out.shape)} {out.stride()}"
        )
    M, topk, K = out.shape
    if inv_perm.numel() != M * topk or rows.shape[1] < K:
        raise InvalidInputError(
            f"inv_perm must have M*topk={M * topk} entries and rows >= {K} columns, got {inv_perm.numel()} "
            f"and {rows.shape[1]}"
        )
    if M > 0:
        _gather_rows_kernel[(M,)](
            rows, inv_perm, out, K, topk, rows.stride(0), out.stride(0), out.stride(1),
            TOPK=triton.next_power_of_2(topk), BLOCK_K=min(triton.next_power_of_2(K), 1024),
        )  # fmt: skip
    return out
