"""moekit.viz.tables: tables as text, HTML or a figure; tensor shapes at every step."""

from __future__ import annotations

import io

import pytest
import torch

from moekit import viz

pytest.importorskip("matplotlib")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def test_table_text_and_html():
    t = viz.table([{"a": 1, "shape": (2, 3)}, {"a": "<x>", "shape": None}], title="T")
    text = str(t)
    assert text.splitlines()[0] == "T" and "(2, 3)" in text and "shape" in text
    html = t._repr_html_()
    assert "&lt;x&gt;" in html and "<caption>T</caption>" in html and html.count("<tr>") == 3
    assert str(viz.table([])) == ""


def test_shape_rows():
    rows = viz.shape_rows([("in", "x", torch.zeros(2, 3)), ("prepare", "scale", None)])
    assert rows[0] == {"step": "in", "tensor": "x", "shape": (2, 3), "dtype": "float32", "bytes": 24}
    assert rows[1]["dtype"] == "None" and rows[1]["bytes"] == 0


def test_plot_table_draws():
    fig = viz.plot_table(viz.shape_rows([("in", "x", torch.zeros(2))]))
    assert _png(fig).startswith(b"\x89PNG")


def test_columns_come_from_the_first_row_and_missing_cells_are_blank():
    n = int(torch.randint(10, 99, ()))
    t = viz.table([{"a": n, "b": "x"}, {"b": "yy", "c": 3}])
    assert t.columns == ["a", "b"] and t.title is None
    lines = str(t).splitlines()
    assert lines == ["a   b", f"{n}  x", "    yy"]
    assert repr(t) == str(t) and "<caption>" not in t._repr_html_()


def test_shape_rows_name_what_is_not_a_tensor():
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    rows = viz.shape_rows([("prepare", "x", x), ("prepare", "meta", [1, 2])])
    assert rows[0]["shape"] == (3, 4) and rows[0]["dtype"] == "bfloat16" and rows[0]["bytes"] == 24
    assert rows[1] == {"step": "prepare", "tensor": "meta", "shape": "-", "dtype": "list", "bytes": 0}


def test_plot_table_draws_every_cell():
    rows = [{"chunk": i, "M": int(m)} for i, m in enumerate(torch.randint(1, 99, (3,)))]
    ax = viz.plot_table(rows, title="chunks").axes[0]
    cells = ax.tables[0].get_celld()
    assert len(cells) == 4 * 2 and ax.get_title() == "chunks"
    assert cells[(0, 1)].get_text().get_text() == "M" and cells[(3, 1)].get_text().get_text() == str(rows[2]["M"])


def test_long_lists_fold_to_their_ends_and_length():
    from moekit.viz.tables import FOLD_ITEMS, fold

    assert fold(list(range(FOLD_ITEMS))) == str(list(range(FOLD_ITEMS)))
    long = list(range(1000))
    assert fold(long) == "[0, 1, 2, 3, 4, 5, 6, 7, ..., 997, 998, 999] (1000 items)"
    row = str(viz.table([{"chunk": 0, "experts touched per chunk": long}]))
    assert len(row.splitlines()[1]) < 80, row
