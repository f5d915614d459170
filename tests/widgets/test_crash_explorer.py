"""moekit.widgets.crash_explorer, headless: the bug-1 view runs the real pre-fix and fixed loops."""

from __future__ import annotations

import pytest

from moekit.plan import chunk_ranges
from moekit.widgets import CrashParams, crash_explorer, crash_view

pytest.importorskip("matplotlib")


def crosses(M: int, C: int) -> bool:
    """The pre-fix loop crashes when DeepGEMM declared the whole output (M >= 128) and some chunk
    runs Triton (fewer than 128 tokens)."""
    return M >= 128 and any(r.size < 128 for r in chunk_ranges(M, C))


@pytest.mark.parametrize("M, C", [(130, 128), (127, 128), (256, 128), (257, 64)])
def test_view_runs_both_loops(M, C):
    view = crash_view(CrashParams(M=M, C=C, E=4))
    assert (view.error is not None) == crosses(M, C), view.summary()
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
    sliders[1].value = 256  # C = 256 >= M: one chunk, DeepGEMM only
    assert box.last_view.params.C == 256 and box.last_view.error is None
