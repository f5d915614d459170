"""Experts implementations, one per file (see ``base.py`` for the contract).

=========================  ========  =========  ==========================================
class                      format    chunking   what it runs
=========================  ========  =========  ==========================================
TritonExperts              Standard  yes        align -> grouped GEMM -> silu*mul -> GEMM
DeepGemmExperts            Standard  yes        contiguous layout, fp8 block (deep_gemm or Triton)
TritonOrDeepGemmExperts    Standard  yes        DeepGemm when M >= 128 and shapes fit, else Triton
GroupedMMExperts           Standard  yes        torch._grouped_mm, groups from tokens per expert
NaiveBatchedExperts        Batched   no         torch loop per expert (reference)
BatchedTritonExperts       Batched   no         batched GEMM masked by expert_num_tokens
=========================  ========  =========  ==========================================
"""

from __future__ import annotations

import importlib

from moekit.experts.base import Experts

_CLASSES = {
    "TritonExperts": "moekit.experts.triton",
    "DeepGemmExperts": "moekit.experts.deep_gemm",
    "TritonOrDeepGemmExperts": "moekit.experts.triton_or_deep_gemm",
    "GroupedMMExperts": "moekit.experts.grouped_mm",
    "NaiveBatchedExperts": "moekit.experts.batched",
    "BatchedTritonExperts": "moekit.experts.batched",
}

# Short names accepted by moekit.fused_moe(experts=...) (Standard-format experts only).
BY_NAME = {
    "triton": "TritonExperts",
    "deep_gemm": "DeepGemmExperts",
    "triton_or_deep_gemm": "TritonOrDeepGemmExperts",
    "grouped_mm": "GroupedMMExperts",
}


def __getattr__(name):
    if name in _CLASSES:
        value = getattr(importlib.import_module(_CLASSES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'moekit.experts' has no attribute {name!r}")


def experts_class(name: str) -> type[Experts]:
    """The Standard-format experts class for a short name ("triton", "deep_gemm", ...)."""
    from moekit.errors import InvalidInputError

    if not isinstance(name, str) or name not in BY_NAME:
        raise InvalidInputError(f"experts must be one of {sorted(BY_NAME)}, got {name!r}")
    return __getattr__(BY_NAME[name])


__all__ = ["Experts", "experts_class", *_CLASSES]
