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
launch and the programs' start overlap the previous kernel's tail.

The grouped GEMM's persistent walk (``moekit.hopper.grouped_gemm``, the large-M tiles) is launched
without it.
With it, that kernel alone ran 7-11% slower in the profiler (Qwen3 M=16384 with the fused
activation, 2.00-2.03 -> 2.17-2.24 ms) whether it let the next kernel launch at its start or only
at its exit, and the layer with the fused activation up to 7% slower at M = 4096-32768; launched
plainly, the layer was back within 1% of no PDL at all (``benchmarks/research/gpu_pdl.py``, H200,
2026-12-02). The kernels after it still carry the attribute: a kernel that never triggers lets the
next one launch when it exits.

``TritonExperts`` uses it for chunks of up to :data:`MAX_ROWS` (token, slot) rows. Same-run A/B on
the H200 (Qwen3-30B-A3B bf16, 2026-12-02, five rounds each): as CUDA graphs M=1 31.0 -> 27.5 us
(28.0 with the fused activation, from 29.1), M=8 135.5 -> 132.7, M=128 305.3 -> 301.8 (301.7 ->
297.6 fused); eager M=128 360.8 -> 348.8 and M=4096 845 -> 814 us. Above that the kernels are long
and the board runs at its power cap: M=16384 was level and M=32768 2-4% slower in three runs out
of three, so larger chunks launch without it.

On by default where it exists (a CUDA GPU of compute capability 9.0 or more, not the
interpreter); ``MOEKIT_PDL=0`` turns it off for the process, :func:`disabled` for a block (an
A/B benchmark). :class:`moekit.hopper.launch.LeanLauncher` ``(fn, pdl=True)`` passes the
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
MAX_ROWS = 32768  # TritonExperts: chunks of more (token, slot) rows launch without it (Qwen3 M=4096 has 32768)


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


__all__ = ["MAX_ROWS", "active", "disabled", "pdl_begin", "supported"]
