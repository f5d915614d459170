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

A pool lives on one device. :meth:`WorkspacePool.serves` says whether it can serve a call's
tensors, :meth:`WorkspacePool.check_device` raises InvalidInputError when it cannot (a pool handed
to a kernel is never moved). :data:`SHARED_POOLS` keeps one pool per device for the callers that
share them (``moekit.fused_moe``'s kernels).
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass

import torch

from moekit.errors import InvalidInputError
from moekit.types import WorkspaceShapes

WORKSPACE_ALIGN = 256  # bytes; keeps workspace2 aligned for vector loads and TMA


def pool_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the current GPU (``cuda:0`` and ``cuda`` are one pool)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def pool_bytes(shapes: WorkspaceShapes) -> int:
    """Bytes a pool's :meth:`WorkspacePool.take` needs for ``shapes``: workspace13, then workspace2
    from the next ``WORKSPACE_ALIGN`` boundary."""
    n13, n2, item = math.prod(shapes.workspace13), math.prod(shapes.workspace2), shapes.itemsize
    return -(-n13 * item // WORKSPACE_ALIGN) * WORKSPACE_ALIGN + n2 * item


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
        self.device = pool_device(device)
        self.lock = threading.RLock()
        self.grows = 0
        self.requests = 0
        self.peak_bytes = 0
        self._depth = 0  # forwards inside borrowed() now, by the thread holding the lock
        self._reset()

    @contextlib.contextmanager
    def borrowed(self):
        """This pool for one forward, behind its lock (threads take turns). A forward started inside
        another one on the same pool, by the same thread (an experts class or a hook that calls
        moekit), gets a pool of its own: it must not be handed the outer forward's output and
        workspaces, which that forward is still writing."""
        with self.lock:
            nested, self._depth = self._depth > 0, self._depth + 1
            try:
                yield WorkspacePool(self.device) if nested else self
            finally:
                self._depth -= 1

    def _reset(self) -> None:
        empty = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._buffer, self._out = empty, empty
        self._views: dict[WorkspaceShapes, WorkspaceBuffers] = {}
        self._out_views: dict[tuple, torch.Tensor] = {}
        self._last = self._raw = None  # the CUDA stream of the last forward, and its raw handle

    def __getstate__(self) -> dict:
        return {"device": self.device, "grows": self.grows, "requests": self.requests, "peak_bytes": self.peak_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock, self._depth = threading.RLock(), 0
        self._reset()

    @property
    def held_bytes(self) -> int:
        """The bytes its two buffers hold now (each grows, never shrinks, until :meth:`release`)."""
        return self._buffer.numel() + self._out.numel()

    def serves(self, device: torch.device | str) -> bool:
        """Whether this pool's buffers live where ``device``'s tensors do (``cuda`` is the current GPU)."""
        device = torch.device(device)
        return device == self.device or pool_device(device) == self.device

    def check_device(self, device: torch.device | str, *, whose: str = "the workspace pool") -> None:
        """Raise InvalidInputError unless this pool :meth:`serves` ``device``: a kernel would otherwise
        hand the experts buffers on another device than their tensors."""
        if not self.serves(device):
            raise InvalidInputError(
                f"{whose} lives on {self.device}, but this call's tensors are on {device}; give each device its "
                "own pool (moekit.workspace.SHARED_POOLS.get(device), or a WorkspacePool(device))"
            )

    def take(self, shapes: WorkspaceShapes) -> WorkspaceBuffers:
        """Flat workspace13 and workspace2 for ``shapes``; grows the pool if needed."""
        self.requests += 1
        views = self._views.get(shapes)
        if views is not None:
            return views
        item, need = shapes.itemsize, pool_bytes(shapes)
        n13, n2 = math.prod(shapes.workspace13) * item, math.prod(shapes.workspace2) * item  # bytes
        off2 = need - n2  # workspace2 ends the buffer, from an aligned start
        self.peak_bytes = max(self.peak_bytes, need)
        if need > self._buffer.numel():
            # Drop the old buffer first so the peak is the new size, not old + new.
            self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._buffer = torch.empty(need, dtype=torch.uint8, device=self.device)
            self._views.clear()
            self.grows += 1
        raw = self._buffer
        views = WorkspaceBuffers(raw[:n13].view(shapes.dtype), raw[off2:need].view(shapes.dtype))
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

    def follow(self) -> None:
        """Before a forward: if the pool was last used on another CUDA stream, the current stream
        waits for that one first (its kernels may still read the buffers)."""
        if self.device.type != "cuda":
            return
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        raw = torch._C._cuda_getCurrentRawStream(index)  # about 1 us; a torch.cuda.Stream costs 4.6
        if raw == self._raw:
            return
        current = torch.cuda.current_stream(index)
        if self._last is not None and not torch.cuda.is_current_stream_capturing():
            current.wait_stream(self._last)
        self._raw, self._last = raw, current

    def release(self) -> None:
        """Free the memory (the next take allocates again)."""
        self._reset()


class PoolRegistry:
    """One :class:`WorkspacePool` per device, made on first ask; thread-safe.

    It pickles (and deep-copies) as an empty registry: pools are buffers of this process.
    """

    def __init__(self):
        self._pools: dict[torch.device, WorkspacePool] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device | str) -> WorkspacePool:
        """The pool of ``device`` (``cuda`` and the current ``cuda:N`` are one)."""
        key = pool_device(device)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = WorkspacePool(key)
            return pool

    def __len__(self) -> int:
        return len(self._pools)

    def clear(self) -> None:
        """Forget every pool (their memory goes when nobody else holds them)."""
        with self._lock:
            self._pools.clear()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


SHARED_POOLS = PoolRegistry()  # the process's shared pools, one per device


def shared_pool(device: torch.device | str) -> WorkspacePool:
    """The process-wide pool of ``device``, shared by the kernels that ask for it (layers)."""
    return SHARED_POOLS.get(device)
