"""Print the package's tree for CONTRIBUTING.md: one line per file or folder, its docstring's first line.

    python -m tools.package_tree            # the tree of moekit/, as a fenced block
    python -m tools.package_tree --check    # exit 1 unless CONTRIBUTING.md holds exactly this tree

Files are read as text (``ast``), nothing is imported; a data file is named ``data: ...``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 44  # the column the descriptions start at
DATA = {"fused_moe_tiles.json": "the Hopper tile table of the grouped GEMM (moekit.hopper.configs)"}


def first_line(path: Path) -> str:
    """A module's (or package's ``__init__``'s) docstring, first line; ``data: <name>`` for other files."""
    if path.is_dir():
        init = path / "__init__.py"
        return first_line(init) if init.exists() else ""
    if path.suffix != ".py":
        return f"data: {DATA.get(path.name, path.name)}"
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    return doc.strip().splitlines()[0].replace("``", "`") if doc.strip() else ""  # Markdown, not reST


def tree_lines(package: Path) -> list[str]:
    lines = [f"{package.name + '/':<{WIDTH}}{first_line(package)}"]

    def walk(folder: Path, depth: int) -> None:
        entries = sorted(p for p in folder.iterdir() if p.name != "__pycache__" and not p.name.startswith("."))
        for p in [e for e in entries if e.is_dir()] + [e for e in entries if e.is_file() and e.name != "__init__.py"]:
            name = "    " * depth + p.name + ("/" if p.is_dir() else "")
            lines.append(f"{name:<{WIDTH}}{first_line(p)}".rstrip())
            if p.is_dir():
                walk(p, depth + 1)

    walk(package, 1)
    return lines


def block(package: Path) -> str:
    return "```\n" + "\n".join(tree_lines(package)) + "\n```"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.package_tree", description=__doc__.splitlines()[0])
    ap.add_argument("--package", type=Path, default=ROOT / "moekit")
    ap.add_argument("--check", action="store_true", help="exit 1 unless CONTRIBUTING.md holds this tree")
    args = ap.parse_args(argv)
    if not args.package.is_dir():
        raise SystemExit(f"package_tree: expected a package folder, got {args.package}")
    text = block(args.package)
    if args.check:
        contributing = (args.package.parent / "CONTRIBUTING.md").read_text()
        if text not in contributing:
            print("CONTRIBUTING.md's tree is out of date: python -m tools.package_tree", file=sys.stderr)
            return 1
        return 0
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
