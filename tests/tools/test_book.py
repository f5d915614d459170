"""tools/book.py: the book's budgets hold for a learner's forward, the book never imports the wing,
and docs/reading_order.md is current."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tools import book

ROOT = Path(__file__).resolve().parents[2]
# The book is measured as ruff formats it (tools.size_table); a machine without ruff (the GPU image) skips.
pytestmark = pytest.mark.skipif(book.default_ruff() is None, reason="needs ruff (pip install ruff)")


@pytest.fixture(scope="module")
def report():
    return book.measure()


def test_a_learners_forward_keeps_the_budgets(report):
    """A 4-chunk CPU forward: at most 3,000 formatted code lines loaded, 16 files entered, 15
    constexprs in its widest kernel, the count kernel once per chunk, nothing of the wing."""
    assert report["chunks"] == 4
    assert report["max_error"] < 0.1, "the learner's forward must still match the reference (bf16)"
    for key, limit in book.BUDGETS.items():
        assert report[key] <= limit, f"{key}: {report[key]} > {limit}"
    assert report["count_launches"] == report["chunks"] and all(report["chunk_counts"])
    assert not [f for f in report["loaded"] if f.startswith("hopper/")]


def test_the_forward_loads_only_the_book(report):
    book_files = set(book.READING_ORDER) | set(book.PACKAGE_INITS)
    assert set(report["loaded"]) <= book_files, sorted(set(report["loaded"]) - book_files)
    assert set(report["entered"]) <= set(book.READING_ORDER)


def test_no_book_module_imports_the_wing():
    for rel in book.READING_ORDER + book.PACKAGE_INITS:
        tree = ast.parse((ROOT / "moekit" / rel).read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not [n for n in names if n.startswith("moekit.hopper")], f"{rel} imports {names}"


def test_reading_order_doc_is_current():
    assert (ROOT / "docs" / "reading_order.md").read_text() == book.reading_order(), (
        "run `python -m tools.book --reading-order > docs/reading_order.md`"
    )


def test_constexpr_counts_reads_jit_kernels(tmp_path):
    src = tmp_path / "k.py"
    kernel = "@triton.jit\ndef k(x, A: tl.constexpr, B: tl.constexpr):\n    pass\n"
    src.write_text("import triton\nimport triton.language as tl\n" + kernel + "def host(a: int):\n    pass\n")
    assert book.constexpr_counts(src) == {"k": 2}
