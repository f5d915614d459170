"""Programmatic dependent launch (Hopper and later): the next kernel starts while this one ends.

Between two kernels of one stream the GPU normally drains the first grid completely before it
launches the second, so every kernel boundary costs the second's launch, its programs' start
and its prologue on an idle GPU (about a microsecond each, a large share of a decode layer that
takes 30). Launched with the *programmatic stream serialization* attribute (Triton's
``launch_pdl=True``), a kernel may start as soon as every program of the previous kernel has
executed ``griddepcontrol.launch_dependents`` (or exited); it then waits in
``griddepcontrol.wait`` until the previous grid has completed and its memory is visible.

moekit's rule, one line at the top of every kernel launched this way::

    pdl_begin(PDL)      # wait for the previous kernel, then let the next one launch

Nothing touches global memory before the wait, so each kernel's loads and stores still happen
after the previous kernel's have all finished, exactly as without the attribute: only the
launch and the programs' start overlap the previous kernel's tail. A kernel that does not call
``launch_dependents`` (a torch kernel, say) triggers when it completes, so mixing them is safe.
Under a CUDA graph the attribute is captured as a programmatic edge.

Tried and dropped (H200, 2026-12-02, ``benchmarks/gpu_pdl.py``): GEMM2 prefetching its weight rows
into L2 before its wait (inline ``prefetch.global.L2::evict_last``, aimed by the layout that align
wrote two kernels earlier) made the layer slower, not faster: Qwen3 M=1 28.3 -> 33.2 us and M=128
297 -> 349 us as CUDA graphs. The prefetches compete with the weight streams in flight.

On by default where it exists (a CUDA GPU of compute capability 9.0 or more, not the
interpreter); ``MOEKIT_PDL=0`` turns it off for the process, :func:`disabled` for a block (an
A/B benchmark). :class:`moekit.kernels.launch.LeanLauncher` ``(fn, pdl=True)`` passes the
``PDL`` constexpr and the launch option, and keys its variants by them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch
import triton
import triton.language as tl

from moekit.device import interpreting

try:  # Triton 3.6-3.9: inline PTX (3.6) or its own ops (3.9); absent in older releases
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # pragma: no cover - an older Triton: never on
    _HAS_GDC = False

_OFF = contextvars.ContextVar("moekit_pdl_off", default=False)


@functools.cache
def supported(device_index: int) -> bool:
    """Whether kernels on CUDA device ``device_index`` can use it (asked once per device)."""
    if not _HAS_GDC or interpreting() or os.environ.get("MOEKIT_PDL", "1").strip() == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def active(device_index: int | None) -> bool:
    """Whether the next launch on ``device_index`` (None: the interpreter) uses it."""
    return device_index is not None and not _OFF.get() and supported(device_index)


@contextlib.contextmanager
def disabled():
    """Launch without it inside this block (this thread or task only)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """The top of a kernel launched with ``launch_pdl``: wait, then allow the next kernel to launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


__all__ = ["active", "disabled", "pdl_begin", "supported"]
