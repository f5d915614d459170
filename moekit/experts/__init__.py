"""Experts implementations, one per file (see ``base.py`` for the contract).

=========================  ========  =========  ==========================================
class                      format    chunking   what it runs
=========================  ========  =========  ==========================================
TritonExperts              Standard  yes        align -> grouped GEMM -> silu*mul -> GEMM
HopperTritonExperts        Standard  yes        the same at Hopper speed (moekit.hopper, the wing)
DeepGemmExperts            Standard  yes        contiguous layout, fp8 block (deep_gemm or Triton)
TritonOrDeepGemmExperts    Standard  yes        DeepGemm when M >= 128 and shapes fit, else Triton
GroupedMMExperts           Standard  yes        torch._grouped_mm, groups from tokens per expert
NaiveBatchedExperts        Batched   no         torch loop per expert (reference)
BatchedTritonExperts       Batched   no         batched GEMM masked by expert_num_tokens
=========================  ========  =========  ==========================================

The short name "triton" builds ``HopperTritonExperts`` on a Hopper GPU and the book's
``TritonExperts`` anywhere else (the interpreter included); "hopper" always builds the wing's.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection

from moekit.experts.base import Experts

_CLASSES = {
    "TritonExperts": "moekit.experts.triton",
    "HopperTritonExperts": "moekit.hopper.experts",
    "DeepGemmExperts": "moekit.experts.deep_gemm",
    "TritonOrDeepGemmExperts": "moekit.experts.triton_or_deep_gemm",
    "GroupedMMExperts": "moekit.experts.grouped_mm",
    "NaiveBatchedExperts": "moekit.experts.batched",
    "BatchedTritonExperts": "moekit.experts.batched",
}

# The one registry of short names (Standard-format experts only), wherever a name is accepted:
# moekit.fused_moe(experts=...), moekit.integrations.transformers.register(experts=..., fp8_experts=...),
# the benchmark harness. Each name maps to the class of _CLASSES it builds.
BY_NAME = {
    "triton": "TritonExperts",  # HopperTritonExperts on a Hopper GPU (experts_class)
    "hopper": "HopperTritonExperts",
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


def experts_class(name: str, *, among: Collection[str] | None = None, what: str = "experts") -> type[Experts]:
    """The Standard-format experts class for a short name of :data:`BY_NAME` ("triton", "deep_gemm", ...).

    Args:
        name: the short name.
        among: the names this caller accepts (a subset of :data:`BY_NAME`; default: all of them).
        what: how the caller calls the argument, for the error (``"fp8_experts"``).

    Raises:
        InvalidInputError: ``name`` is not one of ``among``, e.g. ``experts must be one of
            ['deep_gemm', 'grouped_mm', 'hopper', 'triton', 'triton_or_deep_gemm'], got 'cutlass'``.
    """
    from moekit.errors import InvalidInputError

    names = BY_NAME if among is None else among
    unknown = sorted(set(names) - set(BY_NAME))
    if unknown:
        raise InvalidInputError(f"among must hold names of moekit.experts.BY_NAME {sorted(BY_NAME)}, got {unknown}")
    if not isinstance(name, str) or name not in names:
        raise InvalidInputError(f"{what} must be one of {sorted(names)}, got {name!r}")
    if name == "triton":
        from moekit.device import is_hopper

        return __getattr__("HopperTritonExperts" if is_hopper() else "TritonExperts")
    return __getattr__(BY_NAME[name])


__all__ = ["BY_NAME", "Experts", "experts_class", *_CLASSES]
