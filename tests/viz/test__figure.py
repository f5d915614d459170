"""moekit/viz/_figure.py (figure plumbing), through the plots that use it: new figures without
pyplot, Jupyter display, colours, ticks, labels."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moekit import viz

pytest.importorskip("matplotlib")


def test_plots_draw_on_given_axes():
    fig, axes = viz.new_axes(2)
    assert viz.plot_tokens_per_expert(torch.tensor([1, 2]), ax=axes[1]) is fig
    assert axes[1].get_xlabel() == "expert"


def test_plots_never_touch_pyplot():
    viz.plot_tokens_per_expert(torch.tensor([1, 2]))
    assert "matplotlib.pyplot" not in sys.modules or not __import__("matplotlib.pyplot").pyplot.get_fignums()


def test_import_moekit_does_not_import_matplotlib():
    code = "import sys, moekit, moekit.viz, moekit.widgets; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_new_axes_sizes_each_panel():
    from matplotlib.figure import Figure

    fig, axes = viz.new_axes(3, nrows=2, width=4.0, height=2.5)
    assert isinstance(fig, Figure) and len(axes) == 6 and all(ax.figure is fig for ax in axes)
    assert tuple(fig.get_size_inches()) == (12.0, 5.0)
    fig, (ax,) = viz.new_axes()
    assert tuple(fig.get_size_inches()) == (5.0, 3.6)


def test_a_plot_without_axes_gets_a_new_figure():
    a = viz.plot_tokens_per_expert(torch.tensor([1, 2]))
    b = viz.plot_tokens_per_expert(torch.tensor([1, 2]))
    assert a is not b and len(a.axes) == 1


def test_figures_show_as_png_in_ipython_unless_a_format_was_chosen():
    pytest.importorskip("IPython")
    code = """
from IPython.core.interactiveshell import InteractiveShell
from matplotlib.figure import Figure
from moekit import viz
shell = InteractiveShell.instance()
assert "image/png" not in shell.display_formatter.format(Figure())[0]
fig, _ = viz.new_axes()
assert "image/png" in shell.display_formatter.format(fig)[0]
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    chosen = """
from IPython.core.interactiveshell import InteractiveShell
from matplotlib.figure import Figure
from moekit import viz
shell = InteractiveShell.instance()
shell.display_formatter.formatters["image/svg+xml"].for_type(Figure, lambda f: "<svg/>")
fig, _ = viz.new_axes()
data = shell.display_formatter.format(fig)[0]
assert "image/png" not in data and data["image/svg+xml"] == "<svg/>"
"""
    subprocess.run([sys.executable, "-c", chosen], check=True, timeout=120)


@pytest.mark.parametrize("E", [4, 12, 70])
def test_every_expert_gets_its_own_colour(E):
    counts = torch.randint(1, 9, (3, E))
    ax = viz.plot_stacked_chunks(counts).axes[0]
    colours = {tuple(p.get_facecolor()) for p in ax.patches}
    assert len(ax.patches) == 3 * E and len(colours) == E


def test_tensors_lists_and_devices_plot_the_same(device):
    counts = torch.randint(1, 50, (6,))
    heights = lambda fig: [p.get_height() for p in fig.axes[0].patches]
    expected = [float(c) for c in counts]
    assert heights(viz.plot_tokens_per_expert(counts.to(device))) == expected
    assert heights(viz.plot_tokens_per_expert(counts.tolist())) == expected


def test_integer_ticks_plain_ticks_and_kib_labels():
    from matplotlib.ticker import MaxNLocator

    ax = viz.plot_tokens_per_expert(torch.randint(1, 9, (3,))).axes[0]
    locator = ax.xaxis.get_major_locator()
    assert isinstance(locator, MaxNLocator) and all(float(t).is_integer() for t in locator.tick_values(0, 2.4))
    ax = viz.plot_weight_bytes([1, 2, 4, 8], {"r": [4, 3, 2, 1]}).axes[0]
    assert [ax.xaxis.get_major_formatter()(v, 0) for v in (1, 4, 256)] == ["1", "4", "256"]
    ax = viz.plot_workspace_bytes({"a": [1024, 40960]}).axes[0]
    assert [t.get_text() for t in ax.texts] == ["1.0 KiB", "40 KiB"]


def test_small_heatmaps_are_annotated_cell_by_cell():
    counts = torch.randint(1, 99, (2, 3))
    texts = viz.plot_counts_heatmap(counts).axes[0].texts
    got = {(round(t.get_position()[1]), round(t.get_position()[0])): int(t.get_text()) for t in texts}
    assert got == {(i, j): int(counts[i, j]) for i in range(2) for j in range(3)}


def test_grouped_bars_sit_side_by_side_around_each_x():
    counts = torch.randint(1, 9, (3, 4))
    ax = viz.plot_counts_vs_whole(counts, counts.sum(0)).axes[0]
    bars = [p for p in ax.patches if p.get_height() > 0]
    assert len(bars) == 12 and {round(p.get_width(), 6) for p in bars} == {round(0.8 / 3, 6)}
    centres = sorted(p.get_x() + p.get_width() / 2 for p in bars)
    for e in range(4):  # chunk 0, 1, 2 of expert e: one bar width apart, centred on e
        assert [round(c - e, 6) for c in centres[3 * e : 3 * e + 3]] == [round(d * 0.8 / 3, 6) for d in (-1, 0, 1)]
