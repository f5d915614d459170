"""What each chunk routes where: counts, weight bytes, and their plots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moekit.quant import FP8
from moekit.types import expert_bytes
from moekit.validate import check_flag
from moekit.viz._figure import axes_or_new, colors, grouped_bars, integer_ticks, kib, to_numpy


def chunk_counts(
    topk_ids: torch.Tensor, chunk_size: int | None, num_local_experts: int, *, expert_map=None
) -> torch.Tensor:
    """int64 ``[num_chunks, E_local]``: tokens per (chunk, local expert), in one bincount.

    >>> ids = torch.tensor([[0, 1], [1, 2], [2, 3]])
    >>> chunk_counts(ids, 2, 4).tolist()
    [[1, 2, 1, 0], [0, 0, 1, 1]]
    """
    from moekit.plan import chunk_ranges
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
    """Bytes of one expert's w1 ``[N, K]`` and w2 ``[K, N/2]`` (plus 128x128 scales for fp8):
    :func:`moekit.types.expert_bytes`."""
    return expert_bytes(N, K, dtype, scaled=dtype == FP8)


def plot_tokens_per_expert(counts, *, ax=None, title: str = "tokens per expert", label: str | None = None):
    """Bars of (token, slot) rows per expert, with the mean as a dashed line."""
    fig, ax = axes_or_new(ax)
    c = to_numpy(counts)
    ax.bar(range(len(c)), c, color="tab:blue", label=label)
    if len(c):
        ax.axhline(float(c.mean()), color="black", ls="--", lw=1, label="mean")
    ax.set(xlabel="expert", ylabel="tokens (token, slot rows)", title=title)
    integer_ticks(ax, "x")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def plot_counts_heatmap(counts, *, ax=None, title: str = "tokens per (chunk, expert)", annotate: bool | None = None):
    """A chunk x expert heatmap; cells hold the tokens each chunk sends to each expert (written in the
    cells when ``annotate``; None: when there are at most 160 cells)."""
    import numpy

    if annotate is not None:
        check_flag(annotate, "annotate")
    fig, ax = axes_or_new(ax)
    c = to_numpy(counts)
    im = ax.imshow(c, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="tokens")
    ax.set(xlabel="expert", ylabel="chunk", title=title)
    integer_ticks(ax, "x", "y")
    if annotate if annotate is not None else c.size <= 160:
        peak = c.max() if c.size else 0
        for (i, j), v in numpy.ndenumerate(c):
            color = "white" if v < peak / 2 else "black"
            ax.text(j, i, f"{int(v)}", ha="center", va="center", fontsize=7, color=color)
    return fig


def plot_stacked_chunks(counts, *, ax=None, title: str = "tokens per chunk, stacked by expert"):
    """One bar per chunk, split into the experts it feeds."""
    fig, ax = axes_or_new(ax)
    c = to_numpy(counts)
    n, E = c.shape if c.ndim == 2 else (0, 0)
    palette = colors(E)
    bottom = [0.0] * n
    for e in range(E):
        ax.bar(range(n), c[:, e], bottom=bottom, color=palette[e], label=f"e{e}" if E <= 16 else None)
        bottom = [b + v for b, v in zip(bottom, c[:, e], strict=True)]
    ax.set(xlabel="chunk", ylabel="tokens (token, slot rows)", title=title)
    integer_ticks(ax, "x")
    if 0 < E <= 16:
        ax.legend(ncols=2, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    elif E > 16:  # too many for a legend: a colour bar, one band per expert
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import BoundaryNorm, ListedColormap

        bands = ScalarMappable(norm=BoundaryNorm(range(E + 1), E), cmap=ListedColormap(palette))
        ticks = range(0, E, max(1, E // 8))
        bar = fig.colorbar(bands, ax=ax, label="expert")
        bar.set_ticks([e + 0.5 for e in ticks], labels=[str(e) for e in ticks])
    return fig


def plot_counts_vs_whole(per_chunk, whole, *, ax=None, title: str = "tokens per expert: each chunk vs whole batch"):
    """Bars: each chunk's true tokens per expert; black steps: the whole-batch counts every
    chunk receives under ``metadata_policy="whole_batch"`` (bug 2)."""
    fig, ax = axes_or_new(ax, width=6.0)
    c, w = to_numpy(per_chunk), to_numpy(whole)
    grouped_bars(ax, {f"chunk {i} (true)": row for i, row in enumerate(c)})
    experts = range(c.shape[1])
    label = "whole batch (what each chunk is told)"
    ax.hlines(w, [e - 0.45 for e in experts], [e + 0.45 for e in experts], color="black", lw=2, label=label)
    ax.set(xlabel="local expert", ylabel="tokens (token, slot rows)", title=title)
    integer_ticks(ax, "x")
    ax.legend(fontsize=8)
    return fig


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
    fig, ax = axes_or_new(ax)
    n = max((len(v) for v in series.values()), default=0)
    for name, bars in grouped_bars(ax, {name: [v / 1024 for v in vs] for name, vs in series.items()}).items():
        ax.bar_label(bars, labels=[kib(v) for v in series[name]], fontsize=7, padding=2)
    ticks = [f"{i}\n{labels[i]}" if labels else str(i) for i in range(n)]
    ax.set_xticks(range(n), ticks)
    values = [v for vs in series.values() for v in vs if v > 0]
    if values and max(values) > 50 * min(values):
        ax.set_yscale("log")  # a Triton chunk's few KiB beside DeepGEMM's padded MiB
    ax.margins(y=0.15)
    ax.set(xlabel="chunk", ylabel="KiB", title=title)
    ax.legend(fontsize=8)
    return fig


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
    fig, ax = axes_or_new(ax)
    for name, ys in series.items():
        ax.plot(chunk_sizes, [y / 2**20 for y in ys], marker="o", ms=3, label=name)
    if whole is not None:
        ax.axhline(whole / 2**20, color="black", ls="--", lw=1, label="all experts once")
    if mark is not None:
        ax.axvline(mark, color="grey", ls=":", lw=1, label=f"C={mark}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter("{x:g}")  # 1, 2, 4... rather than 2^0, 2^1, 2^2...
    ax.set(xlabel="chunk size C (tokens)", ylabel="MiB read", title=title)
    ax.legend(fontsize=8)
    return fig
