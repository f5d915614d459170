"""benchmarks/results_view/records.py: recorded benchmark results and anchors, loaded and tabulated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.results_view import records

ROOT = Path(__file__).resolve().parents[3]
ENV = {"gpu": "NVIDIA H200", "date": "2026-11-30"}


def write_records(folder: Path) -> None:
    """One layer, one chunking and one count record, as the harness writes them."""
    anchors = {"vllm_triton": 393.0}
    layer_rows = [
        {"peer": p, "M": M, "us": us, "floor_us": fl, "status": "ok", "anchors_us": anchors if M == 128 else {}}
        for p, M, us, fl in [("triton", 1, 30.0, 17.6), ("triton", 128, 320.0, 281.0), ("torch", 1, 60.0, 17.6)]
    ] + [{"peer": "deep_gemm", "M": 1, "status": "skipped: no deep_gemm"}]
    chunk_rows = [
        {"C": None, "us": 100.0, "floor_us": 50.0, "status": "ok", "ratio_vs_unchunked": 1.0},
        {"C": 256, "us": 120.0, "floor_us": 50.0, "status": "ok", "ratio_vs_unchunked": 1.2},
    ]
    count_rows = [
        {"M": 262144, "topk": 8, "E": 256, "ep": 1, "method": m, "us": us}
        for m, us in [("histogram", 7.0), ("scan", 600.0), ("torch.bincount", 40.0)]
    ]
    payloads = {
        "layer-qwen3_30b_a3b-bf16": {"rows": layer_rows},
        "chunking-qwen3_30b_a3b-bf16": {"rows": chunk_rows},
        "count": {"rows": count_rows, "anchors": {"torch.histc": 19.7, "target": "<= 8"}},
    }
    for name, payload in payloads.items():
        (folder / f"{name}-nvidia-h200-2026-11-30.json").write_text(
            json.dumps({"name": name, "environment": ENV, **payload})
        )


def _record(folder, stem, payload):
    (folder / f"{stem}.json").write_text(json.dumps(payload))


def test_bench_results_loads_sorts_and_summarizes(tmp_path):
    assert records.bench_results(tmp_path) == []
    assert records.bench_results(tmp_path / "missing") == []  # no folder, no records
    write_records(tmp_path)
    loaded = records.bench_results(str(tmp_path))
    assert [r["name"] for r in loaded] == ["chunking-qwen3_30b_a3b-bf16", "count", "layer-qwen3_30b_a3b-bf16"]
    assert [records.kind(r) for r in loaded] == ["chunking", "count", "layer"]
    summary = records.summary_rows(loaded)
    assert summary[2]["rows"] == 4 and summary[2]["ok"] == 3 and summary[0]["gpu"] == "NVIDIA H200"
    assert summary[1]["file"] == "count-nvidia-h200-2026-11-30.json"
    assert [r["peer"] for r in records.ok_rows(loaded[2]["rows"])] == ["triton", "triton", "torch"]


def test_bench_results_reads_other_layouts_and_rejects_non_objects(tmp_path):
    timing = [
        {"rank": 0, "M": m, "quant": q, "dispatch_us": 10.0 * m, "combine_us": 5.0 * m}
        for m in (128, 512)
        for q in ("none", "fp8_block")
    ]
    (tmp_path / "ep-nvidia-h200x2-2026-11-30.json").write_text(json.dumps({"device": "H200", "timing": timing}))
    (tmp_path / "notes.json").write_text('{"hello": 1}')
    ep, notes = records.bench_results(tmp_path)
    assert ep["name"] == "ep-nvidia-h200x2-2026-11-30" and ep["environment"]["date"] == "2026-11-30"
    assert len(ep["rows"]) == 4 and notes["rows"] == []
    assert records.kind(ep) == "ep" and records.kind(notes) == "other"
    (tmp_path / "broken.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="broken.json"):
        records.bench_results(tmp_path)


def test_latest_result_is_the_newest_record_of_that_name(tmp_path):
    assert records.latest_result("count", tmp_path) is None
    for date, us in (("2026-10-01", 9.0), ("2026-12-24", 7.0), ("2026-11-30", 8.0)):
        _record(tmp_path, f"count-nvidia-h200-{date}", {"name": "count", "environment": {"date": date},
                                                        "rows": [{"us": us}]})  # fmt: skip
    _record(tmp_path, "count-other-2027-01-01", {"name": "count-other", "environment": {"date": "2027-01-01"}})
    latest = records.latest_result("count", tmp_path)
    assert latest["environment"]["date"] == "2026-12-24" and latest["rows"] == [{"us": 7.0}]
    assert latest["path"].endswith("count-nvidia-h200-2026-12-24.json")
    assert records.latest_result("layer", tmp_path) is None


def test_latest_result_takes_the_date_from_the_file_name_when_the_record_has_none(tmp_path):
    _record(tmp_path, "ep-h200x2-2026-03-04", {"name": "ep", "device": "H200", "timing": [{"M": 2}]})
    _record(tmp_path, "ep-h200x2-2026-01-02", {"name": "ep", "device": "H200", "timing": [{"M": 1}]})
    latest = records.latest_result("ep", tmp_path)
    assert latest["environment"] == {"gpu": "H200", "date": "2026-03-04"} and latest["rows"] == [{"M": 2}]


def test_an_undated_record_is_not_the_latest(tmp_path):
    _record(tmp_path, "count", {"name": "count", "rows": [{"us": 1.0}]})  # no environment, no date in the name
    _record(tmp_path, "count-h200-2026-11-30", {"name": "count", "environment": {"date": "2026-11-30"},
                                                "rows": [{"us": 2.0}]})  # fmt: skip
    assert records.latest_result("count", tmp_path)["environment"]["date"] == "2026-11-30"


def test_load_anchors_reads_the_repos_anchors_json():
    path = ROOT / "benchmarks" / "anchors.json"
    loaded = records.load_anchors(path)
    assert set(loaded) == {"anchors", "floors"}
    assert loaded["anchors"][("qwen3_30b_a3b", "bf16", 1)] == {"vllm_triton": 89.0, "hf_grouped_mm": 664.0}
    assert loaded["anchors"][("qwen3_30b_a3b", "fp8", 4096)] == {"vllm_triton": 1647.0}
    assert loaded["floors"][("qwen3_30b_a3b", "bf16", 1)] == 17.6
    assert loaded["floors"][("deepseek_v3", "bf16", 16384)] == 14600.0
    raw = json.loads(path.read_text())
    assert len(loaded["anchors"]) == len(raw["anchors"]) and len(loaded["floors"]) == len(raw["floors"])
    assert records.load_anchors(str(path)) == loaded


COUNT_ROWS = [
    {"M": 4096, "topk": 8, "E": 128, "method": "histogram", "us": 7.04, "graph_us": 3.96},
    {"M": 4096, "topk": 8, "E": 128, "method": "bincount", "us": 40.26},
    {"M": 16, "topk": 2, "E": 8, "ep": 2, "method": "histogram", "us": 5.56, "graph_us": 2.0},
    {"M": 16, "topk": 2, "E": 8, "ep": 2, "method": "bincount", "us": 30.0, "graph_us": 9.0},
    {"M": 16, "topk": 2, "E": 8, "method": "scan", "status": "skipped: too slow"},
    {"M": 16, "topk": 2, "E": 8, "method": "broken", "us": None},
]


def test_count_timing_rows():
    rows = records.count_timing_rows({"rows": COUNT_ROWS})
    assert len(rows) == 4  # the skipped row and the one without a time are left out
    assert rows[0] == {"ids": "4096x8", "E": 128, "ep": 1, "method": "histogram", "eager us": 7.0, "graph us": 4.0}
    assert rows[1]["graph us"] is None and rows[1]["eager us"] == 40.3
    assert rows[2]["ep"] == 2 and rows[2]["ids"] == "16x2" and rows[2]["eager us"] == 5.6
    assert records.count_timing_rows({"rows": []}) == []
