"""benchmarks/results_view/plots.py: recorded benchmark results plotted, headless."""

from __future__ import annotations

import io
import json

import pytest

from benchmarks.results_view import plots, records

pytest.importorskip("matplotlib")

COUNT_ROWS = [
    {"M": 4096, "topk": 8, "E": 128, "method": "histogram", "us": 7.04, "graph_us": 3.96},
    {"M": 4096, "topk": 8, "E": 128, "method": "bincount", "us": 40.26},
    {"M": 16, "topk": 2, "E": 8, "ep": 2, "method": "histogram", "us": 5.56, "graph_us": 2.0},
    {"M": 16, "topk": 2, "E": 8, "ep": 2, "method": "bincount", "us": 30.0, "graph_us": 9.0},
    {"M": 16, "topk": 2, "E": 8, "method": "scan", "status": "skipped: too slow"},
]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _write_records(folder):
    layer_rows = [
        {"peer": p, "M": M, "us": us, "floor_us": fl, "anchors_us": {"vllm_triton": 393.0} if M == 128 else {}}
        for p, M, us, fl in [("triton", 1, 30.0, 17.6), ("triton", 128, 320.0, 281.0), ("torch", 1, 60.0, 17.6)]
    ] + [{"peer": "deep_gemm", "M": 1, "status": "skipped: no deep_gemm"}]
    chunk_rows = [
        {"C": None, "us": 100.0, "floor_us": 50.0, "ratio_vs_unchunked": 1.0},
        {"C": 256, "us": 120.0, "floor_us": 50.0, "ratio_vs_unchunked": 1.2},
    ]
    count_rows = [{"M": 4096, "topk": 8, "E": 256, "method": m, "us": us} for m, us in (("histogram", 7), ("scan", 60))]
    payloads = {
        "layer-qwen3_30b_a3b-bf16": {"rows": layer_rows},
        "chunking-qwen3_30b_a3b-bf16": {"rows": chunk_rows},
        "count": {"rows": count_rows, "anchors": {"torch.histc": 19.7}},
    }
    env = {"gpu": "NVIDIA H200", "date": "2026-11-30"}
    for name, payload in payloads.items():
        record = {"name": name, "environment": env, **payload}
        (folder / f"{name}-nvidia-h200-2026-11-30.json").write_text(json.dumps(record))
    timing = [
        {"rank": 0, "M": m, "quant": q, "dispatch_us": 10.0 * m, "combine_us": 5.0 * m}
        for m in (128, 512)
        for q in ("none", "fp8_block")
    ]
    (folder / "ep-nvidia-h200x2-2026-11-30.json").write_text(json.dumps({"device": "H200", "timing": timing}))
    (folder / "notes.json").write_text('{"hello": 1}')


def test_every_kind_has_its_plot_and_the_grid_holds_them_all(tmp_path):
    assert _png(plots.plot_bench_grid([])).startswith(b"\x89PNG")  # a placeholder panel
    _write_records(tmp_path)
    loaded = records.bench_results(tmp_path)
    assert [records.kind(r) for r in loaded] == ["chunking", "count", "ep", "layer", "other"]
    for r in loaded:
        assert _png(plots.plot_bench(r)).startswith(b"\x89PNG")
    fig = plots.plot_bench_grid(loaded)
    assert len([ax for ax in fig.axes if ax.has_data()]) == 4  # "other" draws a note, no data
    chunking, _, ep, layer, _ = loaded
    labels = [t.get_text() for t in plots.plot_bench(layer).axes[0].get_legend().get_texts()]
    assert labels == ["triton", "torch", "floor", "anchor: vllm_triton"]  # the skipped peer draws nothing
    assert len(plots.plot_bench(ep).axes[0].lines) == 4  # dispatch and combine, per quantization
    bars = plots.plot_bench(chunking).axes[0].patches
    assert [b.get_height() for b in bars] == [100.0, 120.0]


def test_a_plot_draws_on_the_axes_it_is_given(tmp_path):
    from moekit.viz import new_axes

    _write_records(tmp_path)
    layer = records.latest_result("layer-qwen3_30b_a3b-bf16", tmp_path)
    fig, (left, right) = new_axes(2)
    assert plots.plot_bench(layer, ax=right) is fig
    assert right.has_data() and not left.has_data()


def test_plot_count_timings():
    fig = plots.plot_count_timings({"rows": COUNT_ROWS, "environment": {"gpu": "NVIDIA H200"}})
    eager, graph = fig.axes[:2]
    assert eager.get_title() == "eager, NVIDIA H200" and graph.get_title() == "CUDA graph, NVIDIA H200"
    assert eager.get_yscale() == graph.get_yscale() == "log"
    assert len(eager.patches) == len(graph.patches) == 2 * 2  # 2 methods x 2 cases
    assert [t.get_text() for t in eager.get_legend().get_texts()] == ["histogram", "bincount"]
    heights = sorted(p.get_height() for p in eager.patches)
    assert heights == sorted([7.04, 40.26, 5.56, 30.0])
    assert sum(p.get_height() != p.get_height() for p in graph.patches) == 1  # bincount at 4096: no graph time
    assert _png(fig).startswith(b"\x89PNG")
