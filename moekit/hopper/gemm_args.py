"""The grouped GEMM's arguments beyond the tensors, and the checks that everything fits together.

:class:`GatedOutput` (GEMM1's fused activation epilogue) and the book's ``RowWindow`` (rows of the
sorted layout one call computes) are what :func:`moekit.hopper.grouped_gemm.fused_moe_gemm` takes;
:func:`check_gemm_args` is its boundary check, run before anything is launched or written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.errors import InvalidInputError, QuantizationError
from moekit.hopper.configs import KernelConfig
from moekit.hopper.pair_blocks import PairBlocks
from moekit.kernels.align import AlignedBlocks
from moekit.kernels.fused_moe import RowWindow, check_float_pair
from moekit.kernels.host_math import cdiv
from moekit.quant import FP8, FP8_GROUP

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class GatedOutput:
    """GEMM1's fused epilogue: write ``silu(gate) * up`` instead of the raw product.

    ``w`` holds gate rows then up rows (``[E, 2H, K]``) and ``out`` is ``[numel, H]``. When
    ``out`` is fp8, the activation is also quantized with one scale per 1 x 128 group (BLOCK_N
    must be 128): dynamic ``amax / 448`` into ``out_scale``, or ``static_scale`` (1 element,
    or one per ``static_div`` consecutive pairs, e.g. per token with ``static_div = topk``).
    """

    out_scale: torch.Tensor | None = None
    static_scale: torch.Tensor | None = None
    static_div: int = 1


def check_layout(blocks, config, chunk: RowWindow | None) -> None:
    """``blocks`` is an aligned layout, or one pair per block (no row chunk, no persistent walk)."""
    if not isinstance(blocks, (AlignedBlocks, PairBlocks)):
        raise InvalidInputError(f"blocks must be AlignedBlocks or PairBlocks, got {type(blocks).__name__}")
    if isinstance(blocks, PairBlocks) and (chunk is not None or getattr(config, "persistent", False)):
        raise InvalidInputError(
            f"PairBlocks take the whole layout on the one-program-per-tile kernel, got chunk={chunk}, config={config!r}"
        )


def check_rows(a, out, blocks, pairs_per_row, config, chunk: RowWindow | None) -> None:
    """The rows ``out`` and ``a`` must hold: one per pair, or one per position of a row chunk."""
    check_layout(blocks, config, chunk)
    M, topk, _ = out.shape
    out_rows = chunk.rows if chunk is not None and chunk.write == "position" else blocks.numel
    if M * topk != out_rows:
        raise InvalidInputError(f"out must hold {out_rows} rows as [M, topk, N] (M*topk), got {tuple(out.shape)}")
    if M > 1 and topk > 1 and out.stride(0) != topk * out.stride(1):
        raise InvalidInputError(
            f"out's pairs must be evenly strided (stride(0) == topk * stride(1)), got {out.stride()}"
        )
    by_position = chunk is not None and chunk.read == "position"
    need = chunk.rows if by_position else blocks.numel
    if (
        not isinstance(pairs_per_row, int)
        or pairs_per_row <= 0
        or a.shape[0] * (1 if by_position else pairs_per_row) < need
    ):
        what = "positions" if by_position else "pairs"
        raise InvalidInputError(f"a has {a.shape[0]} rows for {need} {what} at pairs_per_row={pairs_per_row!r}")
    if (
        not isinstance(config, KernelConfig)
        or blocks.block_m % config.BLOCK_M
        or (chunk is None and config.BLOCK_M != blocks.block_m)
    ):
        raise InvalidInputError(
            f"config must be a KernelConfig with BLOCK_M={blocks.block_m} (the blocks'; a divisor of it for a "
            f"row chunk), got {config!r}"
        )
    if chunk is not None and (chunk.read not in ("pair", "position") or chunk.write not in ("pair", "position")
                              or chunk.start % blocks.block_m or chunk.rows % config.BLOCK_M or chunk.rows < 0
                              or chunk.end > blocks.max_padded):  # fmt: skip
        raise InvalidInputError(
            f"a row chunk must start on a block of {blocks.block_m} rows and hold whole tiles of {config.BLOCK_M} "
            f"inside the layout's {blocks.max_padded} rows, got {chunk}"
        )


def check_gemm_args(a, w, out, blocks, pairs_per_row, config, a_scale, w_scale, gated, chunk=None) -> bool:
    if a.dim() != 2 or w.dim() != 3 or out.dim() != 3:
        raise InvalidInputError(
            f"expected a [rows, K], w [E, N, K], out [M, topk, N]; got {tuple(a.shape)}, "
            f"{tuple(w.shape)}, {tuple(out.shape)}"
        )
    E, N, K = w.shape
    width = N // 2 if gated else N
    if a.shape[1] != K or out.shape[2] != width:
        raise InvalidInputError(
            f"a must be [rows, K={K}] and out [M, topk, {width}], got {tuple(a.shape)} and {tuple(out.shape)}"
        )
    check_rows(a, out, blocks, pairs_per_row, config, chunk)
    fp8 = check_float_pair(a, w)
    if out.dtype not in _FLOATS and not (gated and out.dtype == FP8):
        raise InvalidInputError(f"out must be fp32/fp16/bf16 (or fp8 with a GatedOutput), got {out.dtype}")
    if gated and N % 2:
        raise InvalidInputError(f"a gated GEMM needs gate and up rows (even N), got N={N}")
    if gated and out.dtype == FP8:
        if width % FP8_GROUP or config.BLOCK_N != FP8_GROUP:
            raise QuantizationError(
                f"fp8 output needs N/2 % 128 == 0 and BLOCK_N == 128, got {width}, {config.BLOCK_N}"
            )
        s, want = gated.out_scale, (out.shape[0] * out.shape[1], width // FP8_GROUP)
        if s is None or tuple(s.shape) != want or s.dtype != torch.float32:
            raise QuantizationError(f"fp8 output needs out_scale float32 {want}, got {None if s is None else s.shape}")
        st, per_row = gated.static_scale, cdiv(blocks.numel, gated.static_div)
        if st is not None and (st.dtype != torch.float32 or st.numel() not in (1, per_row)):
            raise QuantizationError(f"static_scale must be float32, 1 or numel/static_div elements, got {st.shape}")
    if not fp8:
        return False
    want_a, want_w = (a.shape[0], cdiv(K, FP8_GROUP)), (E, cdiv(N, FP8_GROUP), cdiv(K, FP8_GROUP))
    for name, scale, want in (("a_scale", a_scale, want_a), ("w_scale", w_scale, want_w)):
        if scale is None or tuple(scale.shape) != want or scale.dtype != torch.float32:
            got = "None" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
            raise QuantizationError(f"fp8 needs {name} float32 {want}, got {got}")
    if FP8_GROUP % config.BLOCK_K or K % FP8_GROUP or (gated and width % FP8_GROUP):
        raise QuantizationError(
            f"fp8 block GEMM needs K (and a gated N/2) % 128 == 0 and BLOCK_K dividing 128, got K={K}, N={N}, "
            f"BLOCK_K={config.BLOCK_K}"
        )
    return True
