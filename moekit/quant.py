"""fp8 e4m3 quantization in the DeepSeek-V3 / DeepGEMM style (plain torch; the spec).

- Activations: one fp32 scale per 1x128 group of each row, ``scale = amax(group) / 448``.
  DeepGEMM wants these scales column-major with the row count padded to a multiple of 4 (TMA
  alignment); ``column_major=True`` returns that layout as a ``[M, K/128]`` view.
- Weights: one fp32 scale per 128x128 block, row-major ``[E, N/128, K/128]``.

``x ~= dequantize(q, scale)``; the relative error of one element is at most 2**-4 (e4m3 keeps 3
mantissa bits) down to the subnormal range. Below it the error is absolute: values smaller than
half of ``amax / 448 * 2**-9`` (the smallest subnormal step) flush to zero.
"""

from __future__ import annotations

import math

import torch

from moekit.errors import QuantizationError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
_TINY = 1e-10


def _check_float(x: torch.Tensor, what: str) -> None:
    if not x.is_floating_point() or x.dtype == FP8:
        raise QuantizationError(f"{what} must be bf16/fp16/fp32, got {x.dtype}")


def quantize_fp8_per_token_group(
    x: torch.Tensor, group: int = GROUP, *, column_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` to fp8 with one scale per ``1 x group`` block.

    Returns ``(q [M, K] float8_e4m3fn, scale [M, ceil(K/group)] float32)``. With
    ``column_major=True`` the scale's storage is ``[ceil(K/group), round_up(M, 4)]`` (what
    DeepGEMM reads) and the returned tensor is a transposed ``[M, ceil(K/group)]`` view of it.
    """
    _check_float(x, "activations")
    if x.dim() != 2:
        raise QuantizationError(f"activations must be 2-D [M, K], got shape {tuple(x.shape)}")
    M, K = x.shape
    G = math.ceil(K / group)
    pad = G * group - K
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(M, G, group)
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(_TINY)  # [M, G]
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(M, G * group)[:, :K].to(FP8)
    if column_major:
        storage = torch.zeros(G, (M + 3) // 4 * 4, dtype=torch.float32, device=x.device)
        storage[:, :M] = scale.t()
        scale = storage[:, :M].t()
    return q.contiguous(), scale


def dequantize_fp8_per_token_group(q: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """fp32 ``[M, K]`` from fp8 ``q [M, K]`` and group scales ``[M, ceil(K/group)]``."""
    M, K = q.shape
    s = scale.float().repeat_interleave(group, dim=1)[:, :K]
    return q.float() * s


def quantize_fp8_block(w: torch.Tensor, block: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights ``[..., R, C]`` with one scale per ``block x block`` tile.

    Returns ``(q float8_e4m3fn, scale [..., ceil(R/block), ceil(C/block)] float32)``.
    """
    _check_float(w, "weights")
    if w.dim() < 2:
        raise QuantizationError(f"weights must be at least 2-D, got shape {tuple(w.shape)}")
    *lead, R, C = w.shape
    Rb, Cb = math.ceil(R / block), math.ceil(C / block)
    wf = torch.nn.functional.pad(w.float(), (0, Cb * block - C, 0, Rb * block - R))
    tiles = wf.view(*lead, Rb, block, Cb, block)
    scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp_min(_TINY)  # [..., Rb, Cb]
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(*lead, Rb * block, Cb * block)[..., :R, :C].to(FP8)
    return q.contiguous(), scale.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: int = GROUP) -> torch.Tensor:
    """fp32 weights from fp8 ``q [..., R, C]`` and block scales ``[..., R/block, C/block]``."""
    *_, R, C = q.shape
    s = scale.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return q.float() * s[..., :R, :C]
