"""Transitional: the compiler report now lives in ``benchmarks/kernel_report.py`` (workshop tooling).

This copy stays only because ``moekit/kernels/fused_moe.py`` still imports it for
``fused_moe.compile_report()``, which nothing calls any more (the GPU checks call
``benchmarks.kernel_report.kernel_reports(fused_moe._fused_moe_kernel)``). Delete this file in
the same change that deletes ``compile_report`` and its import from ``fused_moe.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelReport:
    """One compiled variant of a kernel."""

    name: str
    constants: dict = field(default_factory=dict)  # the compile-time arguments, by name
    num_warps: int = 0
    num_stages: int = 0
    n_regs: int = 0
    n_spills: int = 0
    shared_bytes: int = 0


def _constants(kernel) -> dict:
    src = getattr(kernel, "src", None)
    raw = getattr(src, "constants", None) or {}
    names = getattr(getattr(src, "fn", None), "arg_names", None) or []
    out = {}
    for key, value in raw.items():
        index = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        name = names[index] if isinstance(index, int) and index < len(names) else str(key)
        if isinstance(value, (bool, int, float, str)):
            out[name] = value
    return out


def kernel_reports(fn) -> list[KernelReport]:
    """Every compiled variant of ``fn`` (a ``triton.jit`` function) on every device so far."""
    reports = []
    for cache in getattr(fn, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for kernel in list(kernels.values()):
            try:
                kernel._init_handles()  # registers and spills are known once the binary is loaded
            except Exception:  # a kernel that cannot load still has its metadata
                pass
            meta = kernel.metadata
            reports.append(KernelReport(
                name=kernel.name, constants=_constants(kernel), num_warps=meta.num_warps,
                num_stages=meta.num_stages, n_regs=getattr(kernel, "n_regs", 0) or 0,
                n_spills=getattr(kernel, "n_spills", 0) or 0, shared_bytes=meta.shared,
            ))  # fmt: skip
    return reports
