"""moekit.roofline: the bytes and flops of one MoE layer call, and its floor on the H200."""

from __future__ import annotations

import pytest

from moekit import roofline
from moekit.errors import InvalidInputError
from moekit.types import QuantScheme

QWEN = roofline.get_shape("qwen3_30b_a3b")
DSV3 = roofline.get_shape("deepseek_v3")
BF16, FP8 = QuantScheme.NONE, QuantScheme.FP8_BLOCK

# The floors recorded beside the H200 anchors (us), at uniform routing's expected experts hit.
FLOORS = {
    ("qwen3_30b_a3b", "bf16", 1): 17.6,
    ("qwen3_30b_a3b", "bf16", 128): 281.0,
    ("qwen3_30b_a3b", "bf16", 4096): 391.0,
    ("qwen3_30b_a3b", "bf16", 16384): 1566.0,
    ("deepseek_v3", "bf16", 16384): 14600.0,
}


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


@pytest.mark.parametrize(("key", "facts_us"), sorted(FLOORS.items()))
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


def test_the_worked_example_of_the_docstring():
    # Qwen3-30B-A3B, bf16, M=1: 8 experts x (1536 x 2048 + 2048 x 768) x 2 bytes = 75.5 MB -> 17.6 us
    floor = roofline.layer_floor(QWEN, 1, 8, BF16)
    assert floor.bytes == pytest.approx(75.5e6, rel=1e-3)
    assert floor.us == pytest.approx(17.6, abs=0.1)
    assert floor.bound == "memory" and floor.us == floor.memory_us > floor.compute_us


def test_large_batches_are_compute_bound():
    floor = roofline.layer_floor(QWEN, 16384, 128, BF16)
    assert floor.bound == "compute" and floor.us == floor.compute_us
    assert floor.compute_us == pytest.approx(roofline.layer_flops(QWEN, 16384) / 790e12 * 1e6)


def test_expected_unique_experts():
    assert roofline.expected_unique_experts(QWEN, 0) == 0
    assert roofline.expected_unique_experts(QWEN, 1) == pytest.approx(8)  # one token hits topk experts
    assert roofline.expected_unique_experts(QWEN, 4096) == pytest.approx(128)  # every expert
    hits = [roofline.expected_unique_experts(DSV3, M) for M in (1, 4, 16, 64)]
    assert hits == sorted(hits) and all(8 <= h <= 256 for h in hits)


def test_bytes_bounds_and_zero_experts():
    assert roofline.layer_bytes(QWEN, 4, 0, BF16) == 2 * 4 * 2048 * 2  # activations only
    assert roofline.layer_bytes(QWEN, 4096, 128, FP8) < roofline.layer_bytes(QWEN, 4096, 128, BF16)
    with pytest.raises(InvalidInputError, match=r"unique_experts must be in \[0, min\(E=128, M\*topk=8\)\]"):
        roofline.layer_bytes(QWEN, 1, -1, BF16)
    with pytest.raises(InvalidInputError, match="QuantScheme"):
        roofline.layer_floor(QWEN, 1, 8, "fp8")
