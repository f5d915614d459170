"""The data flow of one forward, drawn from its trace: router, prepare, every chunk, finalize."""

from __future__ import annotations

from moekit.viz._figure import axes_or_new, kib


def _box(ax, x, y, w, h, text, color, *, fontsize=8):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(
        FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.06", fc=color, ec="black", lw=0.8)
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, x0, y0, x1, y1):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="->", lw=0.9, color="black"))


def plot_data_flow(
    trace, *, K: int | None = None, topk: int | None = None, max_chunks: int = 8, ax=None, title: str | None = None
):
    """One forward as boxes and arrows: the router's ``[M, topk]`` ids, prepare, one box per chunk
    (its tokens or sorted rows, backend, workspace and experts touched), finalize's ``[M, K]``.

    ``trace`` is a :class:`moekit.Trace` (``kernel.last_trace``); ``K``/``topk`` label the shapes.
    Past ``max_chunks`` chunks the middle ones fold into one "..." box.
    """
    chunks = list(trace.chunks)
    shown = chunks if len(chunks) <= max_chunks else chunks[: max_chunks - 2] + [None] + chunks[-1:]
    n = max(len(shown), 1)
    fig, ax = axes_or_new(ax, width=9.5, height=max(2.6, 0.55 * n + 1.2))
    rows = "rows" if trace.chunk_by == "rows" else "tokens"
    mid = (n - 1) * 0.55 / 2
    shape = lambda *dims: "[" + ", ".join(str(d) for d in dims if d is not None) + "]"
    _box(ax, 0.0, mid, 1.5, 0.45, f"router\nids {shape(trace.M, topk)}", "#dde8f5")
    _box(ax, 2.0, mid, 1.6, 0.45, f"prepare\n{trace.M} tokens", "#e8f1dd")
    _arrow(ax, 1.5, mid + 0.22, 2.0, mid + 0.22)
    pastel = ("#cfe2f3", "#f9d9b5", "#d9ead3", "#ead1dc", "#fff2cc", "#d0e0e3")
    backends = {b: pastel[i % len(pastel)] for i, b in enumerate(dict.fromkeys(c.backend for c in chunks))}
    for i, c in enumerate(shown):
        y = (n - 1 - i) * 0.55
        if c is None:
            _box(ax, 4.2, y, 3.4, 0.45, f"... {len(chunks) - len(shown) + 1} more chunks ...", "white")
        else:
            touched = "" if c.experts_touched is None else f", {c.experts_touched} experts"
            state = "" if c.completed else " (failed)"
            head = f"chunk {c.index}: {rows} [{c.start}, {c.end})  {c.backend}{state}"
            text = f"{head}\nworkspace {kib(c.workspace_bytes)}{touched}"
            _box(ax, 4.2, y, 3.4, 0.45, text, backends[c.backend] if c.completed else "#f4b6b6", fontsize=7)
        _arrow(ax, 3.6, mid + 0.22, 4.2, y + 0.22)
        _arrow(ax, 7.6, y + 0.22, 8.2, mid + 0.22)
    _box(ax, 8.2, mid, 1.5, 0.45, f"finalize\nout {shape(trace.M, K)}", "#f5ecdd")
    ax.set(xlim=(-0.1, 9.8), ylim=(-0.2, (n - 1) * 0.55 + 0.65))
    ax.axis("off")
    ax.set_title(
        title or f"one forward: {len(chunks)} chunk(s) of {trace.chunk_size or trace.M} {rows}, {trace.experts}",
        fontsize=10,
    )
    return fig
