"""moekit's grouped GEMM in DeepGEMM's contiguous layout (fp8, block scales, bf16 out).

Shapes (M_sum rows of the layout, N output columns, K reduction, E experts)::

    a          [M_sum, K]        fp8, rows grouped by expert, groups padded to 128 rows
    a_scale    [M_sum, K/128]    fp32, one scale per 1x128 group (column-major storage here)
    b          [E, N, K]         fp8 weights (K-major: what Hopper's fp8 wgmma wants for B^T)
    b_scale    [E, N/128, K/128] fp32, one scale per 128x128 block
    m_indices  [M_sum]           int32 expert of every row
    out        [M_sum, N]        bf16

    out[r, n] = sum_k a[r, k] a_scale[r, k//128] * b[e, n, k] b_scale[e, n//128, k//128],
                e = m_indices[r]

Every 128-row block holds one expert, so a tile of BLOCK_M rows (BLOCK_M divides 128) reads its
expert once, from its first row. Scales are applied per 128-wide K step, outside the fp8 dot:
``acc += dot(a_tile, b_tile) * a_scale[:, None] * b_scale[None, :]``. A tile at most 128 columns
wide lies in one weight-scale block, so its weight scale is one number per K step, folded into the
row scales first: one multiply-add per accumulator element and K step instead of two multiplies
and an add (the promotion runs between the tensor-core steps, so it is on the critical path).
With ``GemmConfig.tma`` the fp8 tiles come by TMA (host-side descriptors; padding rows are then
zeroed at the store instead of at the load).

It is a drop-in for ``deep_gemm``'s contiguous GEMM (same arguments, same layout), portable to
any GPU Triton supports and to the CPU interpreter. ``block_rows`` (rows holding data in each
128-row block, from :func:`moekit.kernels.permute.permute_to_contiguous`) lets tiles of pure
padding skip their K loop and store zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekit.device import has_tma, interpreting
from moekit.errors import InvalidInputError
from moekit.kernels.host_math import cdiv, next_power_of_2
from moekit.kernels.tma import tma_descriptor, weight_descriptor
from moekit.quant import FP8, FP8_GROUP
from moekit.types import ALIGN_M

LAYOUT_ROWS = tl.constexpr(ALIGN_M)  # rows of one expert's block of the layout (a compile-time global)
GROUP = tl.constexpr(FP8_GROUP)


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch options. ``block_m`` must divide 128; ``block_k`` is 128."""

    block_m: int = 128
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    tma: bool = False  # fp8 tiles by TMA (Hopper; falls back to pointer loads where TMA cannot read)

    def __post_init__(self):
        if self.block_m <= 0 or ALIGN_M % self.block_m:
            raise InvalidInputError(f"block_m must divide {ALIGN_M}, got {self.block_m}")
        if self.block_n not in (16, 32, 64, 128, 256):
            raise InvalidInputError(f"block_n must be a power of two in [16, 256], got {self.block_n}")


def default_config(num_rows: int, N: int, K: int) -> GemmConfig:
    """Tiles for the interpreter (few, large programs) or for the GPU: 64x128, 4 warps, 3 stages, by TMA
    where the GPU has it. On one H200 at DeepSeek-V3's shapes (M=4096, 2026-12-02,
    ``benchmarks/gpu_check_deep_gemm.py``, GEMM1 / GEMM2): pointer loads 4.09 / 2.15 ms, TMA with 4
    stages 3.17 / 1.77, with 3 stages 2.97 / 1.68; 128-row tiles compute 18% more padding rows and
    were slower with or without TMA."""
    if interpreting():  # each program costs ~50 ms of Python: use as few as possible
        return GemmConfig(block_m=128, block_n=max(16, min(256, next_power_of_2(N))), num_stages=1)
    return GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=3, tma=has_tma())


@triton.jit
def _contiguous_gemm_kernel(
    # Pointers
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    out_ptr,
    m_indices_ptr,
    block_rows_ptr,
    a_desc,
    b_desc,
    # Sizes (each strides argument is one tensor's strides)
    num_rows,
    N,
    K,
    a_strides,
    a_scale_strides,
    b_strides,
    b_scale_strides,
    out_strides,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SKIP_PADDING: tl.constexpr,
    TMA: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = num_rows // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles (one or a few experts) sweep N together, so an
    # expert's weight tiles are reused from L2 instead of re-read from memory.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    r0 = pid_m * BLOCK_M
    expert = tl.load(m_indices_ptr + r0).to(tl.int64)
    k_steps = tl.cdiv(K, BLOCK_K)
    offs_m = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    if SKIP_PADDING:
        # block_rows counts the rows with data at the start of each 128-row block. Tiles of
        # pure padding skip the K loop; padding rows of other tiles read zeros, so every
        # padding row of ``out`` is exactly 0 (never NaN from stale workspace bytes).
        filled = tl.load(block_rows_ptr + r0 // LAYOUT_ROWS) - r0 % LAYOUT_ROWS
        k_steps = tl.where(filled > 0, k_steps, 0)
        m_ok = tl.arange(0, BLOCK_M) < filled
    else:
        m_ok = tl.full((BLOCK_M,), 1, tl.int1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * a_strides[0] + offs_k[None, :]
    b_ptrs = b_ptr + expert * b_strides[0] + offs_n[None, :].to(tl.int64) * b_strides[1] + offs_k[:, None]
    as_ptrs = a_scale_ptr + offs_m * a_scale_strides[0]
    bs_ptrs = b_scale_ptr + expert * b_scale_strides[0] + (offs_n // GROUP) * b_scale_strides[1]
    b_scale_of_tile = b_scale_ptr + expert * b_scale_strides[0] + (pid_n * BLOCK_N // GROUP) * b_scale_strides[1]
    n_ok = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ks in range(0, k_steps):
        if TMA:  # zeros past K and past the last row; columns past N are another expert's, never stored
            a = a_desc.load([r0, ks * BLOCK_K])
            b = b_desc.load([(expert * N + pid_n * BLOCK_N).to(tl.int32), ks * BLOCK_K]).T
        else:  # with K and N multiples of 16 the masks hold over 16-element runs: the loads stay vectorized
            k_ok = ks * BLOCK_K + offs_k < K
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + ks * a_scale_strides[1], mask=m_ok, other=0.0)
        if BLOCK_N <= GROUP:  # the tile's columns share one weight scale per K step
            acc += tl.dot(a, b) * (a_s * tl.load(b_scale_of_tile + ks))[:, None]
        else:
            b_s = tl.load(bs_ptrs + ks, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if TMA and SKIP_PADDING:  # padding rows were read whole: their bytes are whatever the workspace held
        acc = tl.where(m_ok[:, None], acc, 0.0)

    out_ptrs = out_ptr + offs_m[:, None] * out_strides[0] + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


def contiguous_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    m_indices: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_rows: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Grouped fp8 GEMM over DeepGEMM's contiguous layout; returns ``out [M_sum, N]`` bf16.

    In plain Python::

        for r in range(M_sum):                       # tiles of BLOCK_M rows share m_indices
            e = m_indices[r]
            A = a[r] * a_scale[r].repeat_interleave(128)                 # dequantize the row
            B = b[e] * b_scale[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            out[r] = A @ B.T                           # (zeros where block_rows says padding)

    Args:
        a: fp8 ``[M_sum, K]`` (unit column stride), M_sum a multiple of 128.
        a_scale: fp32 ``[M_sum, ceil(K/128)]``, any strides (column-major is what permute makes).
        b: fp8 ``[E, N, K]`` contiguous. b_scale: fp32 ``[E, ceil(N/128), ceil(K/128)]``.
        m_indices: int32 ``[M_sum]``, constant over each 128-row block, values in ``[0, E)``.
        out: optional bf16 ``[M_sum, N]`` (unit column stride) to write into.
        block_rows: optional int32 ``[M_sum/128]`` rows of data per block; tiles past them are
            skipped (their rows of ``out`` become zeros).
        config: tile sizes (:class:`GemmConfig`); :func:`default_config` when None.

    Raises:
        InvalidInputError: a shape, dtype or stride does not match the layout.
    """
    M_sum, K = a.shape
    if b.dim() != 3 or b.shape[2] != K:
        raise InvalidInputError(f"b must be [E, N, K={K}], got {tuple(b.shape)}")
    E, N, _ = b.shape
    G_k, G_n = cdiv(K, FP8_GROUP), cdiv(N, FP8_GROUP)
    problems = []
    if a.dtype != FP8 or b.dtype != FP8:
        problems.append(f"a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if M_sum % ALIGN_M:
        problems.append(f"a must have a multiple of {ALIGN_M} rows, got {M_sum}")
    if a.stride(1) != 1 or not b.is_contiguous():
        problems.append(f"a needs a unit column stride and b must be contiguous, got {a.stride()} and {b.stride()}")
    if tuple(a_scale.shape) != (M_sum, G_k) or a_scale.dtype != torch.float32:
        problems.append(f"a_scale must be float32 {(M_sum, G_k)}, got {a_scale.dtype} {tuple(a_scale.shape)}")
    if tuple(b_scale.shape) != (E, G_n, G_k) or b_scale.dtype != torch.float32 or b_scale.stride(2) != 1:
        problems.append(
            f"b_scale must be float32 {(E, G_n, G_k)} row-major, got {b_scale.dtype} {tuple(b_scale.shape)}"
        )
    if m_indices.dtype != torch.int32 or m_indices.numel() != M_sum:
        problems.append(f"m_indices must be int32 [{M_sum}], got {m_indices.dtype} {tuple(m_indices.shape)}")
    if block_rows is not None and (block_rows.dtype != torch.int32 or block_rows.numel() != M_sum // ALIGN_M):
        problems.append(
            f"block_rows must be int32 [{M_sum // ALIGN_M}], got {block_rows.dtype} {tuple(block_rows.shape)}"
        )
    if out is None:
        out = torch.empty(M_sum, N, dtype=torch.bfloat16, device=a.device)
    elif tuple(out.shape) != (M_sum, N) or out.stride(1) != 1:
        problems.append(f"out must be [{M_sum}, {N}] with unit column stride, got {tuple(out.shape)} {out.stride()}")
    if problems:
        raise InvalidInputError("contiguous_gemm: " + "; ".join(problems))
    if M_sum == 0:
        return out
    cfg = config or default_config(M_sum, N, K)
    grid = ((M_sum // cfg.block_m) * cdiv(N, cfg.block_n),)
    a_desc = tma_descriptor(a, [cfg.block_m, FP8_GROUP]) if cfg.tma else None
    b_desc = weight_descriptor(b, [cfg.block_n, FP8_GROUP]) if a_desc is not None else None
    tma = a_desc is not None and b_desc is not None
    _contiguous_gemm_kernel[grid](
        a,
        a_scale,
        b,
        b_scale,
        out,
        m_indices,
        block_rows if block_rows is not None else m_indices,
        a_desc if tma else a,
        b_desc if tma else b,
        M_sum,
        N,
        K,
        a.stride(),
        a_scale.stride(),
        b.stride(),
        b_scale.stride(),
        out.stride(),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=FP8_GROUP,
        GROUP_M=cfg.group_m,
        SKIP_PADDING=block_rows is not None,
        TMA=tma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


__all__ = ["GemmConfig", "contiguous_gemm", "default_config"]
