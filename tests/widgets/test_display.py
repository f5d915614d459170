"""moekit.widgets.display: a figure as an Output widget's display_data, and the nearest slider option."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moekit.widgets.display import display_data, nearest


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
