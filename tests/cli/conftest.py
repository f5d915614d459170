"""What the cli tests share: ``write_notebook``, a tiny notebook (a markdown cell, a parameters cell, one code cell)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def write_notebook():
    """``write_notebook(path, params, body, tags=())``: write that notebook to ``path``."""
    return _notebook


def _notebook(path: Path, params: str, body: str, *, tags=()):
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
