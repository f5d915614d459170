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

   ======  ============================================
   api     grouped contiguous GEMM
   ======  ============================================
   "1.0"   ``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous``
   "v2"    ``m_grouped_fp8_gemm_nt_contiguous``
   ======  ============================================

   Both take ``((a, a_scale), (b, b_scale), out, m_indices)`` in that order. 1.0 also has
   ``get_col_major_tma_aligned_tensor`` (the scale layout moekit already produces).

The result is cached. :func:`status` never raises, and this module imports only the standard
library, torch and moekit's errors, so ``moekit info`` can call it anywhere.

What this process knows about deep_gemm (the probe's result, the module, the GEMM shapes that failed
to build) lives in one :class:`DeepGemmBackend`, :data:`BACKEND`, behind a lock; the functions below
are its methods, bound once.

Known build traps (seen on an H200 with CUDA 13, deep_gemm 1.0):

- as shipped, 1.0 does not compile under CUDA 13: ``PFN_cuTensorMapEncodeTiled`` is undefined
  there (CUDA 13 names it ``PFN_cuTensorMapEncodeTiled_v12000``). 1.0 reads its compiler from
  ``DG_NVCC_COMPILER`` (later versions: ``DG_JIT_NVCC_COMPILER``); point it at an nvcc wrapper
  that adds ``-DPFN_cuTensorMapEncodeTiled=PFN_cuTensorMapEncodeTiled_v12000``. :func:`status`
  reports 1.0 under CUDA 13 without such a compiler as not usable, and says this.
- 1.0 cannot build some shapes (``static assertion failed with "Misaligned barriers"`` when its
  heuristic picks a BLOCK_N that divides 128 and K/128 is odd: K=128, or an intermediate size of
  384 for GEMM2). :func:`grouped_gemm_contiguous` turns such a build failure into
  BackendUnavailableError and remembers the shape, so that it is never compiled again in this
  process; :func:`build_failure` says whether a shape is known to fail. A shape is one GEMM's
  ``(N, K)``: a layer whose GEMM2 cannot be built keeps running GEMM1 on deep_gemm.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from moekit.errors import BackendUnavailableError, InvalidInputError

_APIS = {  # api -> its grouped contiguous GEMM (v2 kept 1.0 names for other functions only)
    "v2": "m_grouped_fp8_gemm_nt_contiguous",
    "1.0": "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
}
_KNOWN_GEMMS = ", ".join(_APIS.values())
_HEADER_DIRS = ("deep_gemm", "cute", "cutlass")


@dataclass(frozen=True)
class DeepGemmStatus:
    """Whether deep_gemm can run here; ``reason`` says why not (or what was found)."""

    usable: bool
    reason: str
    api: str | None = None


def detect_api(module: object) -> str | None:
    """``"v2"``, ``"1.0"`` or None: which known contiguous-GEMM API ``module`` exposes."""
    return next((api for api, gemm in _APIS.items() if callable(getattr(module, gemm, None))), None)


@dataclass
class _Routing:
    """Where deep_gemm calls go: a probed (or given) status and module, and the GEMM shapes ``(N, K)``
    that failed to build there (-> why)."""

    status: DeepGemmStatus
    module: ModuleType | None
    failures: dict[tuple[int, int], str] = field(default_factory=dict)


def _no(reason: str) -> _Routing:
    return _Routing(DeepGemmStatus(False, reason), None)


def _probe() -> _Routing:
    try:
        spec = importlib.util.find_spec("deep_gemm")
    except (ImportError, ValueError) as e:
        return _no(f"deep_gemm cannot be located: {e}")
    if spec is None:
        return _no("deep_gemm is not installed (moekit uses its Triton contiguous GEMM)")
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        return _no(f"deep_gemm at {spec.origin} is not a package")
    package_dir = Path(locations[0])
    include = package_dir / "include"
    missing = [d for d in _HEADER_DIRS if not (include / d).is_dir()]
    if not missing and not any((include / "deep_gemm").rglob("*.cuh")):
        missing = ["deep_gemm/*.cuh"]
    if missing:
        return _no(
            f"deep_gemm at {package_dir} has no JIT headers ({', '.join(str(include / m) for m in missing)} "
            "missing), so it cannot compile its kernels; the PyPI deep-gemm==1.0.0 wheel is such a build. "
            "Install DeepGEMM from its source tree (with its cutlass submodule) instead"
        )

    from moekit import device

    if device.get_device().type != "cuda":
        return _no("no CUDA device: moekit runs on the CPU (Triton interpreter)")
    major, minor = torch.cuda.get_device_capability()
    gpu = torch.cuda.get_device_name()
    if major != 9:
        return _no(f"needs a Hopper GPU (compute capability 9.x), got {major}.{minor} ({gpu})")
    try:
        module = importlib.import_module("deep_gemm")
    except Exception as e:  # a broken install raises anything (ImportError, AssertionError, OSError...)
        return _no(f"import deep_gemm failed: {type(e).__name__}: {e}")
    api = detect_api(module)
    if api is None:
        return _no(f"deep_gemm has none of the known contiguous GEMMs ({_KNOWN_GEMMS})")
    missing_tool = jit_problem(api)
    if missing_tool:
        return _no(missing_tool)
    version = getattr(module, "__version__", "unknown version")
    return _Routing(DeepGemmStatus(True, f"deep_gemm {version} ({api} API) on {gpu}", api), module)


_COMPILER_ENV = {"1.0": "DG_NVCC_COMPILER", "v2": "DG_JIT_NVCC_COMPILER"}  # what each API reads


def jit_problem(api: str = "v2") -> str | None:
    """What stops deep_gemm's JIT here, or None. It compiles its kernels with nvcc and names them
    with cuobjdump, both from CUDA_HOME; without them the import works but the first GEMM fails
    (an os.path.join(None) TypeError in 1.0), so :func:`status` checks this, where the reason can
    be reported. 1.0 also cannot compile under CUDA 13 as shipped (see the module docstring)."""
    import os
    import shutil

    env = _COMPILER_ENV[api]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.environ.get(env) or (home and os.path.join(home, "bin", "nvcc")) or shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return f"deep_gemm needs nvcc for its JIT: set CUDA_HOME (or {env})"
    cuobjdump = os.path.join(os.path.dirname(nvcc), "cuobjdump")
    if not os.path.exists(cuobjdump) and not shutil.which("cuobjdump"):
        return f"deep_gemm needs cuobjdump beside {nvcc} for its JIT"
    cuda_major = int((torch.version.cuda or "0").split(".")[0])
    if api == "1.0" and not os.environ.get(env) and cuda_major >= 13:
        return (
            "deep_gemm 1.0 does not compile under CUDA 13 as shipped (PFN_cuTensorMapEncodeTiled is named "
            "PFN_cuTensorMapEncodeTiled_v12000 there): set DG_NVCC_COMPILER to an nvcc wrapper that adds "
            "-DPFN_cuTensorMapEncodeTiled=PFN_cuTensorMapEncodeTiled_v12000"
        )
    return None


class DeepGemmBackend:
    """What this process knows about deep_gemm; every method is thread-safe.

    - the probe of the machine (:func:`status`), made once, on first use;
    - the GEMM shapes that deep_gemm failed to build, each remembered so that it is never compiled
      twice (:meth:`grouped_gemm_contiguous` records them, :meth:`build_failure` reads them);
    - :meth:`use` blocks, which route every call to a given module (with their own remembered
      failures) until they end. They are process-wide, as the real module is: another thread's
      calls meanwhile go there too. Blocks may nest or overlap across threads; each one's end
      removes its own routing, whatever the order.
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._probed: _Routing | None = None
        self._given: list[_Routing] = []  # use() blocks, innermost last

    def _routing(self) -> _Routing:
        with self._lock:
            if self._given:
                return self._given[-1]
            if self._probed is None:
                try:
                    self._probed = _probe()
                except Exception as e:  # status() must never raise
                    self._probed = _no(f"detection failed: {type(e).__name__}: {e}")
            return self._probed

    def status(self, *, refresh: bool = False) -> DeepGemmStatus:
        """Whether a usable deep_gemm is installed here (cached; ``refresh=True`` probes again and
        forgets the shapes that failed to build; a :meth:`use` block in force stays in force)."""
        if not isinstance(refresh, bool):  # not validate.check_flag: the checks are counted per forward
            raise InvalidInputError(f"refresh must be True or False, got {refresh!r}")
        with self._lock:
            if refresh:
                self._probed = None
            return self._routing().status

    @contextlib.contextmanager
    def use(self, module: object, *, reason: str = "given by moekit.backends.deep_gemm.use"):
        """Route every deep_gemm call to ``module`` inside the block (a stub in tests, or a build
        that is not on the import path), with no shape known to fail; the routing before it comes
        back after it. ``module`` must expose one of the known APIs.

        Raises:
            BackendUnavailableError: ``module`` has neither API.
        """
        api = detect_api(module)
        if api is None:
            raise BackendUnavailableError(f"{module!r} exposes none of the known contiguous GEMMs ({_KNOWN_GEMMS})")
        mine = _Routing(DeepGemmStatus(True, reason, api), module)
        with self._lock:
            self._given.append(mine)
        try:
            yield
        finally:
            with self._lock:
                self._given = [r for r in self._given if r is not mine]

    def build_failure(self, N: int, K: int) -> str | None:
        """Why deep_gemm could not build its GEMM for ``[*, K] x [N, K]^T`` here, or None (not known to fail)."""
        with self._lock:
            return self._routing().failures.get((int(N), int(K)))

    def module(self) -> tuple[ModuleType, str]:
        """The module calls go to and its API; BackendUnavailableError (with the reason) when unusable."""
        return _usable(self._routing())

    def grouped_gemm_contiguous(self, a, a_scale, b, b_scale, out, m_indices) -> torch.Tensor:
        """``out[r] = (a[r] * a_scale[r]) @ (b[m_indices[r]] * b_scale[m_indices[r]]).T`` by deep_gemm.

        Args:
            a: fp8 ``[M_sum, K]``, rows grouped by expert, each group padded to 128 rows.
            a_scale: fp32 ``[M_sum, K/128]``, column-major storage (rows padded to a multiple of 4).
            b: fp8 ``[E, N, K]``. b_scale: fp32 ``[E, N/128, K/128]``.
            out: bf16 ``[M_sum, N]``, written in place and returned.
            m_indices: int32 ``[M_sum]``, the expert of every row; constant over each 128-row block
                and never -1 (1.0 reads out of bounds on a block whose first row is -1).

        Raises:
            BackendUnavailableError: deep_gemm cannot run here, or cannot build a kernel for this
                shape (the message says why; the shape is remembered and never compiled again).
        """
        routing = self._routing()  # one routing for the whole call, even if a use() block ends meanwhile
        module, api = _usable(routing)
        N, K = int(b.shape[1]), int(b.shape[2])
        with self._lock:
            known = routing.failures.get((N, K))
        if known is not None:
            raise BackendUnavailableError(known)
        try:
            getattr(module, _APIS[api])((a, a_scale), (b, b_scale), out, m_indices)
        except Exception as e:
            if not _is_build_failure(e):
                raise
            first = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
            why = f"deep_gemm cannot build its GEMM for N={N}, K={K} here ({type(e).__name__}: {first})"
            with self._lock:
                routing.failures[(N, K)] = why
            raise BackendUnavailableError(why) from e
        return out


def _usable(routing: _Routing) -> tuple[ModuleType, str]:
    if not routing.status.usable:  # a usable status always comes with its module and API
        raise BackendUnavailableError(f"deep_gemm is not usable here: {routing.status.reason}")
    return routing.module, routing.status.api


BACKEND = DeepGemmBackend()  # this process's deep_gemm
status = BACKEND.status
use = BACKEND.use
build_failure = BACKEND.build_failure
grouped_gemm_contiguous = BACKEND.grouped_gemm_contiguous


_BUILD_ERROR = re.compile(r"nvcc|compil|static assert|Misaligned barriers|ptxas", re.IGNORECASE)


def _is_build_failure(e: BaseException) -> bool:
    return isinstance(e, subprocess.CalledProcessError) or (
        isinstance(e, RuntimeError | AssertionError) and bool(_BUILD_ERROR.search(str(e)))
    )
