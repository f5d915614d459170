"""moekit.cli (the ``moekit`` command): dispatch, usage, and what ``moekit info`` reports."""

from __future__ import annotations

import subprocess
import sys

import numpy
import torch
import triton

import moekit
from moekit import cli
from moekit.backends import deep_gemm


def test_info_command_prints_versions_device_and_deep_gemm():
    out = subprocess.run([sys.executable, "-m", "moekit.cli", "info"], capture_output=True, text=True, check=True)
    for word in ("torch", "triton", "numpy", "device", "interpreter", "deep_gemm"):
        assert word in out.stdout
    if moekit.device.get_device().type == "cpu":
        assert "not usable" in out.stdout


def test_unknown_command_exits_2_with_the_usage(capsys):
    assert cli.main(["frobnicate"]) == 2
    printed = capsys.readouterr()
    assert "unknown command 'frobnicate'" in printed.err and cli.USAGE in printed.err
    assert printed.out == ""


def test_no_command_exits_2_and_help_exits_0(capsys):
    assert cli.main([]) == 2
    assert cli.USAGE in capsys.readouterr().out
    for flag in ("--help", "-h"):
        assert cli.main([flag]) == 0
        assert cli.USAGE in capsys.readouterr().out


def test_info_subcommand_prints_collect_info(capsys):
    assert cli.main(["info"]) == 0
    assert capsys.readouterr().out.splitlines() == cli.collect_info().lines()


def test_collect_info_fields():
    info = cli.collect_info()
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
    info = cli.Info("1", "2", "3", "cpu", True, False, "no GPU")
    assert info.lines()[-2:] == ["interpreter on (TRITON_INTERPRET=1)", "deep_gemm   not usable (no GPU)"]
    ok = cli.Info("1", "2", "3", "cuda:0 (H200)", False, True, "")
    assert ok.lines()[-2:] == ["interpreter off", "deep_gemm   usable"]
