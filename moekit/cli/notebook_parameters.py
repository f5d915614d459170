"""The walkthrough's notebook parameters: what a notebook declares, and which overrides apply to it.

A notebook declares its parameters in the cell tagged ``parameters``; the command line overrides
them with ``-p NAME VALUE`` (every notebook that declares NAME) or ``NN:NAME=VALUE`` (one notebook).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def parse_value(text: str):
    """A Python literal if ``text`` is one (``256``, ``0.5``, ``'x'``, ``None``), else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def declared_parameters(notebook: Path) -> dict[str, object]:
    """Names and default values assigned in the cell tagged ``parameters`` (parsed with ``ast``).

    papermill's own inspector skips any line holding two ``=`` (a comment like ``# 0 = uniform``).
    """
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            assigns = [node for node in ast.parse(src).body if isinstance(node, ast.Assign)]
            return {t.id: ast.literal_eval(a.value) for a in assigns for t in a.targets if isinstance(t, ast.Name)}
    return {}


def parameters_for(notebook: Path, declared: dict, global_params: dict, scoped: list[tuple[str, str, object]]):
    """The overrides that apply to ``notebook``: global ones it declares, plus ``NN:name=value``."""
    params = {k: v for k, v in global_params.items() if k in declared}
    for scope, key, value in scoped:
        if notebook.stem == scope or notebook.stem.split("_")[0] == scope:
            if key not in declared:
                raise SystemExit(
                    f"moekit walkthrough: {notebook.name} has no parameter {key!r} "
                    f"(it has {', '.join(declared) or 'none'})"
                )
            params[key] = value
    for key, value in params.items():
        problem = override_problem(value, declared[key])
        if problem:
            print(f"moekit walkthrough: {notebook.stem}: {key}={value!r} {problem}", file=sys.stderr)
            raise SystemExit(2)
    return params


def override_problem(value, default) -> str:
    """Why ``value`` cannot replace a notebook's ``default`` (its type; and its sign where the default
    is a positive int: a size or a count), or "" when it can. A default of None takes anything."""
    if default is None:
        return ""
    if isinstance(default, bool) or not isinstance(default, int | float):
        if type(value) is type(default):
            return ""
        return f"is a {type(value).__name__}; the default ({default!r}) is a {type(default).__name__}"
    number = (int, float) if isinstance(default, float) else (int,)
    if isinstance(value, bool) or not isinstance(value, number):
        return f"is not a{'' if number == (int,) else ' real'} number like the default ({default!r})"
    if isinstance(default, int) and default > 0 and value < 0:
        return f"must be >= 0: the default ({default!r}) is a size or a count"
    return ""


def scoped_overrides(items: list[str]) -> list[tuple[str, str, object]]:
    """``NN:NAME=VALUE`` items as ``(NN, NAME, value)``, the value read by :func:`parse_value`.

    An item of any other form ends the command (SystemExit) with a message that names it.
    """
    out = []
    for item in items:
        scope, sep, rest = item.partition(":")
        key, eq, value = rest.partition("=")
        if not sep or not eq or not key:
            raise SystemExit(f"moekit walkthrough: expected NN:NAME=VALUE, got {item!r}")
        out.append((scope, key, parse_value(value)))
    return out
