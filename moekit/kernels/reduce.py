"""Weight the per-slot expert outputs by the router weights and sum over topk (finalize).

In plain Python::

    for m in range(M):
        out[m] = sum(topk_weights[m, j] * fused_out[m, j] for j in range(topk))   # fp32 accumulate

The kernel reads ``fused_out`` once and writes ``out`` once: it is memory bound, so the floor
is ``(M*topk*K + M*K) * itemsize / bandwidth``. A torch version (``(x.float() * w).sum(1)``)
makes two fp32 copies of ``[M, topk, K]`` first, about 5x the bytes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.errors import InvalidInputError


@triton.jit
def _weighted_topk_sum_kernel(
    # Pointers
    x_ptr,  # [M, TOPK, K]
    w_ptr,  # [M, TOPK]
    out_ptr,  # [M, K]
    # Sizes
    M,
    K,
    # Meta-parameters
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    rows64 = rows.to(tl.int64)  # M * TOPK * K can pass 2**31 at large M
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        w = tl.load(w_ptr + rows64 * TOPK + j, mask=rows < M, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + (rows64[:, None] * TOPK + j) * K + cols[None, :], mask=mask, other=0.0)
        acc += x.to(tl.float32) * w[:, None]
    tl.store(out_ptr + rows64[:, None] * K + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def weighted_topk_sum(fused_out: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[m] = sum_j topk_weights[m, j] * fused_out[m, j]``; returns ``out``.

    Args:
        fused_out: ``[M, topk, K]`` (or ``[M*topk, K]``), contiguous.
        topk_weights: ``[M, topk]`` float.
        out: ``[M, K]``, written in place (any float dtype).
    """
    M, K = out.shape
    if topk_weights.dim() != 2 or topk_weights.shape[0] != M:
        raise InvalidInputError(f"topk_weights must be [M={M}, topk], got {tuple(topk_weights.shape)}")
    topk = topk_weights.shape[1]
    if fused_out.numel() != M * topk * K or not fused_out.is_contiguous():
        raise InvalidInputError(
            f"fused_out must be a contiguous [M, topk, K] = {(M, topk, K)} tensor, got {tuple(fused_out.shape)}"
        )
    if not out.is_contiguous():
        raise InvalidInputError(f"out must be a contiguous [M, K] tensor, got strides {out.stride()}")
    return launch_weighted_topk_sum(fused_out, topk_weights.contiguous(), out)


def launch_weighted_topk_sum(fused_out: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`weighted_topk_sum` unchecked (all three contiguous, shapes as documented there)."""
    M, K = out.shape
    if M == 0:
        return out
    grid, consts = _reduce_shape(M, K, _min_programs())
    _weighted_topk_sum_kernel[grid](fused_out, topk_weights, out, M, K, TOPK=topk_weights.shape[1], **consts)
    return out


MIN_PROGRAMS = 512  # about four per SM of an H200: below that, small M left most SMs idle


def _min_programs() -> int:
    """MIN_PROGRAMS on a GPU; 0 under the interpreter, which runs programs one after another (no SMs to
    fill: at K=64, M=530 narrowing made 530 programs of 34, and each costs milliseconds there)."""
    return 0 if interpreting() else MIN_PROGRAMS


@functools.lru_cache(maxsize=4096)  # a pure function of the sizes, asked once per forward
def _reduce_shape(M: int, K: int, min_programs: int) -> tuple[tuple[int, int], dict]:
    """(grid, tile sizes and warps) of a launch: they follow from the sizes alone.

    Tiles of up to 16 x 1024, shrunk (rows first, then columns down to 256) until the grid has
    ``min_programs`` programs (``MIN_PROGRAMS``) or cannot grow. At M=128, K=2048 the 4 x 1024
    tile gave 64 programs, and the sum took 6.4 us for 4.7 MB (H200 profiler, 2026-12-02).
    Threads keep 8 to 32 elements each."""
    BLOCK_K = min(1024, triton.next_power_of_2(K))
    BLOCK_M = max(1, min(16, 4096 // BLOCK_K))
    while triton.cdiv(M, BLOCK_M) * triton.cdiv(K, BLOCK_K) < min_programs:
        if BLOCK_M > 1:
            BLOCK_M //= 2
        elif BLOCK_K > 256:
            BLOCK_K //= 2
        else:
            break
    num_warps = max(1, min(4, BLOCK_M * BLOCK_K // 256))
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(K, BLOCK_K))
    return grid, dict(BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=num_warps)
