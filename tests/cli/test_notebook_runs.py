"""moekit.cli.notebook_runs: the figures of an executed notebook, and the table printed at the end."""

from __future__ import annotations

import base64
import json
import os

from moekit.cli import notebook_runs


def test_summary_counts_the_notebooks_that_passed():
    results = [notebook_runs.Result("01_a", seconds=1.25), notebook_runs.Result("02_long_name", 2.5, "FAILED", "boom")]
    lines = notebook_runs.summary(results).splitlines()
    assert lines[0].split() == ["notebook", "seconds", "status"]
    assert lines[2].split() == ["01_a", "1.2", "ok"] and lines[3].split() == ["02_long_name", "2.5", "FAILED"]
    assert lines[-1].split() == ["total", "3.8", "1/2", "ok"]
    assert notebook_runs.summary(results, wall_seconds=2.6).splitlines()[-1].split() == ["wall", "clock", "2.6"]


def test_extract_figures_saves_each_tagged_png(tmp_path):
    png = b"\x89PNG\r\n\x1a\n" + os.urandom(16)
    output = {"output_type": "display_data", "data": {"image/png": base64.b64encode(png).decode()}, "metadata": {}}
    cells = [
        {"cell_type": "code", "metadata": {"tags": ["figure:one"]}, "outputs": [output]},
        {"cell_type": "code", "metadata": {"tags": ["other"]}, "outputs": [output]},
        {"cell_type": "code", "metadata": {"tags": ["figure:none"]}, "outputs": []},
    ]
    executed = tmp_path / "01_x.ipynb"
    executed.write_text(json.dumps({"cells": cells}))
    assert notebook_runs.extract_figures(executed, tmp_path / "figures") == ["one.png"]
    assert (tmp_path / "figures" / "one.png").read_bytes() == png
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["one.png"]
