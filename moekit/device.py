"""Where kernels run: a CUDA GPU when one is present, else Triton's interpreter on the CPU.

This is the one place that reads or sets ``TRITON_INTERPRET``. Triton decides between compiling
and interpreting when ``@triton.jit`` decorates a function, so the switch must be set before any
kernel module is imported. ``moekit/__init__.py`` imports this module first for that reason.
The switch is read as Triton reads it (:func:`env_flag`): ``TRITON_INTERPRET=false`` is off for
both.

Set ``MOEKIT_DEVICE=cpu`` to force the interpreter on a machine that has a GPU.

Under the interpreter, importing moekit also:

- warns about Triton < 3.7 with numpy >= 2.4: that interpreter crashes on every kernel with a
  loop bounded at run time ("only 0-dimensional arrays can be converted to Python scalars"); a
  moekit launch that meets the crash raises BackendUnavailableError with the advice
  (:func:`interpreter_advice`, read by the Hopper wing's launcher);
- makes interpreted launches take turns, process-wide (:func:`_serialize_interpreted_launches`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import re
import sys
import threading
import warnings

# What Triton's getenv_bool (knobs.runtime.interpret) takes for "on", compared in lower case; any
# other value that is set, "" and "false" among them, is off. Checked against Triton's own reader
# in tests/test_device.py.
_TRUTHY = ("1", "true", "on", "yes", "y")


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is on, as Triton reads its boolean knobs
    (``TRITON_INTERPRET``): ``1``, ``true``, ``on``, ``yes`` or ``y`` in any case; unset is off."""
    return os.environ.get(name, "").lower() in _TRUTHY


# Was Triton imported (by transformers, say) before the switch below could be set? Then Triton's
# own helpers (tl.zeros_like & co.) were built for a GPU, and kernels fail in the interpreter.
_TRITON_FIRST = "triton.language" in sys.modules and not env_flag("TRITON_INTERPRET")

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
_INTERPRETING: bool = env_flag("TRITON_INTERPRET")
_DEVICE: torch.device = torch.device("cuda") if _HAS_CUDA and not _INTERPRETING else torch.device("cpu")


def _release(package: str) -> tuple[int, int] | None:
    """(major, minor) of an installed package, or None when its metadata cannot be read."""
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found[1]), int(found[2])) if found else None


def interpreter_advice(triton: tuple[int, int] | None = None, numpy: tuple[int, int] | None = None) -> str | None:
    """What to install instead, for a Triton interpreter known to crash with this numpy; else None.

    Triton < 3.7 with numpy >= 2.4 (seen with triton 3.6.0 and numpy 2.4.0 / 2.4.6, December 2026):
    a loop bounded at run time (``for i in range(tl.cdiv(n, BLOCK))``) fails inside the interpreter.
    ``triton``/``numpy`` default to the installed versions (read from their metadata).
    """
    triton = _release("triton") if triton is None else triton
    numpy = _release("numpy") if numpy is None else numpy
    if triton is None or numpy is None or not (triton < (3, 7) and numpy >= (2, 4)):
        return None
    return (
        f"Triton {triton[0]}.{triton[1]}'s interpreter crashes with numpy {numpy[0]}.{numpy[1]} on moekit's "
        "kernels (a loop bounded at run time: 'only 0-dimensional arrays can be converted to Python "
        "scalars'); install triton >= 3.7 or numpy < 2.4"
    )


def _sanitizing_in_vain(options) -> bool:
    """Whether the interpreter would check every int32 add, sub and mul for overflow without acting on it.

    Triton's interpreter (3.6 to 3.9) runs with ``sanitize_overflow=True`` and ``debug=False``: each
    such op is then redone in int64 and compared against the int32 range, and the resulting
    ``device_assert`` is dropped, because asserts only run with ``debug``. That work took about a
    third of an interpreted grouped GEMM's time (cProfile, December 2026). So moekit's launch wrapper
    turns the check off for the launch, and back on after it, exactly when it could not fire.
    """
    return (
        dataclasses.is_dataclass(options)
        and getattr(options, "sanitize_overflow", False) is True
        and getattr(options, "debug", True) is False
    )


def _patch_lang_once(patch_lang, scope_type, langs: tuple):
    """Triton's ``_patch_lang`` for one launch, that patches each ``triton.language`` module once.

    The interpreter swaps the language's functions for interpreted ones when a launch starts (and
    restores them at its end), and again at every call of a ``@triton.jit`` helper inside the kernel:
    each time it walks the modules with ``inspect.getmembers``, and since the functions it finds are
    already swapped, it swaps nothing new (Triton 3.6 to 3.9). moekit's kernels call small helpers
    in their loops (``_tile``, ``_mma``, the align's steps), and that walk took about a third of an
    interpreted grouped GEMM (cProfile, December 2026). Here a helper whose modules this launch has
    patched already gets an empty patch; the launch's own patch, and its restore, are Triton's.
    """
    patched: list = []

    def patch(fn):
        mods = [m for m in fn.__globals__.values() if any(m is lang for lang in langs)]
        if mods and all(any(m is p for p in patched) for m in mods):
            return scope_type()
        patched.extend(mods)
        return patch_lang(fn)

    return patch


def _serialize_interpreted_launches() -> None:
    """Triton's interpreter is not thread-safe: while a kernel runs it swaps ``triton.language``
    functions for interpreted ones and keeps the program id in one global builder, so two threads
    launching kernels at once break each other ("Did you forget to add @triton.jit?"). One lock
    around every interpreted launch makes them take turns, as launches on one GPU stream do.

    Why process-wide, and not only around moekit's own launches: the state the interpreter swaps is
    the process's, so a launch of anyone's kernel in another thread (a learner's in the workbook,
    another library's) breaks a moekit launch running beside it, and the other way round. Taking
    turns costs nothing the interpreter could have done in parallel, and changes no result. The
    patch is made once (``_moekit_serialized``), only under the interpreter, and keeps Triton's own
    call as ``__wrapped__``. Tested in tests/test_device.py with a kernel that is not moekit's.
    Inside the lock the same wrapper skips the overflow check that cannot fire (:func:`_sanitizing_in_vain`)
    and the language patches that change nothing (:func:`_patch_lang_once`): interpreted forwards
    2-3x faster, the same results.
    """
    from triton.runtime import interpreter

    executor = interpreter.GridExecutor
    if getattr(executor.__call__, "_moekit_serialized", False):
        return
    original, lock = executor.__call__, threading.RLock()
    builder = getattr(interpreter, "interpreter_builder", None)

    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    lang = getattr(interpreter, "tl", None)
    once = patch_lang is not None and scope_type is not None and lang is not None

    def call(self, *args, **kwargs):
        with lock:
            options = getattr(builder, "options", None)
            sanitize_off = _sanitizing_in_vain(options)
            if sanitize_off:
                builder.options = dataclasses.replace(options, sanitize_overflow=False)
            if once:
                interpreter._patch_lang = _patch_lang_once(patch_lang, scope_type, (lang, lang.core))
            try:
                return original(self, *args, **kwargs)
            finally:
                if once:
                    interpreter._patch_lang = patch_lang
                if sanitize_off:
                    builder.options = options

    call._moekit_serialized = True
    call.__wrapped__ = original
    executor.__call__ = call


INTERPRETER_ADVICE: str | None = interpreter_advice() if _INTERPRETING else None
if INTERPRETER_ADVICE:  # a warning, not an error: kernels without such a loop still run
    warnings.warn(INTERPRETER_ADVICE, RuntimeWarning, stacklevel=2)
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


def has_tma(device: torch.device | None = None) -> bool:
    """True when ``device`` (default: the current CUDA device) has the tensor-memory accelerator that
    TMA descriptors need: compute capability 9.0 (Hopper) or later. False under the interpreter."""
    if _INTERPRETING or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return _capability_major(index) >= 9


def is_hopper(device: torch.device | None = None) -> bool:
    """True on a compute capability 9.x GPU (an H100 or H200), where the wing's kernels
    are the default. False under the interpreter."""
    if _INTERPRETING or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return _capability_major(index) == 9


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]
