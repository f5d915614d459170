"""What the compiler made of a Triton kernel: registers, spills and shared memory per variant.

``kernel_reports(fn)`` lists every variant of the ``@triton.jit`` function ``fn`` compiled so far
in this process (one per set of compile-time constants and argument specializations), with the
numbers that explain a slow tile: ``n_regs`` registers per thread (255 is the ceiling), bytes
spilled to local memory, and the shared memory the pipeline stages take (at most 227 KiB per
block on Hopper). Under the interpreter nothing is compiled and the list is empty. The GPU checks
call it on moekit's private kernels, e.g. ``kernel_reports(grouped_gemm._fused_moe_kernel)``.
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
    # Triton split the kernel into warp-specialized partitions (its TTGIR holds ttg.warp_specialize)
    warp_specialized: bool = False


def _constants(kernel) -> dict:
    src = getattr(kernel, "src", None)
    raw = getattr(src, "constants", None) or {}
    names = getattr(getattr(src, "fn", None), "arg_names", None) or []
    out = {}
    for key, value in raw.items():
        index = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        name = names[index] if isinstance(index, int) and index < len(names) else str(key)
        if hasattr(value, "_asdict"):  # a NamedTuple of them (the wing's grouped GEMM takes its META so)
            out.update({k: v for k, v in value._asdict().items() if isinstance(v, (bool, int, float, str))})
        elif isinstance(value, (bool, int, float, str)):
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
                warp_specialized="ttg.warp_specialize" in (getattr(kernel, "asm", None) or {}).get("ttgir", ""),
            ))  # fmt: skip
    return reports
