"""Recorded benchmark results (``benchmarks/results/*.json``): load them and tabulate them.

The files are written by ``python -m benchmarks.harness`` (and the ``benchmarks/gpu_*`` checks):
each holds ``{"name", "environment", "rows", ...}``. Every reader takes the folder or file to
read; nothing here knows where a checkout keeps its results.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

KINDS = ("layer", "chunking", "count", "ep")


def bench_results(directory: str | Path) -> list[dict]:
    """Every ``*.json`` record under ``directory``, sorted by name then date.

    Each record gets ``path``, and ``name``/``environment``/``rows`` even when its writer used
    another layout (the EP all-to-all bench writes ``device`` and ``timing``): the name then
    comes from the file name. A folder that does not exist holds no records.

    Raises:
        ValueError: a file holds anything but a JSON object (named, so a broken result cannot
            silently drop out of the plots).
    """
    records = []
    for path in sorted(Path(directory).glob("*.json")):
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError(f"{path} is not a benchmark record (expected a JSON object)")
        records.append(_normalized(record, path))
    return sorted(records, key=lambda r: (r["name"], r["environment"].get("date", "")))


def latest_result(name: str, directory: str | Path) -> dict | None:
    """The newest record under ``directory`` whose name is ``name`` (by its date), or None."""
    matching = [r for r in bench_results(directory) if r["name"] == name]
    dated = lambda r: r["environment"].get("date", "")[:4].isdigit()  # an undated record ("?") is never newer
    return max(matching, key=lambda r: (dated(r), r["environment"].get("date", ""), r["path"])) if matching else None


def load_anchors(path: str | Path) -> dict:
    """``benchmarks/anchors.json``: ``{(shape, dtype, M): {peer: us}}`` and the recorded floors
    ``{(shape, dtype, M): us}``, as ``{"anchors": ..., "floors": ...}``."""
    data = json.loads(Path(path).read_text())
    key = lambda e: (e["shape"], e["dtype"], e["M"])
    anchors = {key(e): e["values"] for e in data["anchors"]}
    return {"anchors": anchors, "floors": {key(e): e["us"] for e in data["floors"]}}


def kind(record: dict) -> str:
    """``"layer"``, ``"chunking"``, ``"count"``, ``"ep"`` or ``"other"``, from the record's name."""
    return next((k for k in KINDS if record["name"].startswith(k)), "other")


def ok_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows that ran (status ``"ok"``, or none recorded) and hold a time."""
    return [r for r in rows if r.get("status", "ok") == "ok" and r.get("us")]


def summary_rows(records: Sequence[dict]) -> list[dict]:
    """One row per record: name, GPU, date, how many rows, and how many of them are ok."""
    return [
        {
            "name": r["name"],
            "gpu": r.get("environment", {}).get("gpu", "?"),
            "date": r.get("environment", {}).get("date", "?"),
            "rows": len(r["rows"]),
            "ok": sum(row.get("status", "ok") == "ok" for row in r["rows"]),
            "file": Path(r.get("path", "")).name,
        }
        for r in records
    ]


def count_timing_rows(record: dict) -> list[dict]:
    """One row per (case, method) of a count record: eager and CUDA-graph medians, rounded."""
    rows = []
    for r in ok_rows(record["rows"]):
        graph = r.get("graph_us")
        rows.append(
            {
                "ids": f"{r['M']}x{r['topk']}",
                "E": r["E"],
                "ep": r.get("ep", 1),
                "method": r["method"],
                "eager us": round(r["us"], 1),
                "graph us": None if graph is None else round(graph, 1),
            }
        )
    return rows


def _normalized(record: dict, path: Path) -> dict:
    stem = path.stem
    date = stem[-10:] if len(stem) > 10 and stem[-10:-6].isdigit() else "?"
    record.setdefault("name", stem)
    record.setdefault("environment", {"gpu": record.get("device", "?"), "date": date})
    rows = record.get("rows")
    if not isinstance(rows, list):
        rows = record.get("timing") if isinstance(record.get("timing"), list) else []
    record["rows"], record["path"] = rows, str(path)
    return record
