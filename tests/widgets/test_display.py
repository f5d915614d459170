"""moekit.widgets.display: sliders over a live view, a figure as an Output widget's display_data, and the
nearest slider option."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moekit.widgets.display import display_data, live_box, nearest


def test_without_an_ipython_shell_the_output_is_plain_text():
    IPython = pytest.importorskip("IPython")
    if IPython.get_ipython() is not None:
        pytest.skip("an IPython shell is running")
    obj = {"n": int(torch.randint(0, 99, ()))}
    assert display_data(obj) == {"output_type": "display_data", "data": {"text/plain": repr(obj)}, "metadata": {}}


def test_in_ipython_a_figure_becomes_a_png():
    pytest.importorskip("IPython")
    pytest.importorskip("matplotlib")
    code = """
from IPython.core.interactiveshell import InteractiveShell
from moekit import viz
from moekit.widgets.display import display_data
InteractiveShell.instance()
shown = display_data(viz.plot_tokens_per_expert([1, 2, 3]))
assert shown["output_type"] == "display_data", shown
assert shown["data"]["image/png"] and "Figure" in shown["data"]["text/plain"], sorted(shown["data"])
assert isinstance(shown["metadata"], dict)
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    "value, want",
    [(5, 4), (6, 4), (7, 8), (100, 64), (0, 1), (-3, 1), (1, 1), (64, 64), (48, 32)],
)
def test_nearest_takes_the_smaller_option_on_a_tie(value, want):
    assert nearest(value, [1, 2, 4, 8, 16, 32, 64]) == want


def test_nearest_does_not_need_sorted_options():
    assert nearest(10, [16, 1, 8]) == 8 and nearest(12, [16, 8]) == 8 and nearest(13, [16, 8]) == 16


class _View:
    def __init__(self, n: int):
        self.n = n

    def summary(self) -> str:
        return f"n=<{self.n}>"


def _view_for(values: dict) -> _View:
    if values["n"] < 0:
        raise ValueError("negative n")
    return _View(values["n"])


def test_live_box_redraws_on_a_change_and_shows_a_sliders_error():
    w = pytest.importorskip("ipywidgets")
    start = int(torch.randint(0, 5, ()))
    sliders = {name: w.IntSlider(value=start, min=-5, max=5) for name in ("n", "a", "b", "c")}
    box = live_box(sliders, view_for=_view_for, figure_for=lambda view: view.n * 10)
    assert [len(row.children) for row in box.children[:2]] == [3, 1]  # three sliders to a row
    text, out = box.children[2:]
    assert box.last_view.n == start and text.value == f"<code>n=&lt;{start}&gt;</code>"
    sliders["n"].value = start + 1
    assert box.last_view.n == start + 1 and out.outputs[0]["data"]["text/plain"] == str((start + 1) * 10)
    sliders["n"].value = -1  # the error is shown; the last good view stays
    assert "ValueError: negative n" in text.value and box.last_view.n == start + 1


def test_live_box_raises_what_its_first_draw_raises():
    w = pytest.importorskip("ipywidgets")
    with pytest.raises(ValueError, match="negative n"):
        live_box({"n": w.IntSlider(value=-1, min=-5, max=5)}, view_for=_view_for, figure_for=lambda view: view)
