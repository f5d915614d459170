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
from moekit.kernels.fused_moe import RowWindow
from moekit.kernels.fused_moe import check_gemm_args as check_book_args
from moekit.kernels.host_math import cdiv
from moekit.quant import FP8, FP8_GROUP


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


def check_gemm_args(a, w, out, blocks, pairs_per_row, config, a_scale, w_scale, gated, chunk=None) -> bool:
    """The book's checks (:func:`moekit.kernels.fused_moe.check_gemm_args`), then the wing's own:
    PairBlocks, and the fused activation's gate/up rows and fp8 output."""
    check_layout(blocks, config, chunk)
    if not isinstance(config, KernelConfig):
        raise InvalidInputError(f"config must be a KernelConfig, got {config!r}")
    N = w.shape[1] if w.dim() == 3 else 0
    if gated and N % 2:
        raise InvalidInputError(f"a gated GEMM needs gate and up rows (even N), got N={N}")
    if config.interleave and not gated:
        raise InvalidInputError(f"KernelConfig.interleave is for a gated GEMM, got gated={gated!r}")
    width = N // 2 if gated else None
    fp8 = check_book_args(
        a, w, out, blocks, pairs_per_row, config, a_scale, w_scale, chunk, width=width, fp8_out=gated is not None
    )
    if gated and out.dtype == FP8:  # (width is N // 2)
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
    return fp8
