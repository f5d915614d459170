"""fp8 e4m3 quantization of activations, one scale per 1 x 128 group of each row (Triton).

In plain Python (the spec is :func:`moekit.quant.quantize_fp8_per_token_group`)::

    for r in range(M):
        for g in range(K // 128):
            x = hidden[r, 128*g : 128*(g+1)].float()
            scale[r, g] = max(abs(x).max() / 448, 1e-10)
            q[r, 128*g : 128*(g+1)] = (x / scale[r, g]).clamp(-448, 448).to(fp8)

One pass over ``hidden``: the torch spec makes several fp32 copies of ``[M, K]`` on the way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.errors import QuantizationError
from moekit.kernels.activation import quantize_fp8_rows, round_for_store
from moekit.quant import FP8, FP8_GROUP, FP8_MAX, TINY_SCALE


@triton.jit
def _quantize_fp8_group_kernel(
    # Pointers
    x_ptr,
    q_ptr,
    scale_ptr,
    # Sizes
    M,
    K,
    stride_sr,
    stride_sg,
    # Meta-parameters
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TINY: tl.constexpr,
    FIX_ROUNDING: tl.constexpr,
):
    g = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_fp8_rows(x, FP8_MAX, TINY)  # NaN propagates, as in the torch spec
    if FIX_ROUNDING:  # the interpreter's fp32 -> fp8 cast drops carries (see activation.py)
        q = round_for_store(q, q_ptr.dtype.element_ty)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + rows * stride_sr + g * stride_sg, scale, mask=rows < M)


def quantize_fp8_group(x: torch.Tensor, *, group: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize contiguous ``x [M, K]`` to fp8; returns ``(q [M, K], scale [M, ceil(K/group)] fp32)``.

    Row-major scales (what the modular kernel slices per chunk). Same numbers as
    :func:`moekit.quant.quantize_fp8_per_token_group`.
    """
    if x.dim() != 2 or not x.is_floating_point() or x.dtype == FP8:
        raise QuantizationError(f"activations must be a 2-D bf16/fp16/fp32 tensor, got {x.dtype} {tuple(x.shape)}")
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or group & (group - 1):
        raise QuantizationError(f"group must be a positive power of two (128 for DeepGEMM), got {group!r}")
    x = x.contiguous()
    M, K = x.shape
    G = triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    scale = torch.empty((M, G), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, scale
    block_r = 16 if not interpreting() else 64
    grid = (triton.cdiv(M, block_r), G)
    consts = dict(GROUP=group, BLOCK_R=block_r, FP8_MAX=FP8_MAX, TINY=TINY_SCALE, FIX_ROUNDING=interpreting())
    _quantize_fp8_group_kernel[grid](x, q, scale, M, K, scale.stride(0), scale.stride(1), **consts)
    return q, scale
