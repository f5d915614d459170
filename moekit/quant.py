"""fp8 e4m3 quantization in the DeepSeek-V3 / DeepGEMM style (plain torch; the spec).

- Activations: one fp32 scale per 1x128 group of each row, ``scale = amax(group) / 448``.
  DeepGEMM wants these scales column-major with the row count padded to a multiple of 4 (TMA
  alignment); ``column_major=True`` returns that layout as a ``[M, K/128]`` view.
- Weights: one fp32 scale per 128x128 block, row-major ``[E, N/128, K/128]``.

``x ~= dequantize(q, scale)``; the relative error of one element is at most 2**-4 (e4m3 keeps 3
mantissa bits) down to the subnormal range. Below it the error is absolute: values smaller than
half of ``amax / 448 * 2**-9`` (the smallest subnormal step) flush to zero. A NaN propagates: its
group's scale is NaN, so every element of the group dequantizes to NaN.
"""

from __future__ import annotations

import math

import torch

from moekit.errors import InvalidInputError, QuantizationError

FP8 = torch.float8_e4m3fn  # the one fp8 dtype moekit uses (e4m3, finite, max 448)
FP8_MAX = 448.0
# The edge of an fp8 scale block: 1 x FP8_GROUP for activations (one scale per 128-wide group of
# a row) and FP8_GROUP x FP8_GROUP for weights. DeepSeek-V3's and DeepGEMM's 128.
FP8_GROUP = 128
TINY_SCALE = 1e-10  # the floor of every dynamic scale: an all-zero group keeps a finite scale


def _check_float(x, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise QuantizationError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype == FP8:
        raise QuantizationError(f"{what} must be bf16/fp16/fp32, got {x.dtype}")


def _check_group(group, what: str = "group") -> int:
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0:
        raise QuantizationError(f"{what} must be a positive int (128 for DeepGEMM), got {group!r}")
    return group


def _check_fp8(q, scale, want: tuple[int, ...], what: str) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype != FP8:
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise QuantizationError(f"{what}: q must be a float8_e4m3fn tensor, got {got}")
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        raise QuantizationError(f"{what}: scale must be a float tensor, got {type(scale).__name__}")
    if tuple(scale.shape) != want:
        raise QuantizationError(
            f"{what}: q {tuple(q.shape)} needs scales of shape {want}, got {tuple(scale.shape)} "
            "(a scale per group is never broadcast: that would reuse one row's or one expert's scales)"
        )


def quantize_fp8_per_token_group(
    x: torch.Tensor, group: int = FP8_GROUP, *, column_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` to fp8 with one scale per ``1 x group`` block.

    Returns ``(q [M, K] float8_e4m3fn, scale [M, ceil(K/group)] float32)``. With
    ``column_major=True`` the scale's storage is ``[ceil(K/group), round_up(M, 4)]`` (what
    DeepGEMM reads) and the returned tensor is a transposed ``[M, ceil(K/group)]`` view of it.

    Raises:
        QuantizationError: ``x`` is not a 2-D bf16/fp16/fp32 tensor, or ``group`` is not a positive int.
        InvalidInputError: ``column_major`` is not a bool.
    """
    _check_float(x, "activations")
    group = _check_group(group)
    if not isinstance(column_major, bool):  # not check_flag: moekit.validate imports this module
        raise InvalidInputError(f"column_major must be True or False, got {column_major!r}")
    if x.dim() != 2:
        raise QuantizationError(f"activations must be 2-D [M, K], got shape {tuple(x.shape)}")
    M, K = x.shape
    G = math.ceil(K / group)
    pad = G * group - K
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(M, G, group)
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(TINY_SCALE)  # [M, G]; NaN stays NaN
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(M, G * group)[:, :K].to(FP8)
    if column_major:
        storage = torch.zeros(G, (M + 3) // 4 * 4, dtype=torch.float32, device=x.device)
        storage[:, :M] = scale.t()
        scale = storage[:, :M].t()
    return q.contiguous(), scale


def dequantize_fp8_per_token_group(q: torch.Tensor, scale: torch.Tensor, group: int = FP8_GROUP) -> torch.Tensor:
    """fp32 ``[M, K]`` from fp8 ``q [M, K]`` and group scales ``[M, ceil(K/group)]`` (exactly that shape).

    Raises:
        QuantizationError: ``q`` is not fp8 ``[M, K]``, or the scales are not ``[M, ceil(K/group)]``.
    """
    group = _check_group(group)
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise QuantizationError(f"q must be a 2-D [M, K] fp8 tensor, got {getattr(q, 'shape', type(q).__name__)}")
    M, K = q.shape
    _check_fp8(q, scale, (M, math.ceil(K / group)), "dequantize_fp8_per_token_group")
    s = scale.float().repeat_interleave(group, dim=1)[:, :K]
    return q.float() * s


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights ``[..., R, C]`` with one scale per ``block x block`` tile.

    Returns ``(q float8_e4m3fn, scale [..., ceil(R/block), ceil(C/block)] float32)``.

    Raises:
        QuantizationError: ``w`` is not a float tensor of rank >= 2, or ``block`` is not a positive int.
    """
    _check_float(w, "weights")
    block = _check_group(block, "block")
    if w.dim() < 2:
        raise QuantizationError(f"weights must be at least 2-D, got shape {tuple(w.shape)}")
    *lead, R, C = w.shape
    Rb, Cb = math.ceil(R / block), math.ceil(C / block)
    wf = torch.nn.functional.pad(w.float(), (0, Cb * block - C, 0, Rb * block - R))
    tiles = wf.view(*lead, Rb, block, Cb, block)
    scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp_min(TINY_SCALE)  # [..., Rb, Cb]
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(*lead, Rb * block, Cb * block)[..., :R, :C].to(FP8)
    return q.contiguous(), scale.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_GROUP) -> torch.Tensor:
    """fp32 weights from fp8 ``q [..., R, C]`` and block scales ``[..., ceil(R/block), ceil(C/block)]``.

    Raises:
        QuantizationError: ``q`` is not fp8 of rank >= 2, or the scales are not exactly that shape
            (one scale block per expert and per tile; ``scale[0]`` for a ``[E, R, C]`` q is refused).
    """
    block = _check_group(block, "block")
    if not isinstance(q, torch.Tensor) or q.dim() < 2:
        raise QuantizationError(f"q must be an fp8 tensor of rank >= 2, got {getattr(q, 'shape', type(q).__name__)}")
    *lead, R, C = q.shape
    _check_fp8(q, scale, (*lead, math.ceil(R / block), math.ceil(C / block)), "dequantize_fp8_block")
    s = scale.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return q.float() * s[..., :R, :C]
