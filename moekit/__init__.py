"""moekit: a hands-on kit for chunked fused Mixture-of-Experts kernels.

``moekit.device`` is imported first on purpose: it turns Triton's interpreter on (CPU machines)
before any ``@triton.jit`` kernel is defined.
"""

from moekit import device  # noqa: I001  (must come first: sets TRITON_INTERPRET)
from moekit import errors, quant, reference, routing
from moekit.plan import Chunk, chunk_ranges
from moekit.types import (
    ActivationFormat,
    ExpertPlacement,
    ExpertTokensMetadata,
    MoEWeights,
    Prepared,
    ProblemSize,
    QuantScheme,
    WorkspaceShapes,
)

__version__ = "0.1.0"

_LAZY = {
    "count_expert_num_tokens": ("moekit.kernels.count", "count_expert_num_tokens"),
    "ModularKernel": ("moekit.modular_kernel", "ModularKernel"),
    "fused_moe": ("moekit.api", "fused_moe"),
    "Trace": ("moekit.trace", "Trace"),
    "ChunkRecord": ("moekit.trace", "ChunkRecord"),
}


_SUBMODULES = {
    "api",
    "backends",
    "cli",
    "ep",
    "experts",
    "integrations",
    "kernels",
    "modular_kernel",
    "plan",
    "prepare_finalize",
    "roofline",
    "testing",
    "trace",
    "validate",
    "viz",
    "widgets",
    "workspace",
}


def __getattr__(name):
    # Kernel modules load on first use, so `import moekit` stays quick.
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"moekit.{name}")
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'moekit' has no attribute {name!r}")


__all__ = [
    "ActivationFormat",
    "Chunk",
    "ChunkRecord",
    "ExpertPlacement",
    "ExpertTokensMetadata",
    "ModularKernel",
    "MoEWeights",
    "Prepared",
    "ProblemSize",
    "QuantScheme",
    "Trace",
    "WorkspaceShapes",
    "chunk_ranges",
    "count_expert_num_tokens",
    "device",
    "errors",
    "fused_moe",
    "quant",
    "reference",
    "routing",
]
