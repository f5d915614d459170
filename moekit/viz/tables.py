"""Tables: rows of dicts shown as text, as HTML in Jupyter, or drawn into a figure."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

import torch

from moekit.viz._figure import axes_or_new

FOLD_ITEMS = 12  # a list or tuple cell longer than this shows its ends and its length


def fold(value) -> str:
    """A cell's text: long lists and tuples folded to their first and last items (C=1 over
    hundreds of tokens gave one row of thousands of characters)."""
    if isinstance(value, list | tuple) and len(value) > FOLD_ITEMS:
        head, tail = ", ".join(map(str, value[:8])), ", ".join(map(str, value[-3:]))
        return f"[{head}, ..., {tail}] ({len(value)} items)"
    return str(value)


class Table:
    """Rows of dicts that print as text and render as HTML in Jupyter (long lists folded: :func:`fold`)."""

    def __init__(self, rows: Sequence[Mapping], *, title: str | None = None):
        self.rows = [dict(r) for r in rows]
        self.title = title
        self.columns = list(self.rows[0]) if self.rows else []

    def _cells(self) -> list[list[str]]:
        return [[fold(r.get(c, "")) for c in self.columns] for r in self.rows]

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
    fig, ax = axes_or_new(ax, width=0.3 + 0.085 * sum(chars), height=0.5 + 0.24 * (len(cells) + 1))
    ax.axis("off")
    if cells:
        widths = [c / sum(chars) for c in chars]
        tab = ax.table(cellText=cells, colLabels=t.columns, colWidths=widths, bbox=[0, 0, 1, 1], cellLoc="left")
        tab.auto_set_font_size(False)
        tab.set_fontsize(9)
    if title:
        ax.set_title(title)
    return fig


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
