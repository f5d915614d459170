"""``python -m moekit.cli``: moekit.cli.main's exit status becomes the process's."""

from __future__ import annotations

import subprocess
import sys

from moekit import cli


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moekit.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_exits_0_with_the_usage():
    out = _run("--help")
    assert out.returncode == 0 and cli.USAGE in out.stdout


def test_no_command_and_unknown_command_exit_2():
    assert _run().returncode == 2
    out = _run("nope")
    assert out.returncode == 2 and "unknown command 'nope'" in out.stderr
