"""Named MoE layer shapes, their byte and flop accounting, and the H200 anchors and targets.

Letters as everywhere in moekit: M tokens, K hidden, I intermediate, N = 2 x I (w1 rows),
E experts, topk experts per token.

One layer call moves at least the weights of the experts it hits plus its activations, and
does two GEMMs per (token, slot) pair::

    bytes = unique_experts * (N * K + K * I) * weight_bytes  (+ fp8 block scales)
            + M * K * in_bytes + M * K * out_bytes
    flops = 2 * M * topk * K * N  +  2 * M * topk * I * K
    floor = max(bytes / 4.3 TB/s, flops / peak)     peak: 790 TF/s bf16, 1365 TF/s fp8

Worked example (Qwen3-30B-A3B, bf16, M=1): 8 experts x (1536 x 2048 + 2048 x 768) x 2 bytes
= 75.5 MB, so the floor is 75.5e6 / 4.3e12 = 17.6 us, the recorded floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moekit.errors import InvalidInputError

BANDWIDTH = 4.3e12  # bytes/s, device copy measured on the H200 (read + write)
PEAK_FLOPS = {"bf16": 790e12, "fp8": 1365e12}  # measured: bf16 GEMM, fp8 torch._scaled_mm
DTYPES = ("bf16", "fp8")
_WEIGHT_BYTES = {"bf16": 2, "fp8": 1}
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

    def expert_bytes(self, dtype: str) -> int:
        """Bytes of one expert's w1 and w2 (plus its 128x128 block scales for fp8)."""
        _check_dtype(dtype)
        elems = self.N * self.K + self.K * self.I
        scales = 0
        if dtype == "fp8":
            scales = 4 * (math.ceil(self.N / 128) * math.ceil(self.K / 128)
                          + math.ceil(self.K / 128) * math.ceil(self.I / 128))
        return elems * _WEIGHT_BYTES[dtype] + scales


SHAPES: dict[str, LayerShape] = {
    "qwen3_30b_a3b": LayerShape("qwen3_30b_a3b", E=128, topk=8, K=2048, I=768),
    "deepseek_v3": LayerShape("deepseek_v3", E=256, topk=8, K=7168, I=2048),
}


def get_shape(name: str) -> LayerShape:
    """The named shape; raises InvalidInputError listing the known names."""
    if name not in SHAPES:
        raise InvalidInputError(f"shape must be one of {sorted(SHAPES)}, got {name!r}")
    return SHAPES[name]


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise InvalidInputError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def layer_flops(shape: LayerShape, M: int) -> int:
    """Useful flops of one layer call: GEMM1 ``[M*topk, K] x [K, N]`` plus GEMM2 ``[M*topk, I] x [I, K]``."""
    pairs = M * shape.topk
    return 2 * pairs * shape.K * shape.N + 2 * pairs * shape.I * shape.K


def layer_bytes(shape: LayerShape, M: int, unique_experts: int, dtype: str) -> int:
    """The fewest bytes one call must move: weights of the experts hit, activations in and out."""
    if not 0 <= unique_experts <= min(shape.E, M * shape.topk):
        raise InvalidInputError(
            f"unique_experts must be in [0, min(E={shape.E}, M*topk={M * shape.topk})], got {unique_experts}"
        )
    return unique_experts * shape.expert_bytes(dtype) + 2 * M * shape.K * _ACT_BYTES


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


def layer_floor(shape: LayerShape, M: int, unique_experts: int, dtype: str) -> Floor:
    """``max(bytes / 4.3 TB/s, flops / peak)`` for one call (see the module docstring)."""
    b = layer_bytes(shape, M, unique_experts, dtype)
    f = layer_flops(shape, M)
    return Floor(b, f, b / BANDWIDTH * 1e6, f / PEAK_FLOPS[dtype] * 1e6)


# ----------------------------------------------------------------------------------------------
# Anchors measured on an H200 and the performance targets, keyed (shape, dtype, M).

ANCHORS: dict[tuple[str, str, int], dict[str, float]] = {
    ("qwen3_30b_a3b", "bf16", 1): {"vllm_triton": 89.0, "hf_grouped_mm": 664.0},
    ("qwen3_30b_a3b", "bf16", 128): {"vllm_triton": 393.0, "hf_grouped_mm": 583.0},
    ("qwen3_30b_a3b", "bf16", 4096): {"vllm_triton": 1030.0, "hf_grouped_mm": 1924.0},
    ("qwen3_30b_a3b", "bf16", 16384): {"vllm_triton": 3171.0, "hf_grouped_mm": 6463.0},
    ("qwen3_30b_a3b", "fp8", 4096): {"vllm_triton": 1647.0},
    ("deepseek_v3", "bf16", 16384): {
        "vllm_triton_default": 52500.0, "vllm_triton_tuned": 23200.0,
        "torch_grouped_mm": 30400.0, "hf_grouped_mm": 34200.0,
    },
}

# Floors as recorded with the anchors (us); the bench recomputes its own from the routing it drew.
FACTS_FLOORS: dict[tuple[str, str, int], float] = {
    ("qwen3_30b_a3b", "bf16", 1): 17.6,
    ("qwen3_30b_a3b", "bf16", 128): 281.0,
    ("qwen3_30b_a3b", "bf16", 4096): 391.0,
    ("qwen3_30b_a3b", "bf16", 16384): 1566.0,
    ("deepseek_v3", "bf16", 16384): 14600.0,
}


@dataclass(frozen=True)
class Target:
    """One target of the performance issue: a time (us) or a rate, and what it applies to."""

    us: float | None = None
    gemm_tflops: float | None = None
    max_non_gemm_fraction: float | None = None
    peers: tuple[str, ...] = ()  # which peers it binds (empty: every moekit peer)
    note: str = ""

    def describe(self) -> str:
        parts = [f"<= {self.us:g} us"] if self.us is not None else []
        if self.gemm_tflops is not None:
            parts.append(f"GEMM >= {self.gemm_tflops:g} TF/s")
        if self.max_non_gemm_fraction is not None:
            parts.append(f"non-GEMM <= {self.max_non_gemm_fraction:.0%}")
        who = f" [{', '.join(self.peers)}]" if self.peers else ""
        return " and ".join(parts) + who + (f" ({self.note})" if self.note else "")


TARGETS: dict[tuple[str, str, int], list[Target]] = {
    ("qwen3_30b_a3b", "bf16", 1): [Target(us=35.0, note="CUDA graph")],
    ("qwen3_30b_a3b", "bf16", 128): [Target(us=320.0, note="CUDA graph")],
    ("qwen3_30b_a3b", "bf16", 4096): [Target(us=600.0)],
    ("qwen3_30b_a3b", "bf16", 16384): [Target(us=2100.0)],
    ("deepseek_v3", "bf16", 16384): [Target(us=18000.0)],
    ("deepseek_v3", "fp8", 4096): [
        Target(gemm_tflops=1150.0, max_non_gemm_fraction=0.25, peers=("deep_gemm",), note="real deep_gemm"),
        Target(gemm_tflops=600.0, peers=("deep_gemm_triton",), note="Triton contiguous fallback"),
    ],
}

MOEKIT_PEERS = ("triton", "triton_chunked", "deep_gemm", "deep_gemm_triton", "triton_or_deep_gemm")


def check_target(t: Target, peer: str, *, us: float | None, gemm_tflops: float | None = None,
                 non_gemm_fraction: float | None = None) -> bool | None:
    """True/False when ``t`` binds ``peer`` and the figures it needs were measured, else None."""
    binds = peer in t.peers if t.peers else peer in MOEKIT_PEERS
    if not binds:
        return None
    verdicts = []
    if t.us is not None and us is not None:
        verdicts.append(us <= t.us)
    if t.gemm_tflops is not None and gemm_tflops is not None:
        verdicts.append(gemm_tflops >= t.gemm_tflops)
    if t.max_non_gemm_fraction is not None and non_gemm_fraction is not None:
        verdicts.append(non_gemm_fraction <= t.max_non_gemm_fraction)
    return all(verdicts) if verdicts else None
