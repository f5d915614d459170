"""The ``moekit`` command: ``moekit info`` and ``moekit walkthrough [...]``.

Benchmarks are not part of the package: run them from a checkout with
``python -m benchmarks.harness <layer|count|chunking> --help``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

USAGE = """moekit <command> [args]

commands:
  info          versions, device, interpreter switch, deep_gemm usability
  walkthrough   run every notebook with papermill into build/walkthrough/ (see --help)

benchmarks (GPU, from a checkout): python -m benchmarks.harness --help
"""


@dataclass(frozen=True)
class Info:
    """What ``moekit info`` prints."""

    torch: str
    triton: str
    numpy: str
    device: str
    interpreter: bool
    deep_gemm_usable: bool
    deep_gemm_reason: str

    def lines(self) -> list[str]:
        dg = "usable" if self.deep_gemm_usable else f"not usable ({self.deep_gemm_reason})"
        return [
            f"torch       {self.torch}",
            f"triton      {self.triton}",
            f"numpy       {self.numpy}",
            f"device      {self.device}",
            f"interpreter {'on (TRITON_INTERPRET=1)' if self.interpreter else 'off'}",
            f"deep_gemm   {dg}",
        ]


def collect_info() -> Info:
    """Versions, the device, the interpreter switch, and whether deep_gemm can run."""
    import numpy
    import torch
    import triton

    import moekit
    from moekit.backends import deep_gemm

    status = deep_gemm.status()
    device = moekit.device.get_device()
    if device.type == "cuda":
        name = f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    else:
        name = "cpu (Triton interpreter)"
    return Info(torch.__version__, triton.__version__, numpy.__version__, name, moekit.device.interpreting(),
                status.usable, status.reason)  # fmt: skip


def info(argv: list[str] | None = None) -> int:
    """Print what moekit runs on."""
    argparse.ArgumentParser(prog="moekit info", description=info.__doc__).parse_args(argv)
    for line in collect_info().lines():
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``moekit <command>``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "info":
        return info(rest)
    if command == "walkthrough":
        from moekit.cli import walkthrough

        return walkthrough.main(rest)
    print(f"moekit: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
