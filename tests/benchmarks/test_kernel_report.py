"""benchmarks/kernel_report.py: every compiled variant of a kernel, with its constants by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moekit
from benchmarks.kernel_report import KernelReport, kernel_reports


class _FakeCompiled:
    """What a compiled Triton kernel exposes (the attributes the report reads)."""

    def __init__(self, constants, regs):
        self.name = "_k"
        self.src = SimpleNamespace(constants=constants, fn=SimpleNamespace(arg_names=["x_ptr", "n", "BLOCK", "FLAG"]))
        self.metadata = SimpleNamespace(num_warps=8, num_stages=4, shared=196608)
        self.n_regs, self.n_spills, self.loaded = regs, 3, False

    def _init_handles(self):
        self.loaded = True


def test_reports_every_variant_with_named_constants():
    a, b = _FakeCompiled({(2,): 128, (3,): True}, 176), _FakeCompiled({(2,): 64, (3,): False}, 120)
    fn = SimpleNamespace(device_caches={0: ({"key-a": a, "key-b": b}, {}, None, None, None)})
    reports = kernel_reports(fn)
    assert a.loaded and b.loaded  # registers are read after the binary is loaded
    assert reports == [
        KernelReport("_k", {"BLOCK": 128, "FLAG": True}, 8, 4, 176, 3, 196608),
        KernelReport("_k", {"BLOCK": 64, "FLAG": False}, 8, 4, 120, 3, 196608),
    ]


def test_nothing_compiled_means_an_empty_report():
    assert kernel_reports(SimpleNamespace()) == []
    assert kernel_reports(SimpleNamespace(device_caches={})) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or moekit.device.interpreting(), reason="needs a CUDA GPU")
def test_grouped_gemm_report_on_a_gpu():
    from moekit.hopper.configs import KernelConfig
    from moekit.hopper.grouped_gemm import _fused_moe_kernel, fused_moe_gemm
    from moekit.kernels.align import moe_align_block_size

    ids = torch.randint(0, 4, (64, 2), device="cuda")
    a, w = torch.randn(64, 128, device="cuda").bfloat16(), torch.randn(4, 256, 128, device="cuda").bfloat16()
    out = torch.empty(64, 2, 256, device="cuda", dtype=torch.bfloat16)
    cfg = KernelConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, TAIL_M=32)
    fused_moe_gemm(a, w, out, moe_align_block_size(ids, 64, 4), pairs_per_row=2, config=cfg)
    reports = kernel_reports(_fused_moe_kernel)
    mine = [r for r in reports if r.constants.get("BLOCK_M") == 64 and r.constants.get("TAIL_M") == 32]
    assert mine and all(r.n_regs > 0 and r.shared_bytes > 0 for r in mine)
