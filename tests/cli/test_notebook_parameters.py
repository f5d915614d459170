"""moekit.cli.notebook_parameters: what a notebook declares, and which overrides apply to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from moekit.cli import notebook_parameters


def test_declared_parameters_reads_what_papermill_skips(tmp_path, write_notebook):
    write_notebook(tmp_path / "01_a.ipynb", "M = 130  # tokens (M = 130 crosses the switch)\nsizes = [1, 2]", "pass")
    assert notebook_parameters.declared_parameters(tmp_path / "01_a.ipynb") == {"M": 130, "sizes": [1, 2]}


def test_parameters_for():
    nb = Path("02_workspace_shape_crash.ipynb")
    declared = {"M": 130, "C": 128}
    scoped = [("02", "C", 64), ("03", "M", 1)]
    assert notebook_parameters.parameters_for(nb, declared, {"M": 256, "E": 4}, scoped) == {"M": 256, "C": 64}
    with pytest.raises(SystemExit, match="no parameter 'E'"):
        notebook_parameters.parameters_for(nb, declared, {}, [("02", "E", 4)])
    assert notebook_parameters.parse_value("0.5") == 0.5 and notebook_parameters.parse_value("abc") == "abc"
