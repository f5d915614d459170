"""tools/mutation.py: its table follows the code (every mutant's text is in its file, exactly once),
and a mutant is planted, caught and taken out again in a copy of the tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import mutation


def test_every_mutant_still_fits_the_tree():
    assert mutation.check_table() == []


def test_a_mutant_whose_text_is_gone_is_named(tmp_path):
    (tmp_path / "moekit").mkdir()
    for m in mutation.MUTANTS:
        path = tmp_path / m.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("nothing here\n")
    problems = mutation.check_table(tmp_path)
    assert any("its text is missing in moekit/validate.py" in p for p in problems), problems


@pytest.mark.slow
def test_one_mutant_is_caught_and_the_tree_is_left_as_it_was(capsys):
    name = "reduce: last slot dropped"
    before = (Path(mutation.ROOT) / "moekit/kernels/reduce.py").read_text()
    assert mutation.main(["--only", name]) == 0
    out = capsys.readouterr().out
    assert f"caught                 {name}" in out and "1 mutants: 1 caught, 0 survived" in out, out
    assert (Path(mutation.ROOT) / "moekit/kernels/reduce.py").read_text() == before
