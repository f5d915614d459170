"""Workspace memory: one growable pool per device, reused by every chunk and every layer.

``take(shapes)`` returns workspace13 and workspace2 viewed to the declared shapes. The pool
grows only when a request does not fit (counted in ``grows``), so after the first, largest
chunk no chunk allocates. ``peak_bytes`` is the most it ever held: it scales with the chunk
size C, not with M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moekit.types import WorkspaceShapes

_ALIGN = 256  # bytes; keeps workspace2 aligned for vector loads and TMA


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass
class WorkspaceViews:
    """The two workspaces of one chunk, already viewed to their declared shapes."""

    workspace13: torch.Tensor
    workspace2: torch.Tensor


class WorkspacePool:
    """A byte buffer that grows on demand and hands out typed views of it."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.grows = 0
        self.requests = 0
        self.peak_bytes = 0

    @property
    def capacity_bytes(self) -> int:
        return self._buffer.numel()

    def take(self, shapes: WorkspaceShapes) -> WorkspaceViews:
        """Views of workspace13 and workspace2 for ``shapes``; grows the pool if needed."""
        item = shapes.itemsize
        n13 = math.prod(shapes.workspace13) * item
        off2 = _round_up(n13, _ALIGN)
        n2 = math.prod(shapes.workspace2) * item
        need = off2 + n2
        self.requests += 1
        self.peak_bytes = max(self.peak_bytes, need)
        if need > self._buffer.numel():
            # Drop the old buffer first so the peak is the new size, not old + new.
            self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._buffer = torch.empty(need, dtype=torch.uint8, device=self.device)
            self.grows += 1
        ws13 = self._buffer[:n13].view(shapes.dtype).view(shapes.workspace13)
        ws2 = self._buffer[off2 : off2 + n2].view(shapes.dtype).view(shapes.workspace2)
        return WorkspaceViews(ws13, ws2)

    def reset_stats(self) -> None:
        self.grows = self.requests = self.peak_bytes = 0

    def release(self) -> None:
        """Free the memory (the next take allocates again)."""
        self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)


_POOLS: dict[str, WorkspacePool] = {}


def shared_pool(device: torch.device | str) -> WorkspacePool:
    """The process-wide pool of ``device``, shared by all modular kernels (layers)."""
    key = str(torch.device(device))
    if key not in _POOLS:
        _POOLS[key] = WorkspacePool(device)
    return _POOLS[key]


# The pre-fix policy (workspace_policy='once'): buffers declared once, for the first chunk.
def fits_leading_rows(own: WorkspaceShapes, once: WorkspaceShapes) -> bool:
    """Whether ``own`` is a leading-rows slice of ``once`` (same layout and dtype, no more rows)."""
    if own.dtype != once.dtype:
        return False
    pairs = ((own.workspace13, once.workspace13), (own.workspace2, once.workspace2))
    return all(len(a) == len(b) and (not a or (a[1:] == b[1:] and a[0] <= b[0])) for a, b in pairs)


def leading_rows(views: WorkspaceViews, own: WorkspaceShapes) -> WorkspaceViews:
    """The first rows of each workspace, as many as ``own`` declares (upstream's prefix views)."""
    return WorkspaceViews(views.workspace13[: own.workspace13[0]], views.workspace2[: own.workspace2[0]])


def once_mismatch_message(experts, r, once: WorkspaceShapes, own: WorkspaceShapes, sub) -> str:
    """What the guard says when a chunk's own shapes do not fit the ones declared once."""
    return (
        f"workspace_policy='once': {experts.name} declared its workspaces once, for the first chunk, "
        f"as workspace13={once.workspace13}, workspace2={once.workspace2}, output={once.output} "
        f"({once.dtype}). Chunk {r.index} (tokens [{r.start}, {r.end}), M={sub.M}) runs backend "
        f"'{experts.backend_for(sub)}', which needs workspace13={own.workspace13}, "
        f"workspace2={own.workspace2}, output={own.output}. This is bug 1 of vLLM PR #20392: "
        "a dispatching experts class may change backend between chunks, so workspace shapes "
        "must be computed per chunk (workspace_policy='per_chunk')."
    )
