"""Where kernels run: a CUDA GPU when one is present, else Triton's interpreter on the CPU.

This is the one place that reads or sets ``TRITON_INTERPRET``. Triton decides between compiling
and interpreting when ``@triton.jit`` decorates a function, so the switch must be set before any
kernel module is imported. ``moekit/__init__.py`` imports this module first for that reason.

Set ``MOEKIT_DEVICE=cpu`` to force the interpreter on a machine that has a GPU.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

# Was Triton imported (by transformers, say) before the switch below could be set? Then Triton's
# own helpers (tl.zeros_like & co.) were built for a GPU, and kernels fail in the interpreter.
_TRITON_FIRST = "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

import torch  # noqa: E402

_FORCED = os.environ.get("MOEKIT_DEVICE", "").strip().lower()
_HAS_CUDA = torch.cuda.is_available() and _FORCED != "cpu"

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if _TRITON_FIRST:
        warnings.warn(
            "triton was imported before moekit on a machine without a GPU, so Triton's interpreter "
            "could not be switched on in time and moekit's kernels will fail. Import moekit first "
            "(before transformers, vllm or triton).",
            RuntimeWarning,
            stacklevel=2,
        )

INTERPRETING: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE: torch.device = torch.device("cuda") if _HAS_CUDA and not INTERPRETING else torch.device("cpu")


def check_import_order() -> None:
    """Raise BackendUnavailableError if Triton was imported before moekit on a CPU machine.

    Then Triton's own library (``tl.sum``, ``tl.zeros_like``...) was built for a GPU, and every
    moekit kernel fails inside the interpreter with a cryptic error.
    """
    if not INTERPRETING:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.zeros_like, InterpretedFunction):
        from moekit.errors import BackendUnavailableError

        raise BackendUnavailableError(
            "triton was imported before moekit, so its interpreter switch (TRITON_INTERPRET=1) came "
            "too late: import moekit before transformers, vllm or triton."
        )


def get_device() -> torch.device:
    """The device moekit's kernels run on: ``cuda`` or ``cpu`` (interpreter)."""
    return DEVICE


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors)."""
    return INTERPRETING


def is_hopper() -> bool:
    """True on a compute-capability 9.x GPU (H100, H200)."""
    return DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] == 9


@dataclass(frozen=True)
class Info:
    """What ``moekit info`` prints."""

    torch: str
    triton: str
    numpy: str
    device: str
    interpreter: bool
    deep_gemm_usable: bool
    deep_gemm_reason: str

    def lines(self) -> list[str]:
        dg = "usable" if self.deep_gemm_usable else f"not usable ({self.deep_gemm_reason})"
        return [
            f"torch       {self.torch}",
            f"triton      {self.triton}",
            f"numpy       {self.numpy}",
            f"device      {self.device}",
            f"interpreter {'on (TRITON_INTERPRET=1)' if self.interpreter else 'off'}",
            f"deep_gemm   {dg}",
        ]


def info() -> Info:
    """Versions, the device, the interpreter switch, and whether deep_gemm can run."""
    import numpy
    import triton

    from moekit.backends import deep_gemm

    status = deep_gemm.status()
    if DEVICE.type == "cuda":
        name = f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    else:
        name = "cpu (Triton interpreter)"
    return Info(
        torch=torch.__version__,
        triton=triton.__version__,
        numpy=numpy.__version__,
        device=name,
        interpreter=INTERPRETING,
        deep_gemm_usable=status.usable,
        deep_gemm_reason=status.reason,
    )
