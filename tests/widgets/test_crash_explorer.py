"""moekit.widgets.crash_explorer, headless: the bug-1 view runs the real pre-fix and fixed loops."""

from __future__ import annotations

import pytest

from moekit.plan import chunk_ranges
from moekit.widgets import CrashParams, crash_explorer, crash_view, pre_fix_crashes
from moekit.widgets.crash_explorer import draw, slider_end

pytest.importorskip("matplotlib")


def crosses(M: int, C: int) -> bool:
    """The pre-fix loop crashes when DeepGEMM declared the whole output (M >= 128) and some chunk
    runs Triton (fewer than 128 tokens)."""
    return M >= 128 and any(r.size < 128 for r in chunk_ranges(M, C))


def test_the_plan_says_when_the_pre_fix_loop_crashes():
    for M in (1, 127, 128, 130, 255, 256, 257, 600, 1000):
        for C in (1, 64, 127, 128, 129, 500, 512, 600, 2000):
            assert pre_fix_crashes(M, C) == crosses(M, C), (M, C)
    assert not pre_fix_crashes(130, 128, N=192), "no DeepGEMM-declared output unless N and K are 128-aligned"


def test_sliders_reach_past_their_starting_values():
    assert slider_end(130) == 512 and slider_end(1000) == 2048 and slider_end(700, 600) == 1408
    assert all(slider_end(v) >= v and slider_end(v) % 128 == 0 for v in (1, 511, 512, 513, 4097))


@pytest.mark.parametrize("M, C", [(130, 128), (127, 128), (256, 128), (257, 64)])
def test_view_runs_both_loops(M, C):
    view = crash_view(CrashParams(M=M, C=C, E=4))
    assert (view.error is not None) == crosses(M, C), view.summary()
    title = draw(view).axes[0].get_title()
    assert title.replace("\n", " ") == view.summary(), "the figure's title is the whole summary, wrapped"
    assert len(view.fixed) == len(chunk_ranges(M, C)) and all(c.completed for c in view.fixed)
    if view.error is not None:
        assert "Dimension out of range" in str(view.error) and "crashed at chunk" in view.summary()
        failed = [c for c in view.pre_fix if not c.completed]
        assert len(failed) == 1 and failed[0].backend == "triton"
        row = view.pre_fix.handed_vs_needed()[failed[0].index]
        assert len(row["output handed"]) == 2 and len(row["output needed"]) == 3
    else:
        assert "ran through" in view.summary()


def test_widget_updates_when_a_slider_moves():
    pytest.importorskip("ipywidgets")
    box = crash_explorer(M=130, C=128, E=4)
    assert box.last_view.error is not None
    sliders = box.children[0].children
    assert (sliders[0].max, sliders[1].max) == (512, 512)
    sliders[1].value = 256  # C = 256 >= M: one chunk, DeepGEMM only
    assert box.last_view.params.C == 256 and box.last_view.error is None
