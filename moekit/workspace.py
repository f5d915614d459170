"""Workspace memory: one growable pool, reused by every chunk and every layer that shares it.

``take(shapes)`` returns workspace13 and workspace2 as flat 1-D buffers of the declared dtype,
``prod(shape)`` elements each, carved from one byte buffer; the experts carve their caches out
of their first elements. The pool grows only when a request does not fit (counted in
``grows``), so after the first, largest chunk no chunk allocates. ``peak_bytes`` is the most it
was ever asked for: it scales with the chunk size C, not with M.

A pool serves one forward at a time. ``ModularKernel`` holds :attr:`WorkspacePool.lock` for
the whole experts pass, so two threads that share a kernel (or a pool) take turns instead of
writing into each other's buffers. On a GPU the buffer may still be in use by kernels queued on
another stream, so a take from a different stream first makes the current stream wait for the
previous one.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from moekit.types import WorkspaceShapes

_ALIGN = 256  # bytes; keeps workspace2 aligned for vector loads and TMA


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass
class WorkspaceBuffers:
    """The two flat workspaces of one chunk (1-D, the declared dtype, at least the declared sizes)."""

    workspace13: torch.Tensor
    workspace2: torch.Tensor


class WorkspacePool:
    """Byte buffers that grow on demand and hand out typed flat views of themselves.

    Two buffers: the chunks' workspaces (:meth:`take`) and the experts' whole-batch output
    (:meth:`output`), which finalize reads. The views handed out for a shape are kept and handed
    out again for the same shape (a torch view costs microseconds of host time), until the buffer
    grows. The pool pickles (and deep-copies) as an empty pool on the same device.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.lock = threading.RLock()
        self.grows = 0
        self.requests = 0
        self.peak_bytes = 0
        self._reset()

    def _reset(self) -> None:
        empty = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._buffer, self._out = empty, empty
        self._views: dict[WorkspaceShapes, WorkspaceBuffers] = {}
        self._out_views: dict[tuple, torch.Tensor] = {}
        self._stream = None

    def __getstate__(self) -> dict:
        return {"device": self.device, "grows": self.grows, "requests": self.requests, "peak_bytes": self.peak_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()
        self._reset()

    def take(self, shapes: WorkspaceShapes) -> WorkspaceBuffers:
        """Flat workspace13 and workspace2 for ``shapes``; grows the pool if needed."""
        self.requests += 1
        views = self._views.get(shapes)
        if views is not None:
            return views
        item = shapes.itemsize
        n13, n2 = math.prod(shapes.workspace13), math.prod(shapes.workspace2)
        off2 = _round_up(n13 * item, _ALIGN)
        need = off2 + n2 * item
        self.peak_bytes = max(self.peak_bytes, need)
        if need > self._buffer.numel():
            # Drop the old buffer first so the peak is the new size, not old + new.
            self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._buffer = torch.empty(need, dtype=torch.uint8, device=self.device)
            self._views.clear()
            self.grows += 1
        raw = self._buffer
        views = WorkspaceBuffers(raw[: n13 * item].view(shapes.dtype), raw[off2 : off2 + n2 * item].view(shapes.dtype))
        if len(self._views) > 64:
            self._views.clear()
        self._views[shapes] = views
        return views

    def output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A ``shape`` tensor of ``dtype`` for the experts' whole-batch output (uninitialized)."""
        key = (shape, dtype)
        view = self._out_views.get(key)
        if view is not None:
            return view
        need = math.prod(shape) * dtype.itemsize
        if need > self._out.numel():
            self._out = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._out = torch.empty(need, dtype=torch.uint8, device=self.device)
            self._out_views.clear()
        view = self._out[:need].view(dtype).view(shape)
        if len(self._out_views) > 64:
            self._out_views.clear()
        self._out_views[key] = view
        return view

    def follow(self, stream: tuple[int, int] | None) -> None:
        """Before a forward on ``stream`` (``moekit.kernels.launch.launch_stream``): if the pool was last
        used on another stream, the new one waits for the old one (its kernels may still read the buffers)."""
        if stream is None or stream == self._stream:
            return
        if self._stream is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_stream(self._last)
        self._stream, self._last = stream, torch.cuda.current_stream(self.device)

    def release(self) -> None:
        """Free the memory (the next take allocates again)."""
        self._reset()


_POOLS: dict[str, WorkspacePool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(device: torch.device | str) -> WorkspacePool:
    """The process-wide pool of ``device``, shared by the kernels that ask for it (layers)."""
    key = str(torch.device(device))
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = WorkspacePool(device)
        return _POOLS[key]
