"""The grouped GEMM's boundary check: named errors for arguments that do not fit, nothing launched."""

from __future__ import annotations

import torch

from moekit.errors import InvalidInputError, QuantizationError
from moekit.hopper.configs import KernelConfig
from moekit.hopper.gemm_args import GatedOutput, RowWindow, check_gemm_args
from moekit.kernels.align import moe_align_block_size
from moekit.quant import FP8
from moekit.testing import expect_raises

CFG = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)


def _args(device, *, K=64, N=128, dtype=torch.float32):
    ids = torch.randint(0, 3, (5, 2), device=device)
    a = torch.randn(5, K, device=device).to(dtype)
    w = torch.randn(3, N, K, device=device).to(dtype)
    out = torch.empty(5, 2, N, device=device, dtype=dtype)
    return a, w, out, moe_align_block_size(ids, 16, 3)


def test_fitting_arguments_pass_and_say_whether_fp8(device):
    a, w, out, blocks = _args(device)
    assert check_gemm_args(a, w, out, blocks, 2, CFG, None, None, None) is False
    gated_out = torch.empty(5, 2, 64, device=device)
    assert check_gemm_args(a, w, gated_out, blocks, 2, CFG, None, None, GatedOutput()) is False


def test_mismatches_are_named(device):
    a, w, out, blocks = _args(device)
    with expect_raises(InvalidInputError, "a must be"):
        check_gemm_args(a[:, :32], w, out, blocks, 2, CFG, None, None, None)
    with expect_raises(InvalidInputError, "BLOCK_M=16"):
        check_gemm_args(a, w, out, blocks, 2, KernelConfig(32, 64, 64), None, None, None)
    with expect_raises(InvalidInputError, "row chunk"):
        check_gemm_args(a, w, out, blocks, 2, CFG, None, None, None, RowWindow(start=8, end=24))
    with expect_raises(QuantizationError, "both be fp8"):
        check_gemm_args(a.to(FP8), w, out, blocks, 2, CFG, None, None, None)


def test_fp8_needs_its_scales(device):
    a, w, out, blocks = _args(device, K=128, N=128)
    with expect_raises(QuantizationError, "a_scale"):
        check_gemm_args(a.to(FP8), w.to(FP8), out.bfloat16(), blocks, 2, CFG, None, None, None)
