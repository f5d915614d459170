"""Execute every notebook with papermill, as `make walkthrough` does, at small CPU parameters.

A failing cell fails the test with papermill's message (cell, error, traceback). Executed copies
are kept under build/test-notebooks/ as artifacts. The kernel is this interpreter (a kernelspec
written by ``moekit.cli.walkthrough.use_moekit_kernel``), so it imports this checkout's moekit, and
``moekit.device`` picks the Triton interpreter on a CPU machine.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moekit.cli import walkthrough

pm = pytest.importorskip("papermill")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ARTIFACTS = ROOT / "build" / "test-notebooks"
BUDGET_S = 120  # each notebook targets <= 60 s on 2 cores; fail loudly well before the global timeout

# Parameters that keep CI small where a notebook's defaults are larger than a test needs.
SMALL: dict[str, dict] = {}
# The two bug notebooks compute every check from their plan: they must hold away from the
# defaults too (a switch in the last chunk, no chunk under the switch, every chunk under it).
OTHER_PARAMETERS = {
    "02_workspace_shape_crash": [dict(M=300, C=128), dict(M=127, C=128), dict(M=257, C=64)],
    "05_stale_token_counts": [dict(M=300, C=128), dict(M=127, C=128), dict(M=257, C=64)],
}

pytestmark = pytest.mark.notebooks


@pytest.fixture(scope="module")
def kernel_name():
    return walkthrough.use_moekit_kernel()


def test_found_notebooks():
    assert len(NOTEBOOKS) >= 6, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    pm.execute_notebook(
        str(path),
        str(ARTIFACTS / path.name),
        parameters=SMALL.get(path.stem, {}),
        kernel_name=kernel_name,
        cwd=str(path.parent),
        progress_bar=False,
        execution_timeout=BUDGET_S,
    )
    seconds = time.perf_counter() - start
    assert seconds < BUDGET_S, f"{path.name} took {seconds:.0f} s (budget {BUDGET_S} s)"


@pytest.mark.parametrize(
    "stem, params",
    [(stem, params) for stem, sets in OTHER_PARAMETERS.items() for params in sets],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_bug_notebooks_hold_at_other_parameters(stem, params, kernel_name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ROOT / "notebooks" / f"{stem}.ipynb"
    pm.execute_notebook(str(path), str(ARTIFACTS / f"{stem}-{'-'.join(map(str, params.values()))}.ipynb"),
                        parameters=params, kernel_name=kernel_name, cwd=str(path.parent), progress_bar=False,
                        execution_timeout=BUDGET_S)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# moekit.cli.walkthrough (the runner behind `make walkthrough`), on two tiny notebooks


def _notebook(path: Path, params: str, body: str, *, tags=()):
    import json

    cells = [
        {"cell_type": "markdown", "id": "0", "metadata": {}, "source": "# t\nYou will learn"},
        {
            "cell_type": "code",
            "id": "1",
            "metadata": {"tags": ["parameters"]},
            "source": params,
            "outputs": [],
            "execution_count": None,
        },
        {
            "cell_type": "code",
            "id": "2",
            "metadata": {"tags": list(tags)},
            "source": body,
            "outputs": [],
            "execution_count": None,
        },
    ]
    nb = {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


def test_declared_parameters_reads_what_papermill_skips(tmp_path):
    _notebook(tmp_path / "01_a.ipynb", "M = 130  # tokens (M = 130 crosses the switch)\nsizes = [1, 2]", "pass")
    assert walkthrough.declared_parameters(tmp_path / "01_a.ipynb") == {"M": 130, "sizes": [1, 2]}


def test_parameters_for():
    nb = Path("02_workspace_shape_crash.ipynb")
    declared = {"M": 130, "C": 128}
    scoped = [("02", "C", 64), ("03", "M", 1)]
    assert walkthrough.parameters_for(nb, declared, {"M": 256, "E": 4}, scoped) == {"M": 256, "C": 64}
    with pytest.raises(SystemExit, match="no parameter 'E'"):
        walkthrough.parameters_for(nb, declared, {}, [("02", "E", 4)])
    assert walkthrough.parse_value("0.5") == 0.5 and walkthrough.parse_value("abc") == "abc"


def test_walkthrough_main(tmp_path, capsys):
    pytest.importorskip("nbconvert")
    nbs, out, docs = tmp_path / "notebooks", tmp_path / "out", tmp_path / "docs"
    nbs.mkdir()
    plot = "from moekit import viz\nassert M == 7\nviz.plot_tokens_per_expert([1, 2, 3])"
    _notebook(nbs / "01_ok.ipynb", "M = 1", plot, tags=["figure:tiny"])
    _notebook(nbs / "02_fails.ipynb", "M = 1", "raise ValueError('boom')")
    args = ["--notebooks", str(nbs), "--out", str(out), "--update-docs", "--docs-dir", str(docs)]
    assert walkthrough.main([*args, "--only", "01", "-p", "M", "7"]) == 0
    assert (out / "01_ok.html").exists() and (out / "index.html").exists()
    assert (out / "figures" / "tiny.png").read_bytes().startswith(b"\x89PNG")
    assert (docs / "tiny.png").exists()
    assert walkthrough.main([*args, "01:M=7"]) == 1  # 02 fails: exit status 1, docs untouched
    printed = capsys.readouterr()
    assert "02_fails" in printed.out and "FAILED" in printed.out and "boom" in printed.err
    assert "FAILED" in (out / "index.html").read_text()
    # `--only 01 01:M=7` keeps the override (argparse hands it to --only); a prefix that matches
    # nothing, or an override for a notebook outside the run, is an error that lists the notebooks.
    assert walkthrough.main([*args, "--only", "01", "01:M=7"]) == 0
    assert walkthrough.main([*args, "--only", "99"]) == 2
    assert walkthrough.main([*args, "--only", "01", "02:M=7"]) == 2
    printed = capsys.readouterr()
    assert "no notebook matches '99'" in printed.err and "01_ok, 02_fails" in printed.err
    assert "names no notebook of this run" in printed.err
