"""Where kernels run: a CUDA GPU when one is present, else Triton's interpreter on the CPU.

This is the one place that reads or sets ``TRITON_INTERPRET``. Triton decides between compiling
and interpreting when ``@triton.jit`` decorates a function, so the switch must be set before any
kernel module is imported. ``moekit/__init__.py`` imports this module first for that reason.

Set ``MOEKIT_DEVICE=cpu`` to force the interpreter on a machine that has a GPU.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

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

# Decided once, here; read through get_device() and interpreting().
_INTERPRETING: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_DEVICE: torch.device = torch.device("cuda") if _HAS_CUDA and not _INTERPRETING else torch.device("cpu")


def _serialize_interpreted_launches() -> None:
    """Triton's interpreter is not thread-safe: while a kernel runs it swaps ``triton.language``
    functions for interpreted ones and keeps the program id in one global builder, so two threads
    launching kernels at once break each other ("Did you forget to add @triton.jit?"). One lock
    around every interpreted launch makes them take turns, as launches on one GPU stream do."""
    from triton.runtime import interpreter

    executor = interpreter.GridExecutor
    if getattr(executor.__call__, "_moekit_serialized", False):
        return
    original, lock = executor.__call__, threading.RLock()

    def call(self, *args, **kwargs):
        with lock:
            return original(self, *args, **kwargs)

    call._moekit_serialized = True
    executor.__call__ = call


if _INTERPRETING:
    _serialize_interpreted_launches()


def check_import_order() -> None:
    """Raise BackendUnavailableError if Triton was imported before moekit on a CPU machine.

    Then Triton's own library (``tl.sum``, ``tl.zeros_like``...) was built for a GPU, and every
    moekit kernel fails inside the interpreter with a cryptic error.
    """
    if not _INTERPRETING:
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
    return _DEVICE


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors)."""
    return _INTERPRETING
