"""Batched-format GEMM masked by ``expert_num_tokens``: one small GEMM per expert slab.

Shapes (E experts, T = max tokens per expert, K reduction, N output columns)::

    a       [E, T, K]      rows past expert_num_tokens[e] are padding, never read
    b       [E, N, K]      one weight matrix per expert (w1 or w2), K-major as stored
    c       [E, T, N]      c[e, :n_e] = a[e, :n_e] @ b[e]^T
    counts  int32 [E]      n_e = expert_num_tokens[e]

fp8 block scaling (optional): ``a_scale [E, T, ceil(K/128)]`` (1x128 groups per row) and
``b_scale [E, ceil(N/128), ceil(K/128)]`` (128x128 blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.errors import InvalidInputError, QuantizationError
from moekit.kernels.host_math import cdiv, next_power_of_2
from moekit.quant import FP8, FP8_GROUP
from moekit.validate import check_float

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _batched_gemm_kernel(
    # Pointers
    a_ptr,
    b_ptr,
    c_ptr,
    counts_ptr,
    a_scale_ptr,
    b_scale_ptr,
    # Sizes (each strides argument is one tensor's three strides: expert, row, column)
    T,
    N,
    K,
    a_strides,
    b_strides,
    c_strides,
    a_scale_strides,
    b_scale_strides,
    # Meta-parameters
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP8_SCALED: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    ZERO_PADDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    e = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_n = tl.program_id(2)
    n_e = tl.minimum(tl.load(counts_ptr + e), T)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + e * c_strides[0] + offs_t[:, None] * c_strides[1] + offs_n[None, :] * c_strides[2]
    # What the store covers: valid rows only, or every row of the slab when padding is zeroed.
    rows_stored = n_e
    if ZERO_PADDING:
        rows_stored = T
    store_ok = (offs_t[:, None] < rows_stored) & (offs_n[None, :] < N)
    # The grid is sized for the worst case (T rows everywhere); tiles past this expert's tokens
    # do no math, so a lightly loaded expert costs almost nothing.
    if pid_t * BLOCK_T >= n_e:
        if ZERO_PADDING:
            tl.store(c_ptrs, tl.zeros((BLOCK_T, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=store_ok)
        return

    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_t < n_e
    col_ok = offs_n < N
    a_ptrs = a_ptr + e * a_strides[0] + offs_t[:, None] * a_strides[1] + offs_k[None, :] * a_strides[2]
    b_ptrs = b_ptr + e * b_strides[0] + offs_n[None, :] * b_strides[1] + offs_k[:, None] * b_strides[2]
    a_s_ptrs = a_scale_ptr + e * a_scale_strides[0] + offs_t * a_scale_strides[1]  # used with FP8_SCALED only
    b_s_ptrs = b_scale_ptr + e * b_scale_strides[0] + (offs_n // 128) * b_scale_strides[1]

    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for kb in range(tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST_BF16:
            # The interpreter multiplies raw bf16 bit patterns in tl.dot (triton #11584).
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP8_SCALED:
            # BLOCK_K == 128, so this K tile is exactly one scale group of a and of b.
            a_s = tl.load(a_s_ptrs + kb * a_scale_strides[2], mask=row_ok, other=0.0)
            b_s = tl.load(b_s_ptrs + kb * b_scale_strides[2], mask=col_ok, other=0.0)
            acc += tl.dot(a, b, input_precision=DOT_PRECISION) * a_s[:, None] * b_s[None, :]
        else:
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * a_strides[2]
        b_ptrs += BLOCK_K * b_strides[2]

    # Rows past n_e loaded as zeros, so acc is already 0 there (ZERO_PADDING stores it).
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=store_ok)


def batched_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    expert_num_tokens: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    zero_padding: bool = False,
) -> torch.Tensor:
    """``c[e, :n_e] = a[e, :n_e] @ b[e]^T`` for every expert slab; padding rows are skipped.

    The algorithm, in plain Python::

        for e in range(E):
            n = expert_num_tokens[e]
            c[e, :n] = a[e, :n] @ b[e].T        # rows n..T-1 of c[e] are left untouched

    One program computes one ``BLOCK_T x BLOCK_N`` tile of one expert; a tile whose first row
    is at or past ``n_e`` returns at once. **By default rows of ``c`` past
    ``expert_num_tokens[e]`` are never written**: with ``out`` given they keep their old
    contents, without it they are uninitialized memory, and consumers must read only
    ``c[e, :n_e]``. ``zero_padding=True`` writes zeros there instead (still no math), for a
    consumer that reads whole slabs, such as an activation that runs over every row.

    Args:
        a: ``[E, T, K]`` bf16/fp16/fp32, or fp8 e4m3 with ``a_scale``.
        b: ``[E, N, K]`` same dtype as ``a`` (fp8 with ``b_scale``).
        expert_num_tokens: int32 ``[E]`` valid rows per slab (values above T are clamped to T).
        out: optional ``[E, T, N]`` output; defaults to ``a``'s dtype (bf16 for fp8 inputs).
        a_scale: fp32 ``[E, T, ceil(K/128)]`` per 1x128 group, for fp8 inputs only.
        b_scale: fp32 ``[E, ceil(N/128), ceil(K/128)]`` per 128x128 block, for fp8 inputs only.
        zero_padding: write zeros to ``c[e, n_e:]`` instead of leaving those rows untouched.

    Returns:
        ``out`` (or a new ``[E, T, N]`` tensor).

    Raises:
        InvalidInputError: shapes, dtypes or devices do not match.
        QuantizationError: fp8 inputs without both scales, or scales with unquantized inputs.

    Example::

        >>> c = batched_gemm(a, w1, counts)            # a [4, 16, 64], w1 [4, 128, 64]
        >>> torch.allclose(c[0, :counts[0]], a[0, :counts[0]] @ w1[0].T)
    """
    fp8 = _check(a, b, expert_num_tokens, a_scale, b_scale)
    E, T, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((E, T, N), dtype=torch.bfloat16 if fp8 else a.dtype, device=a.device)
    elif tuple(out.shape) != (E, T, N) or out.dtype not in _FLOAT or out.device != a.device:
        raise InvalidInputError(
            f"out must be a float [E, T, N] = {(E, T, N)} tensor on {a.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if E == 0 or T == 0 or N == 0:
        return out

    BLOCK_T = min(64, max(16, next_power_of_2(T)))
    BLOCK_N = min(64, max(16, next_power_of_2(N)))
    BLOCK_K = FP8_GROUP if fp8 else min(64, max(16, next_power_of_2(K)))
    # Unused scale pointers still need a tensor and strides; point them at the counts.
    sa = a_scale if fp8 else expert_num_tokens.view(1, 1, -1)
    sb = b_scale if fp8 else expert_num_tokens.view(1, 1, -1)
    grid = (E, cdiv(T, BLOCK_T), cdiv(N, BLOCK_N))
    _batched_gemm_kernel[grid](
        a,
        b,
        out,
        expert_num_tokens,
        sa,
        sb,
        T,
        N,
        K,
        a.stride(),
        b.stride(),
        out.stride(),
        sa.stride(),
        sb.stride(),
        BLOCK_T=BLOCK_T,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        FP8_SCALED=fp8,
        UPCAST_BF16=interpreting() and a.dtype == torch.bfloat16,
        ZERO_PADDING=bool(zero_padding),
        # fp32 stays fp32 on the GPU (its default would round operands to tf32); the
        # precision only matters for fp32 operands, "tf32" is the default for the others.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return out


def _check(a, b, counts, a_scale, b_scale) -> bool:
    """Validate the operands; True when they are fp8 with block scales."""
    check_float(a, "a", dims=3, allow_fp8=True)
    check_float(b, "b", dims=3, allow_fp8=True)
    E, T, K = a.shape
    if b.shape[0] != E or b.shape[2] != K:
        raise InvalidInputError(f"b must be [E={E}, N, K={K}] to match a {tuple(a.shape)}, got {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in (*_FLOAT, FP8):
        raise InvalidInputError(f"a and b must share a dtype in bf16/fp16/fp32/fp8, got {a.dtype} and {b.dtype}")
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int32 or tuple(counts.shape) != (E,):
        got = f"{counts.dtype} {tuple(counts.shape)}" if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise InvalidInputError(f"expert_num_tokens must be int32 [E={E}], got {got}")
    if len({a.device, b.device, counts.device}) != 1:
        raise InvalidInputError(
            f"a, b, expert_num_tokens must share a device, got {a.device}, {b.device}, {counts.device}"
        )
    fp8 = a.dtype == FP8
    if not fp8:
        if a_scale is not None or b_scale is not None:
            raise QuantizationError(f"scales were given but a and b are {a.dtype}, not fp8")
        return False
    if a_scale is None or b_scale is None:
        raise QuantizationError("fp8 a and b need both a_scale and b_scale, got None")
    N, G = b.shape[1], cdiv(K, FP8_GROUP)
    want_a, want_b = (E, T, G), (E, cdiv(N, FP8_GROUP), G)
    for name, s, want in (("a_scale", a_scale, want_a), ("b_scale", b_scale, want_b)):
        if tuple(s.shape) != want or s.dtype != torch.float32 or s.device != a.device:
            raise QuantizationError(f"{name} must be float32 {want} on {a.device}, got {s.dtype} {tuple(s.shape)}")
    return True
