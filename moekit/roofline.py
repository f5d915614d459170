"""The roofline of one MoE layer call: the bytes it must move, the flops it must do, its floor.

Letters as everywhere in moekit: M tokens, K hidden, I intermediate, N = 2 x I (w1 rows),
E experts, topk experts per token.

One layer call moves at least the weights of the experts it hits plus its activations, and
does two GEMMs per (token, slot) pair::

    bytes = unique_experts * (N * K + K * I) * weight_bytes  (+ fp8 block scales)
            + M * K * in_bytes + M * K * out_bytes
    flops = 2 * M * topk * K * N  +  2 * M * topk * I * K
    floor = max(bytes / bandwidth, flops / peak[quant])        (a machine's Ceilings)

Worked example (Qwen3-30B-A3B, bf16, M=1): 8 experts x (1536 x 2048 + 2048 x 768) x 2 bytes
= 75.5 MB; at the 4.3 TB/s an H200 copies, the floor is 75.5e6 / 4.3e12 = 17.6 us.

The ceilings are the caller's: what one machine was measured to do (the H200's live with the
benchmarks, beside the measurements they bound).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moekit.errors import InvalidInputError
from moekit.quant import FP8
from moekit.types import QuantScheme, expert_bytes

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
        if not isinstance(quant, QuantScheme):
            raise InvalidInputError(f"quant must be a moekit.QuantScheme (NONE: 16-bit weights), got {quant!r}")
        fp8 = quant is QuantScheme.FP8_BLOCK
        return expert_bytes(self.N, self.K, FP8 if fp8 else torch.bfloat16, scaled=fp8)


SHAPES: dict[str, LayerShape] = {
    "qwen3_30b_a3b": LayerShape("qwen3_30b_a3b", E=128, topk=8, K=2048, I=768),
    "deepseek_v3": LayerShape("deepseek_v3", E=256, topk=8, K=7168, I=2048),
}


def get_shape(name: str) -> LayerShape:
    """The named shape; raises InvalidInputError listing the known names."""
    if name not in SHAPES:
        raise InvalidInputError(f"shape must be one of {sorted(SHAPES)}, got {name!r}")
    return SHAPES[name]


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
class Ceilings:
    """What one machine can do at best: ``bandwidth`` bytes/s (a device copy, read plus write)
    and ``flops[quant]`` flop/s of a GEMM with that scheme's weights."""

    name: str
    bandwidth: float
    flops: Mapping[QuantScheme, float]

    def __post_init__(self):
        positive = lambda x: isinstance(x, int | float) and not isinstance(x, bool) and x > 0
        if not positive(self.bandwidth):
            raise InvalidInputError(f"{self.name}: bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.flops or not all(isinstance(q, QuantScheme) and positive(f) for q, f in self.flops.items()):
            raise InvalidInputError(f"{self.name}: flops must map QuantSchemes to flop/s > 0, got {dict(self.flops)!r}")


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


def layer_floor(shape: LayerShape, M: int, unique_experts: int, quant: QuantScheme, *, ceilings: Ceilings) -> Floor:
    """``max(bytes / bandwidth, flops / peak)`` for one call on the machine of ``ceilings``.

    Raises:
        InvalidInputError: ``quant`` is no QuantScheme, ``ceilings`` is no :class:`Ceilings` or
            has no peak for ``quant``, or ``unique_experts`` is out of range.
    """
    if not isinstance(ceilings, Ceilings):
        raise InvalidInputError(f"ceilings must be a moekit.roofline.Ceilings, got {type(ceilings).__name__}")
    b = layer_bytes(shape, M, unique_experts, quant)
    if quant not in ceilings.flops:
        known = sorted(q.name for q in ceilings.flops)
        raise InvalidInputError(f"{ceilings.name} has no peak for {quant} (it has {known}); add one to its flops")
    f = layer_flops(shape, M)
    return Floor(b, f, b / ceilings.bandwidth * 1e6, f / ceilings.flops[quant] * 1e6)
