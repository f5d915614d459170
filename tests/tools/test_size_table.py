"""tools/size_table.py: what counts as a code line, the fmt directives, the table, and --check."""

from __future__ import annotations

import textwrap

import pytest

from tools import size_table
from tools.size_table import Count, count_source, markdown_table, without_fmt_directives

SAMPLE = textwrap.dedent('''\
    """A module docstring
    over two lines."""

    import os  # a trailing comment: the line is code

    # a comment line
    USAGE = """text that is data,
    not a docstring"""


    class A:
        """Class docstring."""

        x: int = 1
        """An attribute docstring."""

        def f(self, a,
              # a comment inside the brackets
              b):
            """Function docstring.

            More.
            """
            return (a +
                    b)
    ''')


def test_code_lines_leave_out_docstrings_comments_and_blanks():
    # code: import os, USAGE's two lines, class A, x, def f's two lines with code, return's two lines
    assert count_source(SAMPLE) == Count(lines=len(SAMPLE.splitlines()), code=9)
    assert count_source("") == Count(0, 0)
    assert count_source("x = 1\n\n\n") == Count(3, 1)


def test_a_docstring_sharing_its_line_with_code_leaves_the_code_counted():
    assert count_source('def f(): """doc"""\n').code == 1
    assert count_source('def f():\n    """doc"""\n    return 1\n').code == 2


def test_fmt_directives_are_cut_and_nothing_else():
    text = 'x = [1,  2]  # fmt: skip\ny = "# fmt: skip"\n# fmt: off\nz = 3  # why\n# fmt: on\n'
    assert without_fmt_directives(text) == 'x = [1,  2]\ny = "# fmt: skip"\n\nz = 3  # why\n\n'


def test_the_table_puts_the_top_level_first_and_sums_the_rest():
    rows = {"`viz`": Count(5, 3), "`moekit/*.py` (top level)": Count(2, 1), "`kernels`": Count(9, 6)}
    assert markdown_table(rows).splitlines() == [
        "| folder | lines | code lines |",
        "|---|---|---|",
        "| `moekit/*.py` (top level) | 2 | 1 |",
        "| `kernels` | 9 | 6 |",
        "| `viz` | 5 | 3 |",
        "| **moekit/** | **16** | **10** |",
    ]


@pytest.mark.skipif(size_table.default_ruff() is None, reason="needs ruff")
def test_main_formats_a_copy_counts_per_folder_and_checks(tmp_path, capsys):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Doc."""\nx = [1,2,\n  3]  # fmt: skip\n')
    (pkg / "sub" / "m.py").write_text("def f(a,b):\n    return a+b\n")
    before = {p: p.read_text() for p in pkg.rglob("*.py")}
    assert size_table.main(["--package", str(pkg)]) == 0
    table = capsys.readouterr().out
    assert "| `pkg/*.py` (top level) | 3 | 1 |" in table  # docstring, blank, `x = [1, 2, 3]` once formatted
    assert "| `sub` | 2 | 2 |" in table and "| **pkg/** | **5** | **3** |" in table
    assert {p: p.read_text() for p in pkg.rglob("*.py")} == before  # the tree is never formatted
    assert size_table.main(["--package", str(pkg), "--keep-fmt-directives"]) == 0
    assert "| **pkg/** | **6** | **4** |" in capsys.readouterr().out  # the skipped layout kept: two lines
    assert size_table.main(["--package", str(pkg), "--check", "3"]) == 0
    assert size_table.main(["--package", str(pkg), "--check", "2"]) == 1
    assert "holds 3 code lines, more than the 2 allowed" in capsys.readouterr().err


def test_a_missing_package_is_named(tmp_path):
    with pytest.raises(SystemExit, match="expected a package folder"):
        size_table.main(["--package", str(tmp_path / "nothing")])


@pytest.mark.skipif(size_table.default_ruff() is None, reason="needs ruff")
def test_the_package_holds_its_budget(capsys):
    # The budget of the book-and-wing issue: moekit/ at most 9000 code lines as ruff formats them.
    assert size_table.PACKAGE_BUDGET == 9000
    assert size_table.main(["--check"]) == 0, capsys.readouterr().err
