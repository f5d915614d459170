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

from moekit import lazy_attributes

# Every public name, and the module that defines it, imported on first use (as `moekit`'s own
# table does): `moekit.viz.X` and `from moekit.viz import X` both work.
_LAZY = {
    "axes_or_new": "moekit.viz._figure",
    "new_axes": "moekit.viz._figure",
    "chunk_counts": "moekit.viz.chunks",
    "expert_weight_bytes": "moekit.viz.chunks",
    "plot_counts_heatmap": "moekit.viz.chunks",
    "plot_counts_vs_whole": "moekit.viz.chunks",
    "plot_stacked_chunks": "moekit.viz.chunks",
    "plot_tokens_per_expert": "moekit.viz.chunks",
    "plot_weight_bytes": "moekit.viz.chunks",
    "plot_workspace_bytes": "moekit.viz.chunks",
    "weight_bytes_read": "moekit.viz.chunks",
    "plot_data_flow": "moekit.viz.flow",
    "chunks_per_expert": "moekit.viz.rows",
    "expert_segments": "moekit.viz.rows",
    "plot_chunks_per_expert": "moekit.viz.rows",
    "plot_sorted_rows": "moekit.viz.rows",
    "plot_weight_bytes_per_chunk": "moekit.viz.rows",
    "row_chunk_counts": "moekit.viz.rows",
    "Table": "moekit.viz.tables",
    "plot_table": "moekit.viz.tables",
    "shape_rows": "moekit.viz.tables",
    "table": "moekit.viz.tables",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [*_LAZY]
