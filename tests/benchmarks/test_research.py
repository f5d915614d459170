"""The finished experiments in benchmarks/research still import, and the index lists each of them."""

import importlib
from pathlib import Path

import pytest

RESEARCH = Path(__file__).resolve().parents[2] / "benchmarks" / "research"
SCRIPTS = sorted(p.stem for p in RESEARCH.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_experiment_imports_and_has_a_main(name):
    assert callable(importlib.import_module(f"benchmarks.research.{name}").main)


def test_the_index_lists_every_experiment_once():
    index = (RESEARCH / "README.md").read_text()
    listed = [line.split("`")[1] for line in index.splitlines() if line.startswith("- `")]
    assert sorted(listed) == sorted(f"{name}.py" for name in SCRIPTS)
