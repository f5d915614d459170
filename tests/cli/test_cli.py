"""moekit.cli (the ``moekit`` command): dispatch and usage (what ``moekit info`` reports: test_system_info.py)."""

from __future__ import annotations

import subprocess
import sys

import moekit
from moekit import cli


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
