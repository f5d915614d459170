"""benchmarks/ceilings.py: the H200's measured ceilings, and the floors they give at the anchors' shapes."""

from __future__ import annotations

import pytest

from benchmarks.ceilings import H200
from benchmarks.harness import anchors
from moekit import roofline
from moekit.types import QuantScheme

QWEN = roofline.get_shape("qwen3_30b_a3b")
DSV3 = roofline.get_shape("deepseek_v3")
BF16, FP8 = QuantScheme.NONE, QuantScheme.FP8_BLOCK


def test_the_measured_numbers():
    assert H200.bandwidth == 4.3e12
    assert dict(H200.flops) == {BF16: 790e12, FP8: 1365e12}


@pytest.mark.parametrize(("key", "facts_us"), sorted(anchors.FACTS_FLOORS.items()))
def test_floors_match_the_floors_recorded_with_the_anchors(key, facts_us):
    name, dtype, M = key
    shape = roofline.get_shape(name)
    unique = round(roofline.expected_unique_experts(shape, M))
    floor = roofline.layer_floor(shape, M, unique, BF16 if dtype == "bf16" else FP8, ceilings=H200)
    assert floor.us == pytest.approx(facts_us, rel=0.005)
    assert floor.bound == ("memory" if M <= 128 else "compute")


def test_the_worked_example_of_the_roofline_docstring():
    # Qwen3-30B-A3B, bf16, M=1: 8 experts x (1536 x 2048 + 2048 x 768) x 2 bytes = 75.5 MB -> 17.6 us
    floor = roofline.layer_floor(QWEN, 1, 8, BF16, ceilings=H200)
    assert floor.bytes == pytest.approx(75.5e6, rel=1e-3)
    assert floor.us == pytest.approx(17.6, abs=0.1)
    assert floor.bound == "memory" and floor.us == floor.memory_us > floor.compute_us


def test_fp8_floor_uses_the_fp8_peak_and_large_batches_the_bf16_peak():
    bf16 = roofline.layer_floor(DSV3, 16384, 256, BF16, ceilings=H200)
    fp8 = roofline.layer_floor(DSV3, 16384, 256, FP8, ceilings=H200)
    assert fp8.compute_us == pytest.approx(bf16.compute_us * 790 / 1365)
    large = roofline.layer_floor(QWEN, 16384, 128, BF16, ceilings=H200)
    assert large.bound == "compute"
    assert large.compute_us == pytest.approx(roofline.layer_flops(QWEN, 16384) / 790e12 * 1e6)
