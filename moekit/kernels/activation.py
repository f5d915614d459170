"""Gated activation between the two GEMMs: ``silu(gate) * up``, optionally requantized to fp8.

Shapes: R rows (tokens x topk slots), N = gate width + up width, H = N / 2::

    x    [R, N]      gate = x[:, :H], up = x[:, H:]
    out  [R, H]      silu(gate) * up, computed in fp32, stored in out's dtype

The fp8 variant quantizes the activation in the same pass, with one scale per 1 x ``group``
block of each row (what the fp8 block GEMM2 and DeepGEMM read), so the bf16 activation never
goes to memory.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.errors import InvalidInputError, QuantizationError
from moekit.quant import FP8, FP8_GROUP, FP8_MAX, TINY_SCALE
from moekit.types import KernelLaunch


def _check_x(x: torch.Tensor) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InvalidInputError(f"x must be a 2-D [R, N] tensor, got {got}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise InvalidInputError(f"x must be bf16/fp16/fp32, got {x.dtype}")
    R, N = x.shape
    if N % 2:
        raise InvalidInputError(f"x must have an even width (gate then up), got N={N}")
    if x.stride(-1) != 1 and R > 0:
        raise InvalidInputError(f"x must have contiguous rows (last stride 1), got strides {x.stride()}")
    return R, N // 2


def _check_out(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device, name: str) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        raise InvalidInputError(
            f"{name} must be {dtype} {shape} on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
        )


@triton.jit
def round_for_store(v, DTYPE: tl.constexpr):
    """Round fp32 ``v`` to the nearest ``DTYPE`` value (ties to even), still as fp32.

    Only for the interpreter (triton 3.9), whose casts go wrong: fp32 -> bf16 truncates, and
    fp32 -> fp8 e4m3 drops the carry when rounding crosses a power of two (127.9 -> 64). After
    this rounding the cast is exact. Compiled kernels skip it: the hardware casts are right.
    """
    if DTYPE == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # keep 7 mantissa bits
        v = bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float8e4nv:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits
        # Below 2**-6 e4m3 is subnormal, a fixed step of 2**-9: adding 1.5 * 2**14 (whose fp32
        # ulp is 2**-9) and subtracting it again rounds to that step.
        v = tl.where(tl.abs(v) < 0.015625, (v + 24576.0) - 24576.0, bits.to(tl.float32, bitcast=True))
    return v


@triton.jit
def quantize_fp8_rows(y, FP8_MAX: tl.constexpr, TINY: tl.constexpr):
    """``(q, scale)`` for an fp32 ``[ROWS, GROUP]`` tile, one scale per row, as moekit.quant does.

    ``scale = max(amax / 448, TINY)`` and ``q = clamp(y / scale, -448, 448)``; a row holding a
    NaN gets a NaN scale and NaN values (a GPU's max and clamp would drop the NaN and give a
    finite -448 instead).
    """
    has_nan = tl.max((y != y).to(tl.int32), axis=1) > 0
    scale = tl.maximum(tl.max(tl.abs(y), axis=1) / FP8_MAX, TINY)
    scale = tl.where(has_nan, float("nan"), scale)
    return clamp_fp8(y / scale[:, None], FP8_MAX), scale


@triton.jit
def clamp_fp8(q, FP8_MAX: tl.constexpr):
    """``clamp(q, -448, 448)`` that keeps NaN (the hardware clamp returns the bound for NaN)."""
    return tl.where(q == q, tl.clamp(q, -FP8_MAX, FP8_MAX), q)


@triton.jit
def _silu_and_mul_kernel(
    # Pointers
    x_ptr,
    out_ptr,
    # Sizes
    R,
    H,
    stride_xr,
    stride_or,
    # Meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FIX_ROUNDING: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < R) & (cols[None, :] < H)
    # 64-bit row offsets: R * N passes 2**31 at realistic sizes (131072 rows x 1536 at M=16384).
    x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_xr
    gate = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    if FIX_ROUNDING:
        y = round_for_store(y, out_ptr.dtype.element_ty)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_or + cols[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :H]) * x[:, H:]`` with ``H = N / 2``, in fp32, stored in x's dtype.

    Algorithm::

        for r in range(R):
            gate, up = x[r, :H].float(), x[r, H:].float()
            out[r] = (gate / (1 + exp(-gate)) * up).to(out.dtype)

    Args:
        x: ``[R, N]`` bf16/fp16/fp32 with contiguous rows (a row stride is allowed).
        out: optional ``[R, H]`` destination of x's dtype (contiguous rows).

    Returns:
        ``out`` ``[R, H]``.

    Raises:
        InvalidInputError: x is not 2-D float with an even width, or ``out`` does not fit.

    Example: ``x = [[1., 2., 3., 4.]]`` gives ``[[silu(1)*3, silu(2)*4]] = [[2.193, 7.046]]``.
    """
    R, H = _check_x(x)
    if out is None:
        out = torch.empty((R, H), dtype=x.dtype, device=x.device)
    _check_out(out, (R, H), x.dtype, x.device, "out")
    if R and H and out.stride(-1) != 1:
        raise InvalidInputError(f"out must have contiguous rows, got strides {out.stride()}")
    return launch_silu_and_mul(x, out, R, H, x_stride=x.stride(0) if R else 2 * H, out_stride=out.stride(0) if R else H)


def silu_and_mul_launch(
    x: torch.Tensor, out: torch.Tensor, rows: int, width: int, *, x_stride: int, out_stride: int
) -> KernelLaunch | None:
    """The launch of :func:`silu_and_mul` on ``rows`` rows of ``2 * width`` in ``x``, ``width`` in
    ``out`` (any buffer), unchecked; None when there is nothing to compute."""
    if rows == 0 or width == 0:
        return None
    grid, consts = _silu_tiles(rows, width, interpreting())
    return KernelLaunch(_silu_and_mul_kernel, grid, (x, out, rows, width, x_stride, out_stride), consts)


@functools.lru_cache(maxsize=4096)  # a pure function of the sizes, asked once per chunk
def _silu_tiles(rows: int, width: int, interpreted: bool) -> tuple[tuple[int, int], dict]:
    if interpreted:  # few, large programs: the interpreter pays per program
        BLOCK_H = min(triton.next_power_of_2(width), 256)
        BLOCK_R = max(1, 4096 // BLOCK_H)
    else:
        BLOCK_H = min(triton.next_power_of_2(width), 1024)
        BLOCK_R = max(1, 2048 // BLOCK_H)
    grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(width, BLOCK_H))
    return grid, dict(BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H, FIX_ROUNDING=interpreted)


def launch_silu_and_mul(
    x: torch.Tensor, out: torch.Tensor, rows: int, width: int, *, x_stride: int, out_stride: int
) -> torch.Tensor:
    """:func:`silu_and_mul` unchecked (see :func:`silu_and_mul_launch`); returns ``out``."""
    launch = silu_and_mul_launch(x, out, rows, width, x_stride=x_stride, out_stride=out_stride)
    if launch is not None:
        launch.run()
    return out


@triton.jit
def _silu_and_mul_fp8_group_kernel(
    # Pointers
    x_ptr,
    q_ptr,
    scale_ptr,
    static_ptr,
    # Sizes
    R,
    R_PAD,
    H,
    stride_xr,
    stride_qr,
    stride_sr,
    stride_sg,
    stride_static,
    # Meta-parameters
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    STATIC: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TINY: tl.constexpr,
    FIX_ROUNDING: tl.constexpr,
):
    g = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = g * GROUP + tl.arange(0, GROUP)
    live = rows < R
    mask = live[:, None] & (cols[None, :] < H)
    x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_xr
    gate = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up  # [BLOCK_R, GROUP], never stored in bf16
    if STATIC:
        scale = tl.load(static_ptr + rows * stride_static, mask=live, other=1.0)
        q = clamp_fp8(y / scale[:, None], FP8_MAX)
    else:
        q, scale = quantize_fp8_rows(y, FP8_MAX, TINY)
    if FIX_ROUNDING:
        q = round_for_store(q, q_ptr.dtype.element_ty)
    q_out = q_ptr + rows.to(tl.int64)[:, None] * stride_qr + cols[None, :]
    tl.store(q_out, q.to(q_ptr.dtype.element_ty), mask=mask)
    # Rows in [R, R_PAD) exist only in the column-major layout (TMA wants rows % 4 == 0): zeros.
    scale = tl.where(live, scale, 0.0)
    tl.store(scale_ptr + rows * stride_sr + g * stride_sg, scale, mask=rows < R_PAD)


def silu_and_mul_fp8_group(
    x: torch.Tensor,
    *,
    out_q: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    group: int = FP8_GROUP,
    column_major_scales: bool = False,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(x[:, :H]) * x[:, H:]`` quantized to fp8 e4m3 with one scale per 1 x ``group`` block.

    Algorithm (the same numbers as ``moekit.quant.quantize_fp8_per_token_group`` applied to
    the fp32 activation, without materializing it)::

        for r in range(R):
            y = silu(x[r, :H].float()) * x[r, H:].float()
            for g in range(ceil(H / group)):
                blk = y[g * group : (g + 1) * group]
                scale[r, g] = max(blk.abs().max() / 448, 1e-10)     # or static_scale[r]
                q[r, g * group : ...] = clamp(blk / scale[r, g], -448, 448).to(fp8)

    Args:
        x: ``[R, N]`` bf16/fp16/fp32 with contiguous rows.
        out_q: optional ``[R, H]`` float8_e4m3fn destination (contiguous rows).
        out_scale: optional ``[R, G]`` fp32 destination, ``G = ceil(H / group)``; any strides
            (a transposed view of a column-major buffer works).
        group: quantization group width (a power of two; 128 for the fp8 block GEMMs).
        column_major_scales: allocate the scales in DeepGEMM's layout: storage
            ``[G, round_up(R, 4)]`` (padding rows hold 0), returned as a transposed ``[R, G]``
            view. Ignored when ``out_scale`` is given.
        static_scale: optional fp32 scale with 1 element (per tensor) or R elements (per row)
            used instead of the dynamic ``amax / 448``; it is written to every group of its row
            of the returned scales, so consumers read one layout either way.

    Returns:
        ``(q [R, H] float8_e4m3fn, scale [R, G] float32)``.

    Raises:
        InvalidInputError: bad ``x`` or destination shapes.
        QuantizationError: ``group`` not a power of two, or a ``static_scale`` of the wrong size.

    Example: one row ``[1., 2., 3., 4.]`` with group=128 has y = [2.193, 7.046], so
    ``scale = 7.046 / 448 = 0.01573`` and ``q = [139.4 -> 144, 448]`` (e4m3 rounds 139.4 to 144).
    """
    R, H = _check_x(x)
    if group <= 0 or group & (group - 1):
        raise QuantizationError(f"group must be a power of two, got {group}")
    G = math.ceil(H / group)
    if out_q is None:
        out_q = torch.empty((R, H), dtype=FP8, device=x.device)
    _check_out(out_q, (R, H), FP8, x.device, "out_q")
    R_pad = R
    if out_scale is None:
        if column_major_scales:
            R_pad = (R + 3) // 4 * 4
            out_scale = torch.empty((G, R_pad), dtype=torch.float32, device=x.device)[:, :R].t()
        else:
            out_scale = torch.empty((R, G), dtype=torch.float32, device=x.device)
    _check_out(out_scale, (R, G), torch.float32, x.device, "out_scale")
    if static_scale is not None:
        if static_scale.numel() not in (1, R) or static_scale.dtype != torch.float32:
            raise QuantizationError(
                f"static_scale must be float32 with 1 (per tensor) or R={R} (per row) elements, "
                f"got {static_scale.dtype} {tuple(static_scale.shape)}"
            )
        static_scale = static_scale.reshape(-1)
    if R and H and out_q.stride(-1) != 1:
        raise InvalidInputError(f"out_q must have contiguous rows, got strides {out_q.stride()}")
    return launch_silu_and_mul_fp8_group(
        x, out_q, out_scale, R, H, group=group, static_scale=static_scale, rows_padded=R_pad
    )


def silu_and_mul_fp8_group_launch(
    x: torch.Tensor,
    out_q: torch.Tensor,
    out_scale: torch.Tensor,
    rows: int,
    width: int,
    *,
    group: int = FP8_GROUP,
    static_scale: torch.Tensor | None = None,
    rows_padded: int | None = None,
) -> KernelLaunch | None:
    """The launch of :func:`silu_and_mul_fp8_group` unchecked; ``static_scale`` flat, ``rows_padded``
    scale rows (zeros past rows); None when there is nothing to compute."""
    R_pad = rows if rows_padded is None else rows_padded
    if rows == 0 or width == 0:
        return None
    static = static_scale is not None
    stride_static = 0 if not static or static_scale.numel() == 1 else static_scale.stride(0)
    BLOCK_R = max(1, (4096 if interpreting() else 1024) // group)
    grid = (triton.cdiv(R_pad, BLOCK_R), triton.cdiv(width, group))
    strides = (x.stride(0), out_q.stride(0), out_scale.stride(0), out_scale.stride(1), stride_static)
    args = (x, out_q, out_scale, static_scale if static else out_scale, rows, R_pad, width, *strides)
    consts = dict(GROUP=group, BLOCK_R=BLOCK_R, STATIC=static, FP8_MAX=FP8_MAX, TINY=TINY_SCALE)
    return KernelLaunch(_silu_and_mul_fp8_group_kernel, grid, args, dict(consts, FIX_ROUNDING=interpreting()))


def launch_silu_and_mul_fp8_group(x, out_q, out_scale, rows, width, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`silu_and_mul_fp8_group` unchecked (see :func:`silu_and_mul_fp8_group_launch`)."""
    launch = silu_and_mul_fp8_group_launch(x, out_q, out_scale, rows, width, **options)
    if launch is not None:
        launch.run()
    return out_q, out_scale
