"""The anchors measured on an H200, the floors recorded with them, and the performance targets.

Everything is keyed ``(shape, dtype, M)``: a shape of :data:`moekit.roofline.SHAPES`, ``"bf16"``
or ``"fp8"`` (fp8 block weights) and the token count. The floors themselves are computed by
:mod:`moekit.roofline`; :data:`FACTS_FLOORS` are the values recorded beside the anchors, so a
test can check that the two agree.

``benchmarks/anchors.json`` holds :data:`ANCHORS` and :data:`FACTS_FLOORS` as data (notebook 06
reads it); :func:`anchors_json` produces it and ``python -m benchmarks.harness.anchors`` rewrites
it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

ANCHORS_JSON = Path(__file__).resolve().parents[1] / "anchors.json"

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

MOEKIT_PEERS = ("triton", "triton_fused", "triton_chunked", "deep_gemm", "deep_gemm_triton", "triton_or_deep_gemm")


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


def anchors_record() -> dict:
    """:data:`ANCHORS` and :data:`FACTS_FLOORS` as JSON-ready data (the keys spelled out)."""
    return {
        "anchors": [{"shape": s, "dtype": d, "M": M, "values": dict(values)} for (s, d, M), values in ANCHORS.items()],
        "floors": [{"shape": s, "dtype": d, "M": M, "us": us} for (s, d, M), us in FACTS_FLOORS.items()],
    }


def anchors_json() -> str:
    """The text of ``benchmarks/anchors.json``."""
    return json.dumps(anchors_record(), indent=2) + "\n"


def write_anchors_json(path: str | Path = ANCHORS_JSON) -> Path:
    """Rewrite ``benchmarks/anchors.json`` (or ``path``) from this module; returns the path."""
    path = Path(path)
    path.write_text(anchors_json())
    return path


if __name__ == "__main__":
    print(f"wrote {write_anchors_json(*sys.argv[1:2])}")
