"""Recorded benchmark results drawn: one plot per kind of record, and a grid of them all.

- ``layer-*``: time per call against M for each peer, with the floor and the H200 anchors;
- ``chunking-*``: time per call for each chunk plan (token chunks C, sorted-row chunks R), relative
  to no chunking;
- ``count*``: the count kernel's methods on the largest case, with the recorded anchors;
- ``ep-*``: the all-to-all's dispatch and combine against tokens per rank.

Records come from :func:`benchmarks.results_view.records.bench_results`. Every ``plot_*`` draws on
``ax`` when given one, else on a new figure, and returns the figure (moekit.viz's convention).
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.results_view.records import kind, ok_rows
from moekit.viz import axes_or_new, new_axes


def plot_count_timings(record: dict):
    """Eager (left) and CUDA-graph (right) medians per case, one bar per method (log scale)."""
    fig, axes = new_axes(2, width=6.4)
    rows = ok_rows(record["rows"])
    case = lambda r: (r["M"], r["topk"], r["E"], r.get("ep", 1))
    cases = sorted({case(r) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / max(1, len(methods))
    for ax, key, title in ((axes[0], "us", "eager"), (axes[1], "graph_us", "CUDA graph")):
        for i, method in enumerate(methods):
            us = {case(r): r.get(key) for r in rows if r["method"] == method}
            xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(cases))]
            ax.bar(xs, [us.get(c) or float("nan") for c in cases], width=width, label=method)
        ax.set_xticks(range(len(cases)), [f"{m}x{k}\nE={e} ep={p}" for m, k, e, p in cases], fontsize=6)
        ax.set(yscale="log", ylabel="median us", title=f"{title}, {record['environment'].get('gpu', '?')}")
    axes[0].legend(fontsize=7)
    return fig


def _title(record: dict) -> str:
    env = record.get("environment", {})
    return f"{record['name']}\n{env.get('gpu', '?')}, {env.get('date', '?')}"


def plot_layer(record: dict, *, ax=None):
    """Measured us against M per peer (log-log), the floor (dashed) and the anchors (crosses)."""
    fig, ax = axes_or_new(ax, width=5.6)
    rows = record["rows"]
    for peer in dict.fromkeys(r["peer"] for r in rows if "peer" in r):
        pts = sorted((r["M"], r["us"]) for r in ok_rows(rows) if r.get("peer") == peer)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", ms=4, label=peer)
    floors = sorted({(r["M"], r["floor_us"]) for r in rows if r.get("floor_us")})
    if floors:
        ax.plot(*zip(*floors, strict=True), color="black", ls="--", lw=1, label="floor")
    anchors = sorted({(name, r["M"], us) for r in rows for name, us in (r.get("anchors_us") or {}).items()})
    for i, name in enumerate(dict.fromkeys(a[0] for a in anchors)):
        pts = [(m, us) for n, m, us in anchors if n == name]
        marker = "x+*D^v"[i % 6]
        ax.scatter(*zip(*pts, strict=True), marker=marker, s=50, color="black", label=f"anchor: {name}")
    ax.set(xscale="log", yscale="log", xlabel="M tokens", ylabel="us per call", title=_title(record))
    ax.legend(fontsize=7)
    return fig


def plot_chunking(record: dict, *, ax=None):
    """Time per call for each chunk plan: token chunks of C (blue; C=None is one chunk) and chunks
    of R sorted rows (orange), eager bars labelled by their ratio to one chunk, CUDA-graph times as
    dots where recorded, and the floor."""
    fig, ax = axes_or_new(ax, width=6.4)
    rows = ok_rows(record["rows"])
    by_rows = [r.get("chunk_by") == "rows" for r in rows]
    labels = [
        "none" if r.get("C") is None else f"{'R' if b else 'C'}={r['C']}" for r, b in zip(rows, by_rows, strict=True)
    ]
    bars = ax.bar(range(len(rows)), [r["us"] for r in rows], color=["tab:orange" if b else "tab:blue" for b in by_rows])
    ratios = [r.get("ratio_vs_unchunked") for r in rows]
    ax.bar_label(bars, labels=["" if x is None else f"{x:.2f}x" for x in ratios], fontsize=7)
    graph = [(i, r["graph_us"]) for i, r in enumerate(rows) if r.get("graph_us")]
    if graph:
        ax.scatter(*zip(*graph, strict=True), color="black", s=14, zorder=3, label="CUDA graph")
    floor = next((r["floor_us"] for r in rows if r.get("floor_us")), None)
    if floor:
        ax.axhline(floor, color="black", ls="--", lw=1, label="floor")
    if any(by_rows):
        ax.bar([0], [0], color="tab:blue", label="token chunks (C tokens)")
        ax.bar([0], [0], color="tab:orange", label="sorted-row chunks (R rows)")
    if graph or floor or any(by_rows):
        ax.legend(fontsize=7)
    ax.set_xticks(range(len(rows)), labels, rotation=45 if len(rows) > 6 else 0, fontsize=7)
    ax.set(xlabel="chunk plan", ylabel="us per call (eager; log)", yscale="log", title=_title(record))
    return fig


def plot_count(record: dict, *, ax=None):
    """The count methods on the largest recorded case, beside the numeric anchors."""
    fig, ax = axes_or_new(ax, width=5.6)
    rows = ok_rows(record["rows"])
    if rows:
        big = max(rows, key=lambda r: (r.get("M", 0), r.get("E", 0)))
        case = [r for r in rows if all(r.get(k) == big.get(k) for k in ("M", "topk", "E"))]
        names = [f"{r['method']}" + (f" ep={r['ep']}" if r.get("ep", 1) > 1 else "") for r in case]
        ax.barh(range(len(case)), [r["us"] for r in case], color="tab:blue", label="measured")
        ax.set_yticks(range(len(case)), names, fontsize=7)
        anchors = {k: v for k, v in (record.get("anchors") or {}).items() if isinstance(v, int | float)}
        for i, (name, us) in enumerate(anchors.items()):
            ax.axvline(us, color=f"C{i + 1}", ls=":", lw=1.5, label=f"anchor: {name} ({us:g} us)")
        ax.set_title(f"{_title(record)}\nM={big.get('M')}, topk={big.get('topk')}, E={big.get('E')}", fontsize=9)
        ax.legend(fontsize=6)
    ax.set(xscale="log", xlabel="us per call")
    return fig


def plot_ep(record: dict, *, ax=None):
    """All-to-all dispatch and combine time against tokens per rank (rank 0), per quantization."""
    fig, ax = axes_or_new(ax, width=5.6)
    rows = [r for r in record["rows"] if r.get("rank", 0) == 0 and "M" in r]
    for i, quant in enumerate(dict.fromkeys(r.get("quant", "") for r in rows)):
        pts = sorted((r["M"], r.get("dispatch_us"), r.get("combine_us")) for r in rows if r.get("quant", "") == quant)
        ms = [p[0] for p in pts]
        ax.plot(ms, [p[1] for p in pts], marker="o", ms=4, color=f"C{i}", label=f"dispatch, {quant}")
        ax.plot(ms, [p[2] for p in pts], marker="s", ms=4, ls="--", color=f"C{i}", label=f"combine, {quant}")
    ax.set(xscale="log", yscale="log", xlabel="M tokens per rank", ylabel="us per call (rank 0)")
    ax.set_title(_title(record), fontsize=9)
    ax.legend(fontsize=7)
    return fig


def plot_bench(record: dict, *, ax=None):
    """Draw one record with the plot for its kind."""
    plots = {"layer": plot_layer, "chunking": plot_chunking, "count": plot_count, "ep": plot_ep}
    plot = plots.get(kind(record))
    if plot is None:
        fig, ax = axes_or_new(ax)
        ax.axis("off")
        ax.text(0.5, 0.5, f"{record['name']}: no plot for this kind", ha="center")
        return fig
    return plot(record, ax=ax)


def plot_bench_grid(records: Sequence[dict], *, ncols: int = 2):
    """Every record in one figure (a placeholder panel when there are none)."""
    if not records:
        fig, (ax,) = new_axes(1, height=1.5)
        ax.axis("off")
        ax.text(0.5, 0.5, "no benchmark results recorded yet (python -m benchmarks.harness ...)", ha="center")
        return fig
    ncols = min(ncols, len(records))
    fig, axes = new_axes(ncols, nrows=-(-len(records) // ncols), width=6.0, height=4.4)
    for ax, record in zip(axes, records, strict=False):
        plot_bench(record, ax=ax)
    for ax in axes[len(records) :]:
        ax.axis("off")
    return fig
