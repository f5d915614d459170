"""CONTRIBUTING.md's size table: lines and code lines of ``moekit/``, per folder, as ``ruff format`` lays them out.

::

    python -m tools.size_table              # the Markdown table, from the repository root
    python -m tools.size_table --check      # also exit 1 when moekit/ holds more than PACKAGE_BUDGET code lines

The package is copied to a temporary folder with the repository's ``pyproject.toml``, its
``# fmt: skip`` / ``# fmt: off`` / ``# fmt: on`` comments are dropped (so no line keeps a layout
that the formatter would not give it; ``--keep-fmt-directives`` keeps them), and the copy is
formatted with ``ruff format``; the tree itself is never touched.

A physical line is any line of a formatted file. A code line is a line that holds a token of
code: blank lines, comment lines and the lines of docstrings (every statement that is a bare
string: module, class and function docstrings, and attribute docstrings) are not code. Each row
counts a top-level folder of the package with everything under it, after the modules at the top.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
import subprocess
import sys
import tempfile
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_BUDGET = 9000  # code lines of moekit/, held in CI (tests/tools/test_size_table.py); the book: tools/book.py
TOP = "`{}/*.py` (top level)"  # the row of the package's own modules
_FMT_DIRECTIVE = re.compile(r"#\s*fmt:\s*(skip|off|on)\b")
_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENCODING, tokenize.ENDMARKER}  # fmt: skip


@dataclass(frozen=True)
class Count:
    """Physical lines and code lines of some source."""

    lines: int = 0
    code: int = 0

    def __add__(self, other: Count) -> Count:
        return Count(self.lines + other.lines, self.code + other.code)


def docstring_lines(tree: ast.AST) -> set[int]:
    """The line numbers of every statement that is a bare string (a docstring, by use)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def count_source(text: str) -> Count:
    """Physical lines of ``text``, and the lines that hold code (see the module docstring)."""
    docs = docstring_lines(ast.parse(text))
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in _NOT_CODE:
            continue
        rows = set(range(tok.start[0], tok.end[0] + 1))
        if tok.type == tokenize.STRING and rows <= docs:
            continue  # a docstring's own string; code on the same line still counts through its tokens
        code.update(rows)
    return Count(len(text.splitlines()), len(code))


def without_fmt_directives(text: str) -> str:
    """``text`` with every ``# fmt: skip|off|on`` comment cut off its line (a line left empty stays empty)."""
    lines = text.splitlines(keepends=True)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and _FMT_DIRECTIVE.match(tok.string):
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col].rstrip() + "\n"
    return "".join(lines)


def formatted_copy(package: Path, into: Path, *, ruff: str, config: Path | None, keep_fmt: bool = False) -> Path:
    """Copy ``package`` under ``into`` (with ``config``, the repository's pyproject.toml), drop the
    fmt directives unless ``keep_fmt``, run ``ruff format`` on the copy; returns the copy's folder."""
    copy = into / package.name
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    if config is not None:
        shutil.copy(config, into / config.name)
    for path in copy.rglob("*.py") if not keep_fmt else ():
        path.write_text(without_fmt_directives(path.read_text()))
    run = subprocess.run([ruff, "format", "--quiet", str(copy)], cwd=into, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"size_table: expected `{ruff} format` to succeed on the copy, got exit {run.returncode}:\n"
                         f"{run.stdout}{run.stderr}")  # fmt: skip
    return copy


def folder_counts(package: Path) -> dict[str, Count]:
    """``{row label: Count}``: the top-level modules, then each top-level folder with all under it."""
    rows: dict[str, Count] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        label = TOP.format(package.name) if len(rel.parts) == 1 else f"`{rel.parts[0]}`"
        rows[label] = rows.get(label, Count()) + count_source(path.read_text())
    return rows


def markdown_table(rows: dict[str, Count], *, name: str = "moekit") -> str:
    """The table CONTRIBUTING.md shows: the top level first, then folders by lines, then the total."""
    order = sorted(rows, key=lambda label: (label != TOP.format(name), -rows[label].lines, label))
    total = sum(rows.values(), Count())
    lines = ["| folder | lines | code lines |", "|---|---|---|"]
    lines += [f"| {label} | {rows[label].lines} | {rows[label].code} |" for label in order]
    lines.append(f"| **{name}/** | **{total.lines}** | **{total.code}** |")
    return "\n".join(lines)


def default_ruff() -> str | None:
    """The ruff beside this interpreter (a virtual environment's), else the one on PATH."""
    beside = Path(sys.executable).with_name("ruff")
    return str(beside) if beside.is_file() else shutil.which("ruff")


def main(argv: list[str] | None = None) -> int:
    """Print the table; with ``--check N``, return 1 when the total code lines exceed N."""
    ap = argparse.ArgumentParser(prog="python -m tools.size_table", description=__doc__.splitlines()[0])
    ap.add_argument("--package", type=Path, default=ROOT / "moekit", help="the package folder (default: moekit/)")
    ap.add_argument("--ruff", default=default_ruff(), help="the ruff executable (default: beside python, or on PATH)")
    budget = f"exit 1 if the total code lines exceed N (default {PACKAGE_BUDGET})"
    ap.add_argument("--check", type=int, metavar="N", nargs="?", const=PACKAGE_BUDGET, help=budget)
    ap.add_argument("--keep-fmt-directives", action="store_true", help="let `# fmt: skip|off` keep their layout")
    args = ap.parse_args(argv)
    if not args.package.is_dir():
        raise SystemExit(f"size_table: expected a package folder, got {args.package}")
    if not args.ruff:
        raise SystemExit("size_table: expected a ruff executable (pip install ruff, or --ruff PATH), found none")
    config = args.package.parent / "pyproject.toml"
    with tempfile.TemporaryDirectory() as tmp:
        copy = formatted_copy(args.package, Path(tmp), ruff=args.ruff, config=config if config.is_file() else None,
                              keep_fmt=args.keep_fmt_directives)
        rows = folder_counts(copy)
    print(markdown_table(rows, name=args.package.name))
    total = sum(rows.values(), Count()).code
    if args.check is not None and total > args.check:
        print(f"\n{args.package.name}/ holds {total} code lines, more than the {args.check} allowed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
