"""Figure plumbing shared by the plots: new figures without pyplot, Jupyter display, colours, ticks."""

from __future__ import annotations

import functools
import sys

import torch


def new_axes(ncols: int = 1, *, nrows: int = 1, width: float = 5.0, height: float = 3.6):
    """A new figure with ``nrows x ncols`` axes; returns ``(fig, axes)`` (a flat list).

    ``width`` and ``height`` are per panel, in inches.
    """
    from matplotlib.figure import Figure

    _show_figures_in_ipython()
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    return fig, list(axes)


def _show_figures_in_ipython() -> None:
    # Jupyter renders a Figure as PNG only once a formatter is registered, which pyplot's inline
    # backend does when pyplot is imported. These figures bypass pyplot, so register one here,
    # unless the user already chose a format (svg, retina...).
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return
    from IPython.core.pylabtools import print_figure
    from matplotlib.figure import Figure

    formatters = shell.display_formatter.formatters.values()
    if not any(Figure in f.type_printers for f in formatters):
        shell.display_formatter.formatters["image/png"].for_type(
            Figure, functools.partial(print_figure, fmt="png", base64=True)
        )


def axes_or_new(ax, **size):
    """``(ax.figure, ax)``, or a new one-panel figure sized by ``size``."""
    return (ax.figure, ax) if ax is not None else (lambda f, a: (f, a[0]))(*new_axes(**size))


def to_numpy(x):
    """A float64 numpy array from a tensor (any device), a list or an array."""
    import numpy

    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return numpy.asarray(x, dtype=numpy.float64)


def colors(n: int):
    """``n`` distinguishable colours: qualitative maps up to 60, a sampled rainbow beyond."""
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    qualitative = [colormaps[m](i) for m in ("tab20", "tab20b", "tab20c") for i in range(20)]
    if n <= len(qualitative):
        return qualitative[:n]
    return [colormaps["turbo"](i / max(n - 1, 1)) for i in range(n)]


def grouped_bars(ax, series: dict) -> dict:
    """Side-by-side bars, one group per x = 0, 1, 2...: in each group, a bar per entry of ``series``
    (``label -> heights``); returns ``label -> BarContainer``."""
    width = 0.8 / max(len(series), 1)
    bars = {}
    for i, (label, heights) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(heights))]
        bars[label] = ax.bar(xs, heights, width=width, label=label)
    return bars


def integer_ticks(ax, *which):
    """Integer-only ticks on the named axes (``"x"``, ``"y"``)."""
    from matplotlib.ticker import MaxNLocator

    for axis in which:
        getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True))


def kib(v: int) -> str:
    """Bytes as a short KiB label."""
    return f"{v / 1024:.0f} KiB" if v >= 10 * 1024 else f"{v / 1024:.1f} KiB"
