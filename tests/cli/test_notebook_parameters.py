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


@pytest.mark.parametrize(
    "key, value, why",
    [("M", "abc", "is not a number"), ("M", [1, 2], "is not a number"), ("M", -5, "must be >= 0"),
     ("M", True, "is not a number"), ("M", 1.5, "is not a number"), ("seed", "x", "is not a number"),
     ("skew", "hot", "not a real number"), ("router", 3, "is a int; the default ('uniform') is a str")],
)  # fmt: skip
def test_an_override_of_another_type_than_the_default_is_refused_with_exit_2(capsys, key, value, why):
    """The walkthrough refuses it before any notebook runs (they used to die inside torch)."""
    nb = Path("02_workspace_shape_crash.ipynb")
    declared = {"M": 130, "seed": 0, "skew": 0.5, "router": "uniform"}
    with pytest.raises(SystemExit) as exit_:
        notebook_parameters.parameters_for(nb, declared, {}, [("02", key, value)])
    assert exit_.value.code == 2 and why in capsys.readouterr().err
    ok = {"M": 0, "seed": -1, "skew": 0, "router": "skewed"}[key]  # the same kind of value passes
    assert notebook_parameters.parameters_for(nb, declared, {}, [("02", key, ok)]) == {key: ok}
