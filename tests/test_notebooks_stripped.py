"""Stored notebooks are stripped (no outputs, no execution counts) and follow the notebook layout.

Layout (../STYLE.md item 12): cell 1 is a markdown title, cell 2 is tagged ``parameters`` and
holds literals only, cell 3 imports moekit, and no cell uses the ``raises-exception`` tag.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stripped(path):
    nb = _load(path)
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        assert cell.get("outputs") == [], f"{path.name} cell {i} has outputs; run `make strip`"
        assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb.get("metadata", {}), f"{path.name} stores widget state"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_layout(path):
    cells = _load(path)["cells"]
    assert cells[0]["cell_type"] == "markdown" and _source(cells[0]).lstrip().startswith("# ")
    assert "You will learn" in _source(cells[0]), f"{path.name}: cell 1 must say what you will learn"
    params = cells[1]
    assert params["cell_type"] == "code" and "parameters" in params["metadata"].get("tags", [])
    for line in _source(params).splitlines():  # papermill's inspector skips lines with two "="
        assert line.count("=") <= 1, f"{path.name}: keep '=' out of parameter comments: {line!r}"
    for node in ast.parse(_source(params)).body:
        assert isinstance(node, ast.Assign), f"{path.name}: the parameters cell holds assignments only"
        ast.literal_eval(node.value)  # literals only, so papermill and the walkthrough can override them
    assert "import moekit" in _source(cells[2]) or "from moekit" in _source(cells[2])
    for cell in cells:
        assert "raises-exception" not in cell["metadata"].get("tags", []), "use moekit.testing.expect_raises"


def test_nbstripout_verify():
    """The same check as the pre-commit hook: nbstripout would change nothing."""
    pytest.importorskip("nbstripout")
    run = subprocess.run(
        [sys.executable, "-m", "nbstripout", "--verify", *map(str, NOTEBOOKS)], capture_output=True, text=True
    )
    assert run.returncode == 0, (
        f"nbstripout would change these notebooks; run `make strip`\n{run.stdout}{run.stderr}"
    )
