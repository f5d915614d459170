"""Interactive explorers for the notebooks (ipywidgets is imported only when one is built).

- :func:`explorer` (notebook 03): tokens per (chunk, expert) and weight bytes read, against M,
  C, E, topk, router skew and EP size.
- :func:`crash_explorer` (notebook 02): bug 1 live: per chunk, the backend, the buffers the
  pre-fix loop handed it and what it needed, and whether that run crashed.

Each is a pure ``*_view`` function (tested headless) plus a thin widget wrapper.
"""

from moekit.widgets.chunk_explorer import ExplorerParams, ExplorerView, explorer, explorer_view
from moekit.widgets.crash_explorer import CrashParams, CrashView, crash_explorer, crash_view, pre_fix_crashes

__all__ = [
    "CrashParams",
    "CrashView",
    "ExplorerParams",
    "ExplorerView",
    "crash_explorer",
    "crash_view",
    "explorer",
    "explorer_view",
    "pre_fix_crashes",
]
