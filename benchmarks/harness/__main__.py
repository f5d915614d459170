"""``python -m benchmarks.harness <subcommand> [args]`` (see ``benchmarks/harness/__init__.py``)."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "count": "count_expert_num_tokens: scan vs histogram vs torch",
    "layer": "the MoE layer: moekit experts vs torch._grouped_mm (vs deep_gemm)",
    "chunking": "chunked vs unchunked time, and workspace peak bytes vs chunk size",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print("usage: python -m benchmarks.harness <subcommand> [--help]\n")
        for name, what in SUBCOMMANDS.items():
            print(f"  {name:<10} {what}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"benchmarks.harness.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
