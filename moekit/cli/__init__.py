"""The ``moekit`` command: ``moekit info`` and ``moekit walkthrough [...]``.

Benchmarks are not part of the package: run them from a checkout with
``python -m benchmarks.harness <layer|count|chunking> --help``.
"""

from __future__ import annotations

import sys

from moekit.cli.system_info import Info, collect_info, info

USAGE = """moekit <command> [args]

commands:
  info          versions, device, interpreter switch, deep_gemm usability
  walkthrough   run every notebook with papermill into build/walkthrough/ (see --help)

benchmarks (GPU, from a checkout): python -m benchmarks.harness --help
"""


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


__all__ = ["USAGE", "Info", "collect_info", "info", "main"]
