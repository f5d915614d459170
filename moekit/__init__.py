"""moekit: a hands-on kit for chunked fused Mixture-of-Experts kernels.

``moekit.device`` is imported first on purpose: it turns Triton's interpreter on (CPU machines)
before any ``@triton.jit`` kernel is defined.
"""

import importlib  # noqa: I001  (moekit's own imports are in their order: moekit.device first)
import pkgutil
import sys

from moekit import device  # must come first: sets TRITON_INTERPRET
from moekit import errors, quant, reference, routing

__version__ = "0.1.0"

# Every other public name, and the module that defines it, imported on first use: kernel modules
# load only then, so `import moekit` stays quick (moekit.types is loaded by then anyway).
_LAZY = {
    "ActivationFormat": "moekit.types",
    "Chunk": "moekit.plan",
    "ChunkRecord": "moekit.trace",
    "ExpertPlacement": "moekit.types",
    "ExpertTokensMetadata": "moekit.types",
    "ModularKernel": "moekit.modular_kernel",
    "MoEWeights": "moekit.types",
    "Prepared": "moekit.types",
    "ProblemSize": "moekit.types",
    "QuantScheme": "moekit.types",
    "Trace": "moekit.trace",
    "WorkspaceShapes": "moekit.types",
    "chunk_ranges": "moekit.plan",
    "count_expert_num_tokens": "moekit.kernels.count",
    "fused_moe": "moekit.api",
    "owned_placement": "moekit.validate",
    "owned_scale": "moekit.validate",
}
_SUBMODULES = {module.name for module in pkgutil.iter_modules(__path__)}  # api, cli, experts, ...


def lazy_attributes(package: str, names: dict[str, str], submodules=()):
    """A module ``__getattr__`` for ``package`` (moekit's and its subpackages'): ``name`` in ``names`` is
    imported from module ``names[name]`` on first use, then kept in the package; a name in
    ``submodules`` is that submodule."""

    def __getattr__(name):
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


__getattr__ = lazy_attributes(__name__, _LAZY, _SUBMODULES)


__all__ = [*_LAZY, "device", "errors", "quant", "reference", "routing"]
