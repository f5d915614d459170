"""moekit.roofline: the bytes and flops of one MoE layer call, and its floor on a given machine."""

from __future__ import annotations

import pytest

from moekit import roofline
from moekit.errors import InvalidInputError
from moekit.types import QuantScheme

QWEN = roofline.get_shape("qwen3_30b_a3b")
DSV3 = roofline.get_shape("deepseek_v3")
BF16, FP8 = QuantScheme.NONE, QuantScheme.FP8_BLOCK
# A made-up machine with round numbers, so each floor below can be checked by hand.
UNIT = roofline.Ceilings("unit", bandwidth=1e12, flops={BF16: 500e12, FP8: 1000e12})


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


def test_odd_sizes_round_the_fp8_scale_blocks_up():
    odd = roofline.LayerShape("odd", E=4, topk=2, K=130, I=70)  # N = 140: 2 x 2 and 2 x 1 blocks
    assert odd.expert_bytes(FP8) == 140 * 130 + 130 * 70 + 4 * (2 * 2 + 2 * 1)


def test_the_floor_is_the_larger_of_its_two_terms():
    small = roofline.layer_floor(QWEN, 1, 8, BF16, ceilings=UNIT)
    assert small.bytes == roofline.layer_bytes(QWEN, 1, 8, BF16) and small.flops == roofline.layer_flops(QWEN, 1)
    assert small.memory_us == pytest.approx(small.bytes / 1e12 * 1e6)
    assert small.compute_us == pytest.approx(small.flops / 500e12 * 1e6)
    assert small.bound == "memory" and small.us == small.memory_us > small.compute_us
    large = roofline.layer_floor(QWEN, 16384, 128, BF16, ceilings=UNIT)
    assert large.bound == "compute" and large.us == large.compute_us > large.memory_us


def test_the_floor_takes_the_peak_of_its_quant_scheme():
    bf16 = roofline.layer_floor(DSV3, 16384, 256, BF16, ceilings=UNIT)
    fp8 = roofline.layer_floor(DSV3, 16384, 256, FP8, ceilings=UNIT)
    assert fp8.compute_us == pytest.approx(bf16.compute_us / 2)  # UNIT's fp8 peak is twice its bf16 peak
    assert fp8.memory_us < bf16.memory_us
    faster = roofline.Ceilings("2x", bandwidth=2e12, flops={BF16: 1000e12})
    twice = roofline.layer_floor(DSV3, 16384, 256, BF16, ceilings=faster)
    assert twice.us == pytest.approx(bf16.us / 2)


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
        roofline.layer_floor(QWEN, 1, 8, "fp8", ceilings=UNIT)


def test_bad_ceilings_are_named():
    with pytest.raises(InvalidInputError, match="ceilings must be a moekit.roofline.Ceilings, got dict"):
        roofline.layer_floor(QWEN, 1, 8, BF16, ceilings={"bandwidth": 1e12})
    bf16_only = roofline.Ceilings("bf16 only", bandwidth=1e12, flops={BF16: 1e15})
    with pytest.raises(InvalidInputError, match=r"bf16 only has no peak for QuantScheme.FP8_BLOCK \(it has \['NONE'\]"):
        roofline.layer_floor(QWEN, 1, 8, FP8, ceilings=bf16_only)
    with pytest.raises(InvalidInputError, match="bandwidth must be > 0"):
        roofline.Ceilings("x", bandwidth=0, flops={BF16: 1e15})
    with pytest.raises(InvalidInputError, match="flops must map QuantSchemes"):
        roofline.Ceilings("x", bandwidth=1e12, flops={"bf16": 1e15})
    with pytest.raises(InvalidInputError, match="flops must map QuantSchemes"):
        roofline.Ceilings("x", bandwidth=1e12, flops={})
    with pytest.raises(InvalidInputError, match="flops must map QuantSchemes"):
        roofline.Ceilings("x", bandwidth=1e12, flops={BF16: "fast"})
