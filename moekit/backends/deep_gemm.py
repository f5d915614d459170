"""Adapter to a real ``deep_gemm`` install: detection, and one call for the contiguous GEMM.

DeepGEMM's grouped "contiguous" GEMM computes, for every row r of a stacked activation matrix,
``out[r] = a[r] @ b[m_indices[r]].T`` with fp8 operands, 1x128 activation scales and 128x128
weight scales. moekit uses it when it can and otherwise runs its own Triton kernel of the same
layout (:mod:`moekit.kernels.contiguous_gemm`).

"Importable" is not "usable". :func:`status` checks, cheapest first:

1. a ``deep_gemm`` package is installed (found without importing it);
2. its JIT include dir ``deep_gemm/include/{deep_gemm,cute,cutlass}`` holds CUDA headers: the
   kernels are compiled at first call from these, and the PyPI ``deep-gemm==1.0.0`` wheel ships
   without them, so it imports fine and then cannot build a single kernel;
3. moekit runs on a CUDA GPU of compute capability 9.x (Hopper);
4. the package imports, and it exposes one of the two known APIs:

   ======  ============================================  =======================================
   api     grouped contiguous GEMM                       row alignment of the layout
   ======  ============================================  =======================================
   "1.0"   ``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous``  ``get_m_alignment_for_contiguous_layout``
   "v2"    ``m_grouped_fp8_gemm_nt_contiguous``           ``get_mk_alignment_for_contiguous_layout``
   ======  ============================================  =======================================

   Both take ``((a, a_scale), (b, b_scale), out, m_indices)`` in that order. 1.0 also has
   ``get_col_major_tma_aligned_tensor`` (the scale layout moekit already produces).

The result is cached. :func:`status` never raises, and this module imports only the standard
library and torch, so ``moekit.device.info()`` can call it anywhere.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from moekit.errors import BackendUnavailableError

_APIS = (  # (api, gemm, alignment); v2 first: v2 keeps a 1.0-style alias for the alignment only
    ("v2", "m_grouped_fp8_gemm_nt_contiguous", "get_mk_alignment_for_contiguous_layout"),
    ("1.0", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous", "get_m_alignment_for_contiguous_layout"),
)
_HEADER_DIRS = ("deep_gemm", "cute", "cutlass")


@dataclass(frozen=True)
class DeepGemmStatus:
    """Whether deep_gemm can run here; ``reason`` says why not (or what was found)."""

    usable: bool
    reason: str
    api: str | None = None


_CACHE: tuple[DeepGemmStatus, ModuleType | None] | None = None


def detect_api(module: object) -> str | None:
    """``"v2"``, ``"1.0"`` or None: which known contiguous-GEMM API ``module`` exposes."""
    for api, gemm, _ in _APIS:
        if callable(getattr(module, gemm, None)):
            return api
    return None


def _names(api: str) -> tuple[str, str]:
    for name, gemm, align in _APIS:
        if name == api:
            return gemm, align
    raise BackendUnavailableError(f"unknown deep_gemm api {api!r}; expected one of {[a[0] for a in _APIS]}")


def _missing_headers(package_dir: Path) -> str | None:
    include = package_dir / "include"
    missing = [d for d in _HEADER_DIRS if not (include / d).is_dir()]
    if not missing and not any((include / "deep_gemm").rglob("*.cuh")):
        missing = ["deep_gemm/*.cuh"]
    if not missing:
        return None
    return (
        f"deep_gemm at {package_dir} has no JIT headers ({', '.join(str(include / m) for m in missing)} "
        "missing), so it cannot compile its kernels; the PyPI deep-gemm==1.0.0 wheel is such a build. "
        "Install DeepGEMM from its source tree (with its cutlass submodule) instead"
    )


def _no(reason: str) -> tuple[DeepGemmStatus, None]:
    return DeepGemmStatus(False, reason), None


def _probe() -> tuple[DeepGemmStatus, ModuleType | None]:
    try:
        spec = importlib.util.find_spec("deep_gemm")
    except (ImportError, ValueError) as e:
        return DeepGemmStatus(False, f"deep_gemm cannot be located: {e}"), None
    if spec is None:
        return _no("deep_gemm is not installed (moekit uses its Triton contiguous GEMM)")
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        return DeepGemmStatus(False, f"deep_gemm at {spec.origin} is not a package"), None
    missing = _missing_headers(Path(locations[0]))
    if missing:
        return DeepGemmStatus(False, missing), None

    from moekit import device

    if device.get_device().type != "cuda":
        return DeepGemmStatus(False, "no CUDA device: moekit runs on the CPU (Triton interpreter)"), None
    major, minor = torch.cuda.get_device_capability()
    gpu = torch.cuda.get_device_name()
    if major != 9:
        return _no(f"needs a Hopper GPU (compute capability 9.x), got {major}.{minor} ({gpu})")
    try:
        module = importlib.import_module("deep_gemm")
    except Exception as e:  # a broken install raises anything (ImportError, AssertionError, OSError...)
        return DeepGemmStatus(False, f"import deep_gemm failed: {type(e).__name__}: {e}"), None
    api = detect_api(module)
    if api is None:
        known = ", ".join(gemm for _, gemm, _ in _APIS)
        return DeepGemmStatus(False, f"deep_gemm has none of the known contiguous GEMMs ({known})"), None
    missing_tool = _missing_jit_tools()
    if missing_tool:
        return DeepGemmStatus(False, missing_tool), None
    version = getattr(module, "__version__", "unknown version")
    return DeepGemmStatus(True, f"deep_gemm {version} ({api} API) on {gpu}", api), module


def _missing_jit_tools() -> str | None:
    """deep_gemm JIT-compiles its kernels with nvcc and names them with cuobjdump, both from
    CUDA_HOME. Without them the import works but the first GEMM fails (an os.path.join(None)
    TypeError in 1.0), so check here, where the reason can be reported."""
    import os
    import shutil

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.environ.get("DG_JIT_NVCC_COMPILER") or (home and os.path.join(home, "bin", "nvcc"))
    nvcc = nvcc or shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return "deep_gemm needs nvcc for its JIT: set CUDA_HOME (or DG_JIT_NVCC_COMPILER)"
    cuobjdump = os.path.join(os.path.dirname(nvcc), "cuobjdump")
    if not os.path.exists(cuobjdump) and not shutil.which("cuobjdump"):
        return f"deep_gemm needs cuobjdump beside {nvcc} for its JIT"
    return None


def _load() -> tuple[DeepGemmStatus, ModuleType | None]:
    global _CACHE
    if _CACHE is None:
        try:
            _CACHE = _probe()
        except Exception as e:  # status() must never raise
            _CACHE = (DeepGemmStatus(False, f"detection failed: {type(e).__name__}: {e}"), None)
    return _CACHE


def status(*, refresh: bool = False) -> DeepGemmStatus:
    """Whether a usable deep_gemm is installed here (cached; ``refresh=True`` probes again)."""
    global _CACHE
    if refresh:
        _CACHE = None
    return _load()[0]


def _module() -> tuple[ModuleType, str]:
    st, module = _load()
    if not st.usable or module is None or st.api is None:
        raise BackendUnavailableError(f"deep_gemm is not usable here: {st.reason}")
    return module, st.api


def m_alignment() -> int:
    """Rows per block of the contiguous layout (128 on Hopper). Raises if deep_gemm is unusable."""
    module, api = _module()
    return int(getattr(module, _names(api)[1])())


def grouped_gemm_contiguous(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
    m_indices: torch.Tensor,
) -> torch.Tensor:
    """``out[r] = (a[r] * a_scale[r]) @ (b[m_indices[r]] * b_scale[m_indices[r]]).T`` by deep_gemm.

    Args:
        a: fp8 ``[M_sum, K]``, rows grouped by expert, each group padded to 128 rows.
        a_scale: fp32 ``[M_sum, K/128]``, column-major storage (rows padded to a multiple of 4).
        b: fp8 ``[E, N, K]``. b_scale: fp32 ``[E, N/128, K/128]``.
        out: bf16 ``[M_sum, N]``, written in place and returned.
        m_indices: int32 ``[M_sum]``, the expert of every row; constant over each 128-row block
            and never -1 (1.0 reads out of bounds on a block whose first row is -1).

    Raises:
        BackendUnavailableError: deep_gemm cannot run here (the message says why).
    """
    module, api = _module()
    getattr(module, _names(api)[0])((a, a_scale), (b, b_scale), out, m_indices)
    return out


__all__ = ["DeepGemmStatus", "detect_api", "grouped_gemm_contiguous", "m_alignment", "status"]
