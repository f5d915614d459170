"""Grouped GEMM over aligned blocks (Standard format): the two GEMMs of ``TritonExperts``.

Shapes (numel = M * topk (token, slot) pairs, E local experts, BM = BLOCK_M)::

    a         [rows_a, K]     GEMM1: hidden [M, K] (pair i reads row i // topk)
                              GEMM2: activations [M * topk, K] (pair i reads row i)
    w         [E, N, K]       one [N, K] matrix per expert (w1, or w2 with N = hidden size)
    out       [numel, N]      row i = pair i's result, unweighted
    blocks    AlignedBlocks   BM-row blocks of pairs, one expert each (moe_align_block_size)
    fp8 only: a_scale [rows_a, K/128] (1x128 groups), w_scale [E, N/128, K/128] (128x128 blocks)

One program computes a ``BLOCK_M x BLOCK_N`` tile: the rows of one block (all the same expert)
times a column slice of that expert's matrix. Rows are gathered through ``sorted_token_ids``,
so nothing is permuted in memory. A block of a remote expert (expert id -1) writes zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.errors import InvalidInputError, QuantizationError
from moekit.kernels.activation import round_for_store
from moekit.kernels.align import AlignedBlocks
from moekit.kernels.configs import KernelConfig

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128


@triton.jit
def _fused_moe_kernel(
    # Pointers
    a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, sorted_ptr, expert_ids_ptr, post_ptr,
    # Sizes
    N, K, numel, pairs_per_row, num_blocks,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk,
    # Meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, IS_FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    UPCAST_BF16: tl.constexpr, DOT_IEEE: tl.constexpr, FIX_ROUNDING: tl.constexpr,
):
    # GROUP_M row blocks sweep the columns together: neighbouring blocks are usually the same
    # expert, so its weight tiles come from L2 for all of them.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    # The grid is sized by an upper bound (no host sync); blocks past the real ones do nothing.
    if pid_m * BLOCK_M >= tl.load(post_ptr):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    live = pair < numel  # padding rows hold numel
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = live[:, None] & (offs_n[None, :] < N)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:  # the expert lives on another rank: its rows contribute zero
        tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty), mask=out_mask)
        return

    # Padding rows read row 0 and columns past N wrap around: every load is in bounds without a
    # mask, and those lanes are never stored.
    row = tl.where(live, pair // pairs_per_row, 0).to(tl.int64)
    col = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + col[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if IS_FP8:
        a_scale_ptrs = a_scale_ptr + row * stride_asm
        w_scale_ptrs = w_scale_ptr + expert * stride_wse + (col // SCALE_BLOCK) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if IS_FP8:
            # One 1x128 activation scale per row and one 128x128 weight scale per column block.
            group = (k * BLOCK_K) // SCALE_BLOCK
            a_s = tl.load(a_scale_ptrs + group * stride_ask)
            w_s = tl.load(w_scale_ptrs + group * stride_wsk)
            acc += tl.dot(a, b) * (a_s[:, None] * w_s[None, :])
        else:
            if UPCAST_BF16:  # the interpreter multiplies bf16 bit patterns in tl.dot
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if DOT_IEEE:  # fp32 stays fp32 (no tf32) so that fp32 results match the reference
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    if FIX_ROUNDING:
        acc = round_for_store(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check(a, w, out, blocks, pairs_per_row, config, a_scale, w_scale) -> bool:
    if a.dim() != 2 or w.dim() != 3 or out.dim() != 2:
        raise InvalidInputError(
            f"expected a [rows, K], w [E, N, K], out [numel, N]; got {tuple(a.shape)}, "
            f"{tuple(w.shape)}, {tuple(out.shape)}"
        )
    E, N, K = w.shape
    if a.shape[1] != K or tuple(out.shape) != (blocks.numel, N):
        raise InvalidInputError(
            f"a must be [rows, K={K}] and out [numel={blocks.numel}, N={N}], got {tuple(a.shape)} and {tuple(out.shape)}"
        )
    if not isinstance(pairs_per_row, int) or pairs_per_row <= 0 or a.shape[0] * pairs_per_row < blocks.numel:
        raise InvalidInputError(
            f"a has {a.shape[0]} rows for {blocks.numel} pairs at pairs_per_row={pairs_per_row!r}"
        )
    if not isinstance(config, KernelConfig):
        raise InvalidInputError(f"config must be a KernelConfig, got {config!r}")
    if config.BLOCK_M != blocks.block_m:
        raise InvalidInputError(f"config.BLOCK_M={config.BLOCK_M} but the blocks were aligned to {blocks.block_m}")
    if out.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise InvalidInputError(f"out must be fp32/fp16/bf16, got {out.dtype}")
    fp8 = a.dtype == FP8
    if fp8 != (w.dtype == FP8):
        raise QuantizationError(f"a and w must both be fp8 or both not, got {a.dtype} and {w.dtype}")
    if not fp8:
        if a.dtype != w.dtype or a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise InvalidInputError(f"a and w must share a float dtype (fp32/fp16/bf16), got {a.dtype} and {w.dtype}")
        return False
    want_a, want_w = (a.shape[0], triton.cdiv(K, SCALE_BLOCK)), (E, triton.cdiv(N, SCALE_BLOCK), triton.cdiv(K, SCALE_BLOCK))
    for name, scale, want in (("a_scale", a_scale, want_a), ("w_scale", w_scale, want_w)):
        if scale is None or tuple(scale.shape) != want or scale.dtype != torch.float32:
            got = "None" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
            raise QuantizationError(f"fp8 needs {name} float32 {want}, got {got}")
    if SCALE_BLOCK % config.BLOCK_K or K % SCALE_BLOCK:
        raise QuantizationError(
            f"fp8 block GEMM needs K % 128 == 0 and BLOCK_K dividing 128, got K={K}, BLOCK_K={config.BLOCK_K}"
        )
    return True


def fused_moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    blocks: AlignedBlocks,
    *,
    pairs_per_row: int,
    config: KernelConfig,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[i] = a[i // pairs_per_row] @ w[expert(i)].T`` for every placed pair i; zeros for remote ones.

    Algorithm (fp32 accumulation; fp8 dequantizes per k-step with the two scales)::

        for block in range(num_tokens_post_padded // BM):
            e = expert_ids[block]
            for i in sorted_token_ids[block * BM : (block + 1) * BM]:
                if i == numel:                     # padding
                    continue
                out[i] = 0 if e == -1 else a[i // pairs_per_row] @ w[e].T

    Pairs that ``blocks`` did not place (dropped empty slots) are not written.

    Args:
        a: ``[rows, K]`` activations, bf16/fp16/fp32 or fp8 e4m3 (then with ``a_scale``).
        w: ``[E, N, K]`` weights of the same dtype (fp8 with ``w_scale``).
        out: ``[numel, N]`` destination, bf16/fp16/fp32 (bf16 for fp8); may be a view.
        blocks: from :func:`moekit.kernels.align.moe_align_block_size` with ``config.BLOCK_M``.
        pairs_per_row: pairs that share a row of ``a``: topk for GEMM1, 1 for GEMM2.
        config: tile sizes (:func:`moekit.kernels.configs.get_config`).
        a_scale: fp8 only, float32 ``[rows, K/128]`` (any strides, e.g. column-major).
        w_scale: fp8 only, float32 ``[E, N/128, K/128]``.

    Returns:
        ``out``.

    Raises:
        InvalidInputError: shapes or dtypes do not fit together, or BLOCK_M differs from the blocks'.
        QuantizationError: fp8 without the right scales, K % 128 != 0, or BLOCK_K not dividing 128.
    """
    fp8 = _check(a, w, out, blocks, pairs_per_row, config, a_scale, w_scale)
    E, N, K = w.shape
    if blocks.numel == 0 or N == 0:
        return out
    num_blocks = blocks.max_blocks
    if fp8:
        scales = (a_scale, w_scale, a_scale.stride(0), a_scale.stride(1), *w_scale.stride())
    else:
        scales = (a, w, 0, 0, 0, 0, 0)  # unused pointers
    grid = (num_blocks * triton.cdiv(N, config.BLOCK_N),)
    _fused_moe_kernel[grid](
        a, w, out, scales[0], scales[1],
        blocks.sorted_token_ids, blocks.expert_ids, blocks.num_tokens_post_padded,
        N, K, blocks.numel, pairs_per_row, num_blocks,
        a.stride(0), a.stride(1), *w.stride(), out.stride(0), out.stride(1), *scales[2:],
        EVEN_K=K % config.BLOCK_K == 0, IS_FP8=fp8, SCALE_BLOCK=SCALE_BLOCK,
        UPCAST_BF16=interpreting() and a.dtype == torch.bfloat16,
        DOT_IEEE=a.dtype == torch.float32, FIX_ROUNDING=interpreting(),
        **config.launch,
    )  # fmt: skip
    return out
