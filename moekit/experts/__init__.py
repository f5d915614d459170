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

Short names for them ("triton", "deep_gemm", ...) are :data:`moekit.api.BY_NAME`.
"""

from __future__ import annotations

from moekit import lazy_attributes
from moekit.experts.base import Experts

_CLASSES = {
    "TritonExperts": "moekit.experts.triton",
    "DeepGemmExperts": "moekit.experts.deep_gemm",
    "TritonOrDeepGemmExperts": "moekit.experts.triton_or_deep_gemm",
    "GroupedMMExperts": "moekit.experts.grouped_mm",
    "NaiveBatchedExperts": "moekit.experts.batched",
    "BatchedTritonExperts": "moekit.experts.batched",
}


__getattr__ = lazy_attributes(__name__, _CLASSES)


__all__ = ["Experts", *_CLASSES]
