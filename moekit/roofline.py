"""The roofline of one MoE layer call: the bytes it must move, the flops it must do, its floor.

Letters as everywhere in moekit: M tokens, K hidden, I intermediate, N = 2 x I (w1 rows),
E experts, topk experts per token.

One layer call moves at least the weights of the experts it hits plus its activations, and
does two GEMMs per (token, slot) pair::

    bytes = unique_experts * (N * K + K * I) * weight_bytes  (+ fp8 block scales)
            + M * K * in_bytes + M * K * out_bytes
    flops = 2 * M * topk * K * N  +  2 * M * topk * I * K
    floor = max(bytes / 4.3 TB/s, flops / peak)     peak: 790 TF/s bf16, 1365 TF/s fp8 block

Worked example (Qwen3-30B-A3B, bf16, M=1): 8 experts x (1536 x 2048 + 2048 x 768) x 2 bytes
= 75.5 MB, so the floor is 75.5e6 / 4.3e12 = 17.6 us.

The two ceilings were measured on one H200: a device copy at 4.3 TB/s (bytes read plus
written), a bf16 GEMM at 790 TF/s and an fp8 ``torch._scaled_mm`` at 1365 TF/s. The benchmark
harness (``benchmarks/harness``) sets every measurement beside this floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moekit.errors import InvalidInputError
from moekit.types import QuantScheme

BANDWIDTH = 4.3e12  # bytes/s, device copy measured on the H200 (read + write)
# flop/s measured on the H200: a bf16 GEMM (16-bit weights), an fp8 torch._scaled_mm (fp8 block)
PEAK_FLOPS = {QuantScheme.NONE: 790e12, QuantScheme.FP8_BLOCK: 1365e12}
_WEIGHT_BYTES = {QuantScheme.NONE: 2, QuantScheme.FP8_BLOCK: 1}
_ACT_BYTES = 2  # activations enter and leave in bf16 (fp8 quantization happens inside the layer)


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer: E experts, topk per token, hidden K, intermediate I (N = 2 I)."""

    name: str
    E: int
    topk: int
    K: int
    I: int

    @property
    def N(self) -> int:
        return 2 * self.I

    def expert_bytes(self, quant: QuantScheme) -> int:
        """Bytes of one expert's w1 and w2 (plus its 128x128 block scales for fp8)."""
        _check_quant(quant)
        elems = self.N * self.K + self.K * self.I
        scales = 0
        if quant is QuantScheme.FP8_BLOCK:
            scales = 4 * (math.ceil(self.N / 128) * math.ceil(self.K / 128)
                          + math.ceil(self.K / 128) * math.ceil(self.I / 128))
        return elems * _WEIGHT_BYTES[quant] + scales


SHAPES: dict[str, LayerShape] = {
    "qwen3_30b_a3b": LayerShape("qwen3_30b_a3b", E=128, topk=8, K=2048, I=768),
    "deepseek_v3": LayerShape("deepseek_v3", E=256, topk=8, K=7168, I=2048),
}


def get_shape(name: str) -> LayerShape:
    """The named shape; raises InvalidInputError listing the known names."""
    if name not in SHAPES:
        raise InvalidInputError(f"shape must be one of {sorted(SHAPES)}, got {name!r}")
    return SHAPES[name]


def _check_quant(quant) -> None:
    if not isinstance(quant, QuantScheme):
        raise InvalidInputError(f"quant must be a moekit.QuantScheme (NONE: 16-bit weights), got {quant!r}")


def layer_flops(shape: LayerShape, M: int) -> int:
    """Useful flops of one layer call: GEMM1 ``[M*topk, K] x [K, N]`` plus GEMM2 ``[M*topk, I] x [I, K]``."""
    pairs = M * shape.topk
    return 2 * pairs * shape.K * shape.N + 2 * pairs * shape.I * shape.K


def layer_bytes(shape: LayerShape, M: int, unique_experts: int, quant: QuantScheme) -> int:
    """The fewest bytes one call must move: weights of the experts hit, activations in and out."""
    if not 0 <= unique_experts <= min(shape.E, M * shape.topk):
        raise InvalidInputError(
            f"unique_experts must be in [0, min(E={shape.E}, M*topk={M * shape.topk})], got {unique_experts}"
        )
    return unique_experts * shape.expert_bytes(quant) + 2 * M * shape.K * _ACT_BYTES


def expected_unique_experts(shape: LayerShape, M: int) -> float:
    """Experts hit by M tokens under uniform routing: ``E * (1 - (1 - topk/E) ** M)``."""
    return shape.E * (1.0 - (1.0 - shape.topk / shape.E) ** M)


@dataclass(frozen=True)
class Floor:
    """The floor of one call and which term sets it."""

    bytes: int
    flops: int
    memory_us: float
    compute_us: float

    @property
    def us(self) -> float:
        return max(self.memory_us, self.compute_us)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_us >= self.compute_us else "compute"


def layer_floor(shape: LayerShape, M: int, unique_experts: int, quant: QuantScheme) -> Floor:
    """``max(bytes / 4.3 TB/s, flops / peak)`` for one call (see the module docstring)."""
    b = layer_bytes(shape, M, unique_experts, quant)
    f = layer_flops(shape, M)
    return Floor(b, f, b / BANDWIDTH * 1e6, f / PEAK_FLOPS[quant] * 1e6)
