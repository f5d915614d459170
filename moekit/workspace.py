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
    """A byte buffer that grows on demand and hands out typed flat buffers of it."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._stream = None
        self.lock = threading.RLock()
        self.grows = 0
        self.requests = 0
        self.peak_bytes = 0

    def take(self, shapes: WorkspaceShapes) -> WorkspaceBuffers:
        """Flat workspace13 and workspace2 for ``shapes``; grows the pool if needed."""
        item = shapes.itemsize
        n13, n2 = math.prod(shapes.workspace13), math.prod(shapes.workspace2)
        off2 = _round_up(n13 * item, _ALIGN)
        need = off2 + n2 * item
        self.requests += 1
        self.peak_bytes = max(self.peak_bytes, need)
        self._follow_stream()
        if need > self._buffer.numel():
            # Drop the old buffer first so the peak is the new size, not old + new.
            self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._buffer = torch.empty(need, dtype=torch.uint8, device=self.device)
            self.grows += 1
        raw = self._buffer
        ws13 = raw[: n13 * item].view(shapes.dtype)
        ws2 = raw[off2 : off2 + n2 * item].view(shapes.dtype)
        return WorkspaceBuffers(ws13, ws2)

    def _follow_stream(self) -> None:
        if self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream(self.device)
        if self._stream is not None and self._stream != stream:
            stream.wait_stream(self._stream)
        self._stream = stream

    def release(self) -> None:
        """Free the memory (the next take allocates again)."""
        self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)


_POOLS: dict[str, WorkspacePool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(device: torch.device | str) -> WorkspacePool:
    """The process-wide pool of ``device``, shared by the kernels that ask for it (layers)."""
    key = str(torch.device(device))
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = WorkspacePool(device)
        return _POOLS[key]
