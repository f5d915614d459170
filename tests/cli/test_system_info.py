"""moekit.cli.system_info: what ``moekit info`` reports (versions, device, interpreter, deep_gemm)."""

from __future__ import annotations

import numpy
import torch
import triton

import moekit
from moekit.backends import deep_gemm
from moekit.cli import system_info


def test_collect_info_fields():
    info = system_info.collect_info()
    assert (info.torch, info.triton, info.numpy) == (torch.__version__, triton.__version__, numpy.__version__)
    assert info.interpreter is moekit.device.interpreting()
    status = deep_gemm.status()
    assert (info.deep_gemm_usable, info.deep_gemm_reason) == (status.usable, status.reason)
    if moekit.device.get_device().type == "cpu":
        assert info.device == "cpu (Triton interpreter)" and not info.deep_gemm_usable
    else:
        assert info.device.startswith("cuda:")
    lines = info.lines()
    assert [line.split()[0] for line in lines] == ["torch", "triton", "numpy", "device", "interpreter", "deep_gemm"]
    assert lines[0].endswith(torch.__version__)


def test_info_lines_name_why_deep_gemm_cannot_run():
    info = system_info.Info("1", "2", "3", "cpu", True, False, "no GPU")
    assert info.lines()[-2:] == ["interpreter on (TRITON_INTERPRET=1)", "deep_gemm   not usable (no GPU)"]
    ok = system_info.Info("1", "2", "3", "cuda:0 (H200)", False, True, "")
    assert ok.lines()[-2:] == ["interpreter off", "deep_gemm   usable"]
