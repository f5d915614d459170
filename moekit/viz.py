"""Plots and tables for the notebooks and the walkthrough.

Every ``plot_*`` function draws on ``ax`` when given one, else on a new figure, and returns the
:class:`matplotlib.figure.Figure`. Figures are built with ``matplotlib.figure.Figure`` rather
than pyplot: they render with Agg, so a headless machine needs no backend; they never open a
window; and Jupyter shows a figure once, when it is the value of a cell (or ``display(fig)``).
matplotlib is imported inside the functions, so ``import moekit`` does not need it.

The few numbers behind the plots (:func:`chunk_counts`, :func:`weight_bytes_read`) are plain
torch and are tested against the count kernel and the trace.
"""

from __future__ import annotations

import functools
import html
import math
import sys
from collections.abc import Mapping, Sequence

import torch


def new_axes(ncols: int = 1, *, width: float = 5.0, height: float = 3.6):
    """A new figure with ``ncols`` axes side by side; returns ``(fig, axes)`` (a list)."""
    from matplotlib.figure import Figure

    _show_figures_in_ipython()
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
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


def _axes(ax, **size):
    return (ax.figure, ax) if ax is not None else (lambda f, a: (f, a[0]))(*new_axes(**size))


def _np(x):
    return x.detach().to("cpu", torch.float64).numpy() if isinstance(x, torch.Tensor) else x


# ---------------------------------------------------------------------------------------------
# Numbers behind the plots (torch only)


def chunk_counts(
    topk_ids: torch.Tensor, chunk_size: int | None, num_local_experts: int, *, expert_map=None
) -> torch.Tensor:
    """int64 ``[num_chunks, E_local]``: tokens per (chunk, local expert), in one bincount.

    >>> ids = torch.tensor([[0, 1], [1, 2], [2, 3]])
    >>> chunk_counts(ids, 2, 4).tolist()
    [[1, 2, 1, 0], [0, 0, 1, 1]]
    """
    from moekit.chunking import chunk_ranges
    from moekit.reference import local_expert_ids

    M = topk_ids.shape[0]
    n = len(chunk_ranges(M, chunk_size))
    C = chunk_size if chunk_size is not None and chunk_size < M else max(M, 1)
    local = local_expert_ids(topk_ids, num_local_experts, expert_map).cpu()  # [M, topk]
    chunk = (torch.arange(M) // C).unsqueeze(1).expand_as(local)
    keep = local >= 0
    flat = chunk[keep] * num_local_experts + local[keep]
    return torch.bincount(flat, minlength=n * num_local_experts).view(n, num_local_experts)


def weight_bytes_read(counts: torch.Tensor, bytes_per_expert: int) -> int:
    """Bytes of expert weights all chunks read: each chunk reads every expert it touches once."""
    return int((counts > 0).sum()) * int(bytes_per_expert)


def expert_weight_bytes(N: int, K: int, *, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one expert's w1 ``[N, K]`` and w2 ``[K, N/2]`` (plus 128x128 scales for fp8)."""
    item = torch.empty((), dtype=dtype).element_size()
    elems = N * K + K * (N // 2)
    scales = 0
    if dtype == torch.float8_e4m3fn:
        blocks = math.ceil(N / 128) * math.ceil(K / 128) + math.ceil(K / 128) * math.ceil(N / 2 / 128)
        scales = 4 * blocks
    return elems * item + scales


# ---------------------------------------------------------------------------------------------
# Tables


class Table:
    """Rows of dicts that print as text and render as HTML in Jupyter."""

    def __init__(self, rows: Sequence[Mapping], *, title: str | None = None):
        self.rows = [dict(r) for r in rows]
        self.title = title
        self.columns = list(self.rows[0]) if self.rows else []

    def _cells(self) -> list[list[str]]:
        return [[str(r.get(c, "")) for c in self.columns] for r in self.rows]

    def __str__(self) -> str:
        cells = self._cells()
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(self.columns)]
        line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths, strict=True)).rstrip()
        out = [self.title] if self.title else []
        return "\n".join(out + [line(self.columns)] + [line(r) for r in cells])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        esc = lambda v: html.escape(str(v))
        head = "".join(f"<th>{esc(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in r) + "</tr>" for r in self._cells())
        cap = f"<caption>{esc(self.title)}</caption>" if self.title else ""
        return f"<table class='moekit-table'>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def table(rows: Sequence[Mapping], *, title: str | None = None) -> Table:
    """A :class:`Table` of ``rows`` (for example ``kernel.last_trace.rows()``)."""
    return Table(rows, title=title)


def plot_table(rows: Sequence[Mapping], *, title: str | None = None, ax=None):
    """Draw a table of ``rows`` as a figure (for reports and PNGs), sized to its text."""
    t = Table(rows, title=title)
    cells = t._cells()
    chars = [max([len(c)] + [len(r[i]) for r in cells]) + 2 for i, c in enumerate(t.columns)]
    fig, ax = _axes(ax, width=0.3 + 0.085 * sum(chars), height=0.5 + 0.24 * (len(cells) + 1))
    ax.axis("off")
    if cells:
        widths = [c / sum(chars) for c in chars]
        tab = ax.table(cellText=cells, colLabels=t.columns, colWidths=widths, bbox=[0, 0, 1, 1], cellLoc="left")
        tab.auto_set_font_size(False)
        tab.set_fontsize(9)
    if title:
        ax.set_title(title)
    return fig


# ---------------------------------------------------------------------------------------------
# Plots


def plot_tokens_per_expert(counts, *, ax=None, title: str = "tokens per expert", label: str | None = None):
    """Bars of (token, slot) rows per expert, with the mean as a dashed line."""
    fig, ax = _axes(ax)
    c = _np(counts)
    ax.bar(range(len(c)), c, color="tab:blue", label=label)
    if len(c):
        ax.axhline(float(c.mean()), color="black", ls="--", lw=1, label="mean")
    ax.set(xlabel="expert", ylabel="tokens (token, slot rows)", title=title)
    _integer_ticks(ax, "x")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def plot_counts_heatmap(counts, *, ax=None, title: str = "tokens per (chunk, expert)", annotate: bool | None = None):
    """A chunk x expert heatmap; cells hold the tokens each chunk sends to each expert."""
    fig, ax = _axes(ax)
    c = _np(counts)
    im = ax.imshow(c, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="tokens")
    ax.set(xlabel="expert", ylabel="chunk", title=title)
    _integer_ticks(ax, "x", "y")
    if annotate if annotate is not None else c.size <= 160:
        peak = c.max() if c.size else 0
        for (i, j), v in _enumerate2d(c):
            ax.text(
                j,
                i,
                f"{int(v)}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if v < peak / 2 else "black",
            )
    return fig


def _enumerate2d(a):
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            yield (i, j), a[i, j]


def plot_stacked_chunks(counts, *, ax=None, title: str = "tokens per chunk, stacked by expert"):
    """One bar per chunk, split into the experts it feeds."""
    fig, ax = _axes(ax)
    c = _np(counts)
    n, E = c.shape if c.ndim == 2 else (0, 0)
    colors = _colors(E)
    bottom = [0.0] * n
    for e in range(E):
        ax.bar(range(n), c[:, e], bottom=bottom, color=colors[e], label=f"e{e}" if E <= 16 else None)
        bottom = [b + v for b, v in zip(bottom, c[:, e], strict=True)]
    ax.set(xlabel="chunk", ylabel="tokens (token, slot rows)", title=title)
    _integer_ticks(ax, "x")
    if 0 < E <= 16:
        ax.legend(ncols=2, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    return fig


def _colors(n: int):
    """``n`` distinguishable colours: qualitative maps up to 60, a sampled rainbow beyond."""
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    qualitative = [colormaps[m](i) for m in ("tab20", "tab20b", "tab20c") for i in range(20)]
    if n <= len(qualitative):
        return qualitative[:n]
    return [colormaps["turbo"](i / max(n - 1, 1)) for i in range(n)]


def plot_workspace_bytes(
    series: Mapping[str, Sequence[int]],
    *,
    labels: Sequence[str] | None = None,
    ax=None,
    title: str = "workspace bytes per chunk",
):
    """Grouped bars: for each chunk, the workspace bytes under each policy in ``series``.

    ``labels`` (one per chunk, e.g. the backend that ran) are written under the bars.
    """
    fig, ax = _axes(ax)
    names = list(series)
    n = max((len(v) for v in series.values()), default=0)
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(series[name]))]
        bars = ax.bar(xs, [v / 1024 for v in series[name]], width=width, label=name)
        ax.bar_label(bars, labels=[_kib(v) for v in series[name]], fontsize=7, padding=2)
    ticks = [f"{i}\n{labels[i]}" if labels else str(i) for i in range(n)]
    ax.set_xticks(range(n), ticks)
    values = [v for vs in series.values() for v in vs if v > 0]
    if values and max(values) > 50 * min(values):
        ax.set_yscale("log")  # a Triton chunk's few KiB beside DeepGEMM's padded MiB
    ax.margins(y=0.15)
    ax.set(xlabel="chunk", ylabel="KiB", title=title)
    ax.legend(fontsize=8)
    return fig


def _kib(v: int) -> str:
    return f"{v / 1024:.0f} KiB" if v >= 10 * 1024 else f"{v / 1024:.1f} KiB"


def plot_weight_bytes(
    chunk_sizes: Sequence[int],
    series: Mapping[str, Sequence[int]],
    *,
    whole: int | None = None,
    mark: int | None = None,
    ax=None,
    title: str = "expert weight bytes read vs chunk size",
):
    """Lines of weight bytes read (all chunks together) against C; ``whole`` = every weight once."""
    fig, ax = _axes(ax)
    for name, ys in series.items():
        ax.plot(chunk_sizes, [y / 2**20 for y in ys], marker="o", ms=3, label=name)
    if whole is not None:
        ax.axhline(whole / 2**20, color="black", ls="--", lw=1, label="all experts once")
    if mark is not None:
        ax.axvline(mark, color="grey", ls=":", lw=1, label=f"C={mark}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(_plain_ticks())
    ax.set(xlabel="chunk size C (tokens)", ylabel="MiB read", title=title)
    ax.legend(fontsize=8)
    return fig


def _plain_ticks():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}")


def _integer_ticks(ax, *which):
    from matplotlib.ticker import MaxNLocator

    for axis in which:
        getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True))


def shape_rows(steps: Sequence[tuple[str, str, object]]) -> list[dict]:
    """Rows ``{step, tensor, shape, dtype, bytes}`` for ``(step, name, tensor)`` triples.

    A ``None`` tensor (no scale, no metadata) gets a row that says so.
    """
    rows = []
    for step, name, t in steps:
        if isinstance(t, torch.Tensor):
            row = (tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
        else:
            row = ("-", "None" if t is None else type(t).__name__, 0)
        rows.append(dict(zip(("step", "tensor", "shape", "dtype", "bytes"), (step, name, *row), strict=True)))
    return rows


def plot_counts_vs_whole(per_chunk, whole, *, ax=None, title: str = "tokens per expert: each chunk vs whole batch"):
    """Bars: each chunk's true tokens per expert; black steps: the whole-batch counts every
    chunk receives under ``metadata_policy="whole_batch"`` (bug 2)."""
    fig, ax = _axes(ax, width=6.0)
    c, w = _np(per_chunk), _np(whole)
    n, E = c.shape
    width = 0.8 / max(n, 1)
    for i in range(n):
        ax.bar([e + (i - (n - 1) / 2) * width for e in range(E)], c[i], width=width, label=f"chunk {i} (true)")
    ax.hlines(
        w,
        [e - 0.45 for e in range(E)],
        [e + 0.45 for e in range(E)],
        color="black",
        lw=2,
        label="whole batch (what each chunk is told)",
    )
    ax.set(xlabel="local expert", ylabel="tokens (token, slot rows)", title=title)
    _integer_ticks(ax, "x")
    ax.legend(fontsize=8)
    return fig
