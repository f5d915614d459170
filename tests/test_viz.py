"""moekit.viz, headless: the numbers behind the plots, and that every plot draws."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from moekit import reference, routing, viz

pytest.importorskip("matplotlib")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


@pytest.mark.parametrize("M", [1, 7, 64, 130])
@pytest.mark.parametrize("C", [1, 16, 128, None])
@pytest.mark.parametrize("ep_size", [1, 4])
def test_chunk_counts_match_per_chunk_reference(M, C, ep_size):
    E, topk = 16, 3
    ids = routing.skewed_router(M, E, topk, seed=M, device="cpu").topk_ids
    ids[0, 0] = -1  # an empty slot is never counted
    emap = routing.contiguous_expert_map(E, ep_size, 1) if ep_size > 1 else None
    E_local = E // ep_size
    got = viz.chunk_counts(ids, C, E_local, expert_map=emap)
    from moekit.chunking import chunk_ranges

    want = [reference.count_reference(ids[r.start : r.end], E_local, emap) for r in chunk_ranges(M, C)]
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.stack(want).long())


def test_chunk_counts_empty_input():
    assert viz.chunk_counts(torch.zeros(0, 2, dtype=torch.int32), 4, 8).shape == (0, 8)


def test_chunk_counts_agree_with_count_kernel():
    import moekit

    ids = routing.uniform_router(40, 8, 2, seed=3, device="cpu").topk_ids
    got = viz.chunk_counts(ids, 16, 8)
    want = torch.stack([moekit.count_expert_num_tokens(ids[s : s + 16], 8) for s in range(0, 40, 16)])
    assert torch.equal(got, want.cpu().long())


def test_weight_bytes():
    counts = torch.tensor([[3, 0, 1], [0, 0, 2]])
    assert viz.weight_bytes_read(counts, 10) == 30  # three (chunk, expert) pairs touched
    assert viz.expert_weight_bytes(256, 128, dtype=torch.bfloat16) == (256 * 128 + 128 * 128) * 2
    # fp8: one byte per element plus fp32 scales, 2 blocks for w1 [256, 128] and 1 for w2 [128, 128]
    assert viz.expert_weight_bytes(256, 128, dtype=torch.float8_e4m3fn) == 256 * 128 + 128 * 128 + 4 * 3


def test_table_text_and_html():
    t = viz.table([{"a": 1, "shape": (2, 3)}, {"a": "<x>", "shape": None}], title="T")
    text = str(t)
    assert text.splitlines()[0] == "T" and "(2, 3)" in text and "shape" in text
    html = t._repr_html_()
    assert "&lt;x&gt;" in html and "<caption>T</caption>" in html and html.count("<tr>") == 3
    assert str(viz.table([])) == ""


def test_shape_rows():
    rows = viz.shape_rows([("in", "x", torch.zeros(2, 3)), ("prepare", "scale", None)])
    assert rows[0] == {"step": "in", "tensor": "x", "shape": (2, 3), "dtype": "float32", "bytes": 24}
    assert rows[1]["dtype"] == "None" and rows[1]["bytes"] == 0


def test_every_plot_draws():
    counts = viz.chunk_counts(routing.skewed_router(64, 8, 2, device="cpu").topk_ids, 16, 8)
    figs = [
        viz.plot_tokens_per_expert(counts.sum(0)),
        viz.plot_counts_heatmap(counts),
        viz.plot_stacked_chunks(counts),
        viz.plot_workspace_bytes({"a": [1024, 2048], "b": [4096, 4096]}, labels=["deep_gemm", "triton"]),
        viz.plot_weight_bytes([1, 2, 4], {"r": [300, 200, 100]}, whole=100, mark=2),
        viz.plot_counts_vs_whole(counts, counts.sum(0)),
        viz.plot_table(viz.shape_rows([("in", "x", torch.zeros(2))])),
    ]
    for fig in figs:
        assert _png(fig).startswith(b"\x89PNG")


def test_heatmap_annotates_small_matrices_only():
    small = viz.plot_counts_heatmap(torch.ones(2, 3, dtype=torch.int64))
    assert len(small.axes[0].texts) == 6
    big = viz.plot_counts_heatmap(torch.ones(20, 20, dtype=torch.int64))
    assert len(big.axes[0].texts) == 0


def test_plots_draw_on_given_axes():
    fig, axes = viz.new_axes(2)
    assert viz.plot_tokens_per_expert(torch.tensor([1, 2]), ax=axes[1]) is fig
    assert axes[1].get_xlabel() == "expert"


def test_plots_never_touch_pyplot():
    viz.plot_tokens_per_expert(torch.tensor([1, 2]))
    assert "matplotlib.pyplot" not in sys.modules or not __import__("matplotlib.pyplot").pyplot.get_fignums()


def test_import_moekit_does_not_import_matplotlib():
    code = "import sys, moekit, moekit.viz, moekit.widgets; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _write_records(folder):
    import json

    env = {"gpu": "NVIDIA H200", "date": "2026-11-30"}
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
    records = {
        "layer-qwen3_30b_a3b-bf16": {"rows": layer_rows},
        "chunking-qwen3_30b_a3b-bf16": {"rows": chunk_rows},
        "count": {"rows": count_rows, "anchors": {"torch.histc": 19.7, "target": "<= 8"}},
    }
    for name, payload in records.items():
        (folder / f"{name}-nvidia-h200-2026-11-30.json").write_text(
            json.dumps({"name": name, "environment": env, **payload})
        )


def test_bench_results_and_plots(tmp_path):
    assert viz.bench_results(tmp_path) == []
    assert _png(viz.plot_bench_grid([])).startswith(b"\x89PNG")
    _write_records(tmp_path)
    records = viz.bench_results(tmp_path)
    assert [r["name"] for r in records] == ["chunking-qwen3_30b_a3b-bf16", "count", "layer-qwen3_30b_a3b-bf16"]
    summary = viz.summary_rows(records)
    assert summary[2]["rows"] == 4 and summary[2]["ok"] == 3 and summary[0]["gpu"] == "NVIDIA H200"
    for r in records:
        assert _png(viz.plot_bench(r)).startswith(b"\x89PNG")
    fig = viz.plot_bench_grid(records)
    assert len([ax for ax in fig.axes if ax.has_data()]) == 3
    layer = viz.plot_bench(records[2]).axes[0]
    labels = [t.get_text() for t in layer.get_legend().get_texts()]
    assert labels == ["triton", "torch", "floor", "anchor: vllm_triton"]  # the skipped peer draws nothing


def test_bench_results_reads_other_layouts_and_rejects_non_objects(tmp_path):
    import json

    timing = [
        {"rank": 0, "M": m, "quant": q, "dispatch_us": 10.0 * m, "combine_us": 5.0 * m}
        for m in (128, 512)
        for q in ("none", "fp8_block")
    ]
    (tmp_path / "ep-nvidia-h200x2-2026-11-30.json").write_text(json.dumps({"device": "H200", "timing": timing}))
    (tmp_path / "notes.json").write_text('{"hello": 1}')
    ep, notes = viz.bench_results(tmp_path)
    assert ep["name"] == "ep-nvidia-h200x2-2026-11-30" and ep["environment"]["date"] == "2026-11-30"
    assert len(ep["rows"]) == 4 and notes["rows"] == []
    assert len(viz.plot_bench(ep).axes[0].lines) == 4  # dispatch and combine, per quantization
    assert _png(viz.plot_bench_grid([ep, notes])).startswith(b"\x89PNG")
    (tmp_path / "broken.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="broken.json"):
        viz.bench_results(tmp_path)
