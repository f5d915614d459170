"""Plots and tables for the notebooks and the walkthrough.

Every ``plot_*`` function draws on ``ax`` when given one, else on a new figure, and returns the
:class:`matplotlib.figure.Figure`. Figures are built with ``matplotlib.figure.Figure`` rather
than pyplot: they render with Agg, so a headless machine needs no backend; they never open a
window; and Jupyter shows a figure once, when it is the value of a cell (or ``display(fig)``).
matplotlib is imported inside the functions, so ``import moekit`` does not need it.

- :mod:`moekit.viz.chunks`: tokens per (chunk, expert), weight bytes read, workspace bytes;
- :mod:`moekit.viz.flow`: one forward's data flow, every chunk a box, from its trace;
- :mod:`moekit.viz.rows`: chunks of expert-sorted rows: the layout strip, rows per (chunk, expert);
- :mod:`moekit.viz.tables`: tables as text, HTML or a figure; tensor shapes at every step.

Recorded GPU benchmark results and clock logs are read and drawn outside the package, by
``benchmarks/results_view`` (on :func:`new_axes` and :func:`axes_or_new`).

The numbers behind the plots (:func:`chunk_counts`, :func:`weight_bytes_read`) are plain torch
and are tested against the count kernel and the trace.
"""

from moekit.viz._figure import axes_or_new, new_axes
from moekit.viz.chunks import (
    chunk_counts,
    expert_weight_bytes,
    plot_counts_heatmap,
    plot_counts_vs_whole,
    plot_stacked_chunks,
    plot_tokens_per_expert,
    plot_weight_bytes,
    plot_workspace_bytes,
    weight_bytes_read,
)
from moekit.viz.flow import plot_data_flow
from moekit.viz.rows import (
    chunks_per_expert,
    expert_segments,
    plot_chunks_per_expert,
    plot_sorted_rows,
    plot_weight_bytes_per_chunk,
    row_chunk_counts,
)
from moekit.viz.tables import Table, plot_table, shape_rows, table

__all__ = [
    "Table",
    "axes_or_new",
    "chunk_counts",
    "chunks_per_expert",
    "expert_segments",
    "expert_weight_bytes",
    "new_axes",
    "plot_chunks_per_expert",
    "plot_counts_heatmap",
    "plot_counts_vs_whole",
    "plot_data_flow",
    "plot_sorted_rows",
    "plot_stacked_chunks",
    "plot_table",
    "plot_tokens_per_expert",
    "plot_weight_bytes",
    "plot_weight_bytes_per_chunk",
    "plot_workspace_bytes",
    "row_chunk_counts",
    "shape_rows",
    "table",
    "weight_bytes_read",
]
