"""moekit.hopper.configs: the committed tile table, its lookups, and KernelConfig's checks."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.errors import InvalidInputError
from moekit.hopper.configs import KernelConfig, get_config, load_table, table_config
from moekit.quant import FP8
from moekit.testing import expect_raises


def test_config_table_is_valid():
    table = load_table()
    assert set(table) == {"bf16", "fp16", "fp32", "fp8"}
    for key, buckets in table.items():
        limits = [b["max_rows"] for b in buckets]
        assert limits[-1] is None and limits[:-1] == sorted(limits[:-1])
        for bucket in buckets:
            for name in ("gemm1", "gemm1_gated", "gemm2"):
                if name not in bucket:
                    continue
                cfg = KernelConfig(**bucket[name])
                if key == "fp8":
                    assert 128 % cfg.BLOCK_K == 0
                    assert name != "gemm1_gated" or cfg.BLOCK_N == 128
    assert table_config(0.06, torch.bfloat16).BLOCK_M == 16  # decode
    assert table_config(1024, torch.bfloat16).BLOCK_M == 128  # prefill
    assert table_config(8, torch.float16) == table_config(8, torch.bfloat16)
    gated = table_config(1024, torch.bfloat16, gated=True)
    assert 2 * gated.BLOCK_M * gated.BLOCK_N <= 128 * 256  # two fp32 accumulators: at most one 128x256 tile's
    assert table_config(1024, torch.bfloat16, stage=2).persistent  # large M: the persistent kernel
    assert not table_config(0.06, torch.bfloat16).persistent  # decode: one program per tile
    assert table_config(1024, torch.float32, gated=True) == table_config(1024, torch.float32)  # no entry
    assert KernelConfig(16, 64, 64, tma=True).launch == KernelConfig(16, 64, 64).launch  # not a kernel argument


def test_config_errors():
    with expect_raises(InvalidInputError, match="power of two"):
        KernelConfig(BLOCK_M=24, BLOCK_N=64, BLOCK_K=64)
    with expect_raises(InvalidInputError, match="tma must be a bool"):
        KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, tma=1)
    with expect_raises(InvalidInputError, match="no fused_moe config"):
        get_config(1, 64, 64, 4, 2, torch.int8)
    with expect_raises(InvalidInputError, match="stage"):
        get_config(1, 64, 64, 4, 2, torch.bfloat16, stage=3)


@pytest.mark.parametrize("field", ["BLOCK_M", "GROUP_M", "num_warps", "num_stages"])
@pytest.mark.parametrize("value", [0, -16, True, 16.0])
def test_config_fields_must_be_positive_ints(field, value):
    with expect_raises(InvalidInputError, match=f"KernelConfig.{field} must be a positive int"):
        KernelConfig(**{"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, field: value})


def test_tile_sizes_are_powers_of_two_from_16():
    for block in (8, 48, 100):
        with expect_raises(InvalidInputError, match=f"BLOCK_K must be a power of two >= 16, got {block}"):
            KernelConfig(16, 64, block)
    cfg = KernelConfig(16, 32, 256, GROUP_M=4, num_warps=8, num_stages=2)
    assert cfg.launch == dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=4, num_warps=8, num_stages=2)


def test_get_config_follows_rows_per_expert_on_a_gpu_and_is_fixed_in_the_interpreter():
    small = get_config(1, 256, 128, 8, 2, torch.bfloat16)
    large = get_config(4096, 256, 128, 8, 2, torch.bfloat16, stage=2)
    if moekit.device.interpreting():
        assert small == large  # few large programs, whatever the size
    else:
        assert small == table_config(1 * 2 / 8, torch.bfloat16)
        assert large == table_config(4096 * 2 / 8, torch.bfloat16, stage=2)


def test_table_buckets_cover_every_row_count():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, FP8):
        for rows in (0.0, 0.5, 3.0, 100.0, 1e9):
            for stage in (1, 2):
                assert isinstance(table_config(rows, dtype, stage=stage), KernelConfig)
    assert table_config(1e9, torch.bfloat16) == KernelConfig(**load_table()["bf16"][-1]["gemm1"])
