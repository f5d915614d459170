"""The ``moekit`` command: ``moekit info``, ``moekit walkthrough [...]``, ``moekit bench <sub> [...]``."""

from __future__ import annotations

import argparse
import sys

USAGE = """moekit <command> [args]

commands:
  info          versions, device, interpreter switch, deep_gemm usability
  walkthrough   run every notebook with papermill into build/walkthrough/ (see --help)
  bench         GPU benchmarks: python -m moekit.bench --help
"""


def info(argv: list[str] | None = None) -> int:
    """Print what moekit runs on."""
    argparse.ArgumentParser(prog="moekit info", description=info.__doc__).parse_args(argv)
    import moekit

    for line in moekit.device.info().lines():
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "info":
        return info(rest)
    if command == "walkthrough":
        from moekit import walkthrough

        return walkthrough.main(rest)
    if command == "bench":
        from moekit.bench.__main__ import main as bench_main

        return bench_main(rest)
    print(f"moekit: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
