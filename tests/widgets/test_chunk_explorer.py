"""moekit.widgets, headless: the explorer's pure update logic, then the ipywidgets wiring."""

from __future__ import annotations

import pytest
import torch

from moekit import viz, widgets
from moekit.widgets import ExplorerParams, chunk_explorer

pytest.importorskip("matplotlib")


@pytest.mark.parametrize(
    "given, want",
    [
        (dict(topk=20, E=8), dict(topk=8)),
        (dict(ep_size=3, E=8), dict(ep_size=2)),  # the largest size <= 3 that divides E
        (dict(ep_size=16, E=4), dict(ep_size=4)),
        (dict(C=0, M=0, skew=-1.0), dict(C=1, M=1, skew=0.0)),
        (dict(C=1024, M=100), dict(C=100)),  # C > M is one chunk: no degenerate axes
    ],
)
def test_normalized(given, want):
    p = ExplorerParams(**given).normalized()
    assert {k: getattr(p, k) for k in want} == want


@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_view_counts(ep_size):
    p = ExplorerParams(M=200, C=64, E=16, topk=3, skew=1.0, ep_size=ep_size)
    v = widgets.explorer_view(p)
    assert v.counts.shape == (4, 16 // ep_size)  # 64 + 64 + 64 + 8
    if ep_size == 1:
        assert v.counts.sum().item() == 200 * 3
    assert v.touched == (v.counts > 0).sum(1).tolist()
    assert "4 chunk(s) of C=64" in v.summary()


def test_view_sweep_is_nested_and_monotone():
    v = widgets.explorer_view(ExplorerParams(M=300, E=32, topk=4, skew=0.5))
    assert v.chunk_sizes[0] == 1 and v.chunk_sizes[-1] == 300
    assert v.weight_bytes == sorted(v.weight_bytes, reverse=True)  # power-of-two chunks nest
    assert v.weight_bytes[0] == 300 * 4 * v.bytes_per_expert  # C=1: every (token, slot) reads its expert
    whole = viz.chunk_counts(torch.as_tensor([[0]]), None, 1)  # smoke: C=None is one chunk
    assert whole.shape == (1, 1)


def test_same_seed_same_view():
    a = widgets.explorer_view(ExplorerParams(seed=5))
    b = widgets.explorer_view(ExplorerParams(seed=5))
    c = widgets.explorer_view(ExplorerParams(seed=6))
    assert torch.equal(a.counts, b.counts) and not torch.equal(a.counts, c.counts)


def test_draw():
    fig = chunk_explorer.draw(widgets.explorer_view(ExplorerParams(M=64, C=16, E=8)))
    titles = [ax.get_title() for ax in fig.axes]
    assert any("C=16" in t for t in titles) and any("chunk size" in t for t in titles)


def test_explorer_widget_updates_on_slider_change():
    pytest.importorskip("ipywidgets")
    box = widgets.explorer(M=128, C=32, E=8)
    assert box.last_view.params.M == 128
    sliders = [w for row in box.children[:2] for w in row.children]
    by_name = {s.description: s for s in sliders}
    assert set(by_name) == {"M tokens", "C chunk", "E experts", "topk", "skew", "EP size"}
    by_name["C chunk"].value = 64
    assert box.last_view.params.C == 64 and box.last_view.counts.shape[0] == 2
    by_name["EP size"].value = 2
    assert box.last_view.counts.shape[1] == 4
    assert "EP rank 0 of 2" in box.children[2].value
    (shown,) = box.children[3].outputs  # one figure, replaced (not appended) on every change
    assert shown["output_type"] == "display_data" and "Figure" in shown["data"]["text/plain"]


def test_explorer_shows_an_error_from_a_slider(monkeypatch):
    pytest.importorskip("ipywidgets")
    box = widgets.explorer(M=64, C=16, E=8)
    monkeypatch.setattr(chunk_explorer, "draw", lambda view: 1 / 0)
    box.children[0].children[0].value = 128
    assert "ZeroDivisionError" in box.children[2].value and box.last_view.params.M == 64
