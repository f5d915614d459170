"""The arguments of :func:`moekit.kernels.fused_moe.fused_moe_gemm`: epilogue options, checks, TMA.

:class:`GatedOutput` selects the fused silu_and_mul (and fp8 requantization) epilogue; ``_check``
validates every argument at the public boundary; ``_weight_descriptor`` builds the TMA descriptor
of the weights when ``KernelConfig.tma`` asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from moekit.errors import InvalidInputError, QuantizationError
from moekit.kernels.configs import KernelConfig

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _weight_descriptor(w: torch.Tensor, config: KernelConfig) -> TensorDescriptor | None:
    """A TMA descriptor of ``w`` as ``[E * N, K]`` with ``[BLOCK_N, BLOCK_K]`` boxes, or None
    where TMA cannot read it (not contiguous, rows not a multiple of 16 bytes, unaligned base)."""
    E, N, K = w.shape
    if not w.is_contiguous() or (K * w.element_size()) % 16 or w.data_ptr() % 16 or w.numel() == 0:
        return None
    return TensorDescriptor(w.view(E * N, K), [E * N, K], [K, 1], [config.BLOCK_N, config.BLOCK_K])


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


def _check_float_pair(a, w) -> bool:
    fp8 = a.dtype == FP8
    if fp8 != (w.dtype == FP8):
        raise QuantizationError(f"a and w must both be fp8 or both not, got {a.dtype} and {w.dtype}")
    if not fp8 and (a.dtype != w.dtype or a.dtype not in _FLOATS):
        raise InvalidInputError(f"a and w must share a float dtype (fp32/fp16/bf16), got {a.dtype} and {w.dtype}")
    return fp8


def _check(a, w, out, blocks, pairs_per_row, config, a_scale, w_scale, gated) -> bool:
    if a.dim() != 2 or w.dim() != 3 or out.dim() != 2:
        raise InvalidInputError(
            f"expected a [rows, K], w [E, N, K], out [numel, N]; got {tuple(a.shape)}, "
            f"{tuple(w.shape)}, {tuple(out.shape)}"
        )
    E, N, K = w.shape
    width = N // 2 if gated else N
    if a.shape[1] != K or tuple(out.shape) != (blocks.numel, width):
        raise InvalidInputError(
            f"a must be [rows, K={K}] and out [numel={blocks.numel}, {width}], got {tuple(a.shape)} and {tuple(out.shape)}"
        )
    if not isinstance(pairs_per_row, int) or pairs_per_row <= 0 or a.shape[0] * pairs_per_row < blocks.numel:
        raise InvalidInputError(f"a has {a.shape[0]} rows for {blocks.numel} pairs at pairs_per_row={pairs_per_row!r}")
    if not isinstance(config, KernelConfig) or config.BLOCK_M != blocks.block_m:
        raise InvalidInputError(f"config must be a KernelConfig with BLOCK_M={blocks.block_m} (the blocks'), got {config!r}")
    fp8 = _check_float_pair(a, w)
    if out.dtype not in _FLOATS and not (gated and out.dtype == FP8):
        raise InvalidInputError(f"out must be fp32/fp16/bf16 (or fp8 with a GatedOutput), got {out.dtype}")
    if gated and N % 2:
        raise InvalidInputError(f"a gated GEMM needs gate and up rows (even N), got N={N}")
    if gated and out.dtype == FP8:
        if width % SCALE_BLOCK or config.BLOCK_N != SCALE_BLOCK:
            raise QuantizationError(f"fp8 output needs N/2 % 128 == 0 and BLOCK_N == 128, got {width}, {config.BLOCK_N}")
        s, want = gated.out_scale, (blocks.numel, width // SCALE_BLOCK)
        if s is None or tuple(s.shape) != want or s.dtype != torch.float32:
            raise QuantizationError(f"fp8 output needs out_scale float32 {want}, got {None if s is None else s.shape}")
        st = gated.static_scale
        if st is not None and (st.dtype != torch.float32 or st.numel() not in (1, triton.cdiv(blocks.numel, gated.static_div))):
            raise QuantizationError(f"static_scale must be float32, 1 or numel/static_div elements, got {st.shape}")
    if not fp8:
        return False
    want_a, want_w = (a.shape[0], triton.cdiv(K, SCALE_BLOCK)), (E, triton.cdiv(N, SCALE_BLOCK), triton.cdiv(K, SCALE_BLOCK))
    for name, scale, want in (("a_scale", a_scale, want_a), ("w_scale", w_scale, want_w)):
        if scale is None or tuple(scale.shape) != want or scale.dtype != torch.float32:
            got = "None" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
            raise QuantizationError(f"fp8 needs {name} float32 {want}, got {got}")
    if SCALE_BLOCK % config.BLOCK_K or K % SCALE_BLOCK or (gated and width % SCALE_BLOCK):
        raise QuantizationError(
            f"fp8 block GEMM needs K (and a gated N/2) % 128 == 0 and BLOCK_K dividing 128, got K={K}, N={N}, "
            f"BLOCK_K={config.BLOCK_K}"
        )
    return True
