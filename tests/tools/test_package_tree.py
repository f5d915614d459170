"""tools/package_tree.py: the tree CONTRIBUTING.md shows is the package's, line for line."""

from __future__ import annotations

from tools import package_tree


def test_contributing_holds_the_packages_tree():
    assert package_tree.main(["--check"]) == 0, "run `python -m tools.package_tree` and paste its block"


def test_each_line_is_a_file_and_its_docstring(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package.\n\nMore."""\n')
    (pkg / "sub" / "__init__.py").write_text('"""A ``sub`` package."""\n')
    (pkg / "sub" / "mod.py").write_text("x = 1\n")
    (pkg / "table.json").write_text("{}")
    lines = package_tree.tree_lines(pkg)
    assert [line.split()[0] for line in lines] == ["pkg/", "sub/", "mod.py", "table.json"]
    assert lines[0].endswith("The package.") and lines[1].endswith("A `sub` package.")
    assert lines[3].endswith("data: table.json")
