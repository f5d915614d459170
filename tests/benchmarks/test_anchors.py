"""CPU tests of the harness's anchors and targets, the roofline they sit beside, and anchors.json."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness import anchors
from moekit import roofline
from moekit.errors import InvalidInputError
from moekit.types import QuantScheme

QWEN = roofline.get_shape("qwen3_30b_a3b")
DSV3 = roofline.get_shape("deepseek_v3")
BF16, FP8 = QuantScheme.NONE, QuantScheme.FP8_BLOCK


def test_named_shapes():
    assert (QWEN.E, QWEN.topk, QWEN.K, QWEN.I, QWEN.N) == (128, 8, 2048, 768, 1536)
    assert (DSV3.E, DSV3.topk, DSV3.K, DSV3.I, DSV3.N) == (256, 8, 7168, 2048, 4096)
    with pytest.raises(InvalidInputError, match="qwen3_30b_a3b"):
        roofline.get_shape("mixtral")


def test_flops_count_both_gemms():
    # GEMM1: [8, 2048] x [2048, 1536]; GEMM2: [8, 768] x [768, 2048]
    assert roofline.layer_flops(QWEN, 1) == 2 * 8 * 2048 * 1536 + 2 * 8 * 768 * 2048
    assert roofline.layer_flops(QWEN, 4096) == 4096 * roofline.layer_flops(QWEN, 1)


def test_bytes_count_hit_experts_and_activations():
    one = (1536 * 2048 + 2048 * 768) * 2
    assert QWEN.expert_bytes(BF16) == one
    assert roofline.layer_bytes(QWEN, 1, 8, BF16) == 8 * one + 2 * 2048 * 2
    # fp8: one byte per weight plus fp32 128x128 block scales
    scales = 4 * (12 * 16 + 16 * 6)
    assert QWEN.expert_bytes(FP8) == one // 2 + scales
    with pytest.raises(InvalidInputError):
        roofline.layer_bytes(QWEN, 1, 9, BF16)  # 1 token x topk 8 cannot hit 9 experts
    with pytest.raises(InvalidInputError):
        QWEN.expert_bytes("bf16")  # a QuantScheme, not the harness's dtype string


@pytest.mark.parametrize(("key", "facts_us"), sorted(anchors.FACTS_FLOORS.items()))
def test_floors_match_facts(key, facts_us):
    name, dtype, M = key
    shape = roofline.get_shape(name)
    unique = round(roofline.expected_unique_experts(shape, M))
    floor = roofline.layer_floor(shape, M, unique, BF16 if dtype == "bf16" else FP8)
    assert floor.us == pytest.approx(facts_us, rel=0.005)
    assert floor.bound == ("memory" if M <= 128 else "compute")


def test_fp8_floor_uses_the_fp8_peak():
    bf16 = roofline.layer_floor(DSV3, 16384, 256, BF16)
    fp8 = roofline.layer_floor(DSV3, 16384, 256, FP8)
    assert fp8.compute_us == pytest.approx(bf16.compute_us * 790 / 1365)
    assert fp8.memory_us < bf16.memory_us


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
