"""Chunks of expert-sorted rows (``ModularKernel(chunk_by="rows")``): which rows each chunk holds.

The sorted layout puts expert 0's (token, slot) rows first, padded to a multiple of 128, then
expert 1's, and so on. A chunk of R rows is a window on that strip, so it holds a contiguous
run of experts; the numbers here follow from the tokens per expert alone (no kernel runs).
"""

from __future__ import annotations

import torch

from moekit.types import ALIGN_M as BLOCK  # the layout's block
from moekit.viz._figure import axes_or_new, colors, grouped_bars, integer_ticks, to_numpy


def expert_segments(counts: torch.Tensor) -> torch.Tensor:
    """int64 ``[E + 1]``: where each local expert's rows start in the sorted layout (and the end).

    >>> expert_segments(torch.tensor([3, 0, 130])).tolist()
    [0, 128, 128, 384]
    """
    counts = torch.as_tensor(counts).to("cpu", torch.int64)
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    return torch.cat([torch.zeros(1, dtype=torch.int64), padded.cumsum(0)])


def row_chunk_counts(counts: torch.Tensor, rows_per_chunk: int) -> torch.Tensor:
    """int64 ``[num_chunks, E]``: real rows of each expert inside each chunk of ``rows_per_chunk``
    sorted rows (padding excluded): what ``Trace.counts_matrix()`` of a row-chunked forward holds
    for its chunks over the rows in use.

    >>> row_chunk_counts(torch.tensor([200, 10]), 128).tolist()
    [[128, 0], [72, 0], [0, 10]]
    """
    if rows_per_chunk <= 0 or rows_per_chunk % BLOCK:
        raise ValueError(f"rows_per_chunk must be a positive multiple of {BLOCK}, got {rows_per_chunk}")
    counts = torch.as_tensor(counts).to("cpu", torch.int64)
    bounds = expert_segments(counts)
    start, total = bounds[:-1], int(bounds[-1])
    n = max(1, -(-total // rows_per_chunk))
    lo = torch.arange(n, dtype=torch.int64)[:, None] * rows_per_chunk  # each chunk's [lo, hi)
    hi = lo + rows_per_chunk
    first, last = start[None, :], (start + counts)[None, :]  # each expert's real rows [first, last)
    return (torch.minimum(hi, last) - torch.maximum(lo, first)).clamp(min=0)


def chunks_per_expert(counts: torch.Tensor) -> torch.Tensor:
    """int64 ``[E]``: how many chunks touch each expert (each one reads that expert's weights)."""
    return (torch.as_tensor(counts) > 0).sum(0)


def plot_sorted_rows(counts, rows_per_chunk: int, *, ax=None, title: str = "sorted rows, cut into chunks"):
    """The layout as a strip: each expert's real rows in its colour, its padding pale, and the
    chunk boundaries every ``rows_per_chunk`` rows."""
    fig, ax = axes_or_new(ax, width=9.0, height=2.4)
    counts = torch.as_tensor(counts).to("cpu", torch.int64)
    start = to_numpy(expert_segments(counts))
    palette = colors(counts.numel())
    for e, c in enumerate(counts.tolist()):
        ax.barh(0, c, left=start[e], height=0.6, color=palette[e], edgecolor="none")
        pad = start[e + 1] - start[e] - c
        if pad:
            ax.barh(0, pad, left=start[e] + c, height=0.6, color=palette[e], alpha=0.25, edgecolor="none")
        if start[e + 1] > start[e]:
            ax.text((start[e] + start[e + 1]) / 2, 0, str(e), ha="center", va="center", fontsize=7)
    total = start[-1]
    for i, b in enumerate(range(0, int(total) + 1, rows_per_chunk)):
        ax.axvline(b, color="black", lw=1.2, ls="--")
        if b < total:
            ax.text((b + min(b + rows_per_chunk, total)) / 2, 0.45, f"chunk {i}", ha="center", fontsize=8)
    ax.set(
        xlim=(0, max(total, 1)),
        ylim=(-0.5, 0.7),
        yticks=[],
        xlabel="sorted row (experts' rows, padded to 128)",
        title=title,
    )
    return fig


def plot_chunks_per_expert(series: dict, *, ax=None, title: str = "chunks that read each expert's weights"):
    """Grouped bars: for each expert, the chunks that touch it under each plan in ``series``
    (``name -> counts [num_chunks, E]``)."""
    fig, ax = axes_or_new(ax)
    grouped_bars(ax, {name: to_numpy(chunks_per_expert(counts)) for name, counts in series.items()})
    integer_ticks(ax, "x", "y")
    ax.set(xlabel="local expert", ylabel="chunks", title=title)
    ax.legend(fontsize=8)
    return fig


def plot_weight_bytes_per_chunk(
    series: dict, bytes_per_expert: int, *, ax=None, title: str = "weight bytes read per chunk"
):
    """One line of steps per plan in ``series`` (``name -> counts [num_chunks, E]``): the weight
    bytes each chunk reads (experts it touches x ``bytes_per_expert``); the legend gives the total."""
    fig, ax = axes_or_new(ax, width=7.0)
    for name, counts in series.items():
        per = to_numpy((torch.as_tensor(counts) > 0).sum(1)) * bytes_per_expert / 2**20
        ax.step(range(len(per)), per, where="mid", marker="o", ms=3, label=f"{name}: {per.sum():.0f} MiB in all")
    integer_ticks(ax, "x")
    ax.set(xlabel="chunk", ylabel="MiB of weights read", title=title)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return fig
