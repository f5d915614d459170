"""CPU tests of the harness's anchors and targets, and anchors.json (the H200 floors: test_ceilings.py)."""

from __future__ import annotations

import json

from benchmarks.harness import anchors
from moekit import roofline
from moekit.types import QuantScheme

BF16, FP8 = QuantScheme.NONE, QuantScheme.FP8_BLOCK


def test_targets_bind_the_right_peers():
    (t,) = anchors.TARGETS[("qwen3_30b_a3b", "bf16", 4096)]
    assert anchors.check_target(t, "triton", us=550.0) is True
    assert anchors.check_target(t, "triton", us=650.0) is False
    assert anchors.check_target(t, "grouped_mm", us=550.0) is None  # a peer, not moekit
    dg, fallback = anchors.TARGETS[("deepseek_v3", "fp8", 4096)]
    assert anchors.check_target(dg, "deep_gemm", us=1.0, gemm_tflops=1200.0, non_gemm_fraction=0.2) is True
    assert anchors.check_target(dg, "deep_gemm", us=1.0, gemm_tflops=1200.0, non_gemm_fraction=0.3) is False
    assert anchors.check_target(dg, "deep_gemm_triton", us=1.0, gemm_tflops=2000.0) is None
    assert anchors.check_target(fallback, "deep_gemm_triton", us=1.0, gemm_tflops=650.0) is True
    assert anchors.check_target(fallback, "deep_gemm_triton", us=1.0) is None  # rate not measured


def test_anchors_json_is_what_anchors_py_produces():
    committed = anchors.ANCHORS_JSON.read_text()
    assert committed == anchors.anchors_json(), "stale: run `python -m benchmarks.harness.anchors`"
    record = json.loads(committed)
    assert set(record) == {"anchors", "floors"}
    got = {(a["shape"], a["dtype"], a["M"]): a["values"] for a in record["anchors"]}
    assert got == anchors.ANCHORS
    assert {(f["shape"], f["dtype"], f["M"]): f["us"] for f in record["floors"]} == anchors.FACTS_FLOORS
    assert all(a["dtype"] in ("bf16", "fp8") and a["shape"] in roofline.SHAPES for a in record["anchors"])


def test_write_anchors_json(tmp_path):
    path = anchors.write_anchors_json(tmp_path / "anchors.json")
    assert json.loads(path.read_text()) == anchors.anchors_record()
