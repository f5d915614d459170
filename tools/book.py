"""The book: what a learner's chunked forward loads and enters, measured, and its reading order.

::

    python -m tools.book                 # measure one learner's forward, print the reading order
    python -m tools.book --check         # exit 1 when the forward breaks a budget below
    python -m tools.book --reading-order # docs/reading_order.md (the book's files, in reading order)

The learner's forward is the one the notebooks start with: on the CPU (Triton's interpreter),
``ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=16)`` over 64 bf16 tokens, so
four token chunks, with the trace's counts on (the default). It runs in a fresh interpreter
(``MOEKIT_DEVICE=cpu``), which reports:

- the moekit modules loaded (``sys.modules`` after the imports and the forward), with their code
  lines as ``ruff format`` lays them out with fmt directives dropped (``tools.size_table``);
- the moekit files whose code ran during the forward (``sys.setprofile``: every Python frame);
- how many times the count kernel was launched (each chunk counts its own rows: bug 2's fix);
- the widest ``@triton.jit`` kernel it loaded, in ``tl.constexpr`` parameters.

Budgets (:data:`BUDGETS`) are what the design card promises of the book.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.size_table import count_source, default_ruff, formatted_copy

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = {"code_lines": 3000, "files_entered": 16, "max_constexprs": 15, "count_launches_per_chunk": 1}

# The book in the order of the loop's picture: what a forward meets first comes first.
READING_ORDER = (
    "errors.py", "device.py", "types.py", "validate.py", "plan.py", "workspace.py", "trace.py",
    "modular_kernel.py", "prepare_finalize/base.py", "prepare_finalize/no_ep.py", "experts/base.py",
    "experts/triton.py", "kernels/count.py", "kernels/align.py", "kernels/fused_moe.py",
    "kernels/activation.py", "kernels/reduce.py", "kernels/quant.py", "quant.py", "reference.py", "routing.py",
)  # fmt: skip
PACKAGE_INITS = ("__init__.py", "experts/__init__.py", "prepare_finalize/__init__.py", "kernels/__init__.py")

_PROBE = r"""
import json, os, sys, threading
import torch
import moekit
from moekit.experts import TritonExperts
from moekit.prepare_finalize import NoEPPrepareFinalize
g = torch.Generator().manual_seed(0)
M, K, N, E, topk, C = 64, 64, 128, 8, 2, 16
x = torch.randn(M, K, generator=g).bfloat16()
w1 = (torch.randn(E, N, K, generator=g) / K**0.5).bfloat16()
w2 = (torch.randn(E, K, N // 2, generator=g) / N**0.5).bfloat16()
weights, ids = moekit.routing.route(torch.randn(M, E, generator=g), topk)
kernel = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=C)
root = os.path.dirname(moekit.__file__)
entered = set()
count_file = os.path.join(root, "kernels", "count.py")
count_calls = []

def profile(frame, event, arg):
    if event == "call":
        path = frame.f_code.co_filename
        if path.startswith(root):
            entered.add(os.path.relpath(path, root))
        # a call into the count kernel's file from moekit's other code: one count, one launch (the
        # interpreter's own calls of the kernel, once per program, come from Triton's files)
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if path == count_file and caller.startswith(root) and caller != count_file:
            count_calls.append(frame.f_code.co_name)

sys.setprofile(profile)
out = kernel(x, w1, w2, weights, ids)
sys.setprofile(None)
ref = moekit.reference.moe_reference(x, w1, w2, weights, ids)
loaded = sorted(
    os.path.relpath(m.__file__, root) for name, m in list(sys.modules.items())
    if name.startswith("moekit") and getattr(m, "__file__", None)
)
trace = kernel.last_trace
print(json.dumps({
    "loaded": loaded,
    "entered": sorted(entered),
    "chunks": len(trace.chunks),
    "count_launches": len(count_calls),
    "count_entries": sorted(set(count_calls)),
    "chunk_counts": [r.counts is not None for r in trace.chunks],
    "max_error": float((out.float() - ref.float()).abs().max()),
}))
"""


def constexpr_counts(path: Path) -> dict[str, int]:
    """``{kernel name: its tl.constexpr parameters}`` for every ``@triton.jit`` function of ``path``."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.FunctionDef):
            continue
        jitted = any("jit" in ast.unparse(d) for d in node.decorator_list)
        if jitted:
            args = node.args.args + node.args.kwonlyargs
            found[node.name] = sum(
                1 for a in args if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)
            )
    return found


def measure() -> dict:
    """Run the learner's forward in a fresh interpreter; the report described in the module docstring."""
    env = dict(os.environ, MOEKIT_DEVICE="cpu", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(f"tools.book: the learner's forward failed:\n{run.stdout}{run.stderr}")
    report = json.loads(run.stdout.strip().splitlines()[-1])
    ruff = default_ruff()
    package = ROOT / "moekit"
    with tempfile.TemporaryDirectory() as tmp:
        copy = formatted_copy(package, Path(tmp), ruff=ruff, config=ROOT / "pyproject.toml")
        lines = {rel: count_source((copy / rel).read_text()).code for rel in report["loaded"]}
    report["code_lines"] = sum(lines.values())
    report["lines_by_file"] = lines
    widest = {f"{rel}:{k}": v for rel in report["loaded"] for k, v in constexpr_counts(package / rel).items()}
    report["max_constexprs"] = max(widest.values(), default=0)
    report["widest_kernel"] = max(widest, key=widest.get) if widest else None
    report["files_entered"] = len(report["entered"])
    report["count_launches_per_chunk"] = report["count_launches"] / max(report["chunks"], 1)
    return report


def first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    return doc.strip().splitlines()[0].replace("``", "`") if doc.strip() else ""


def reading_order() -> str:
    """docs/reading_order.md: the book's files in reading order, each with its first line and size."""
    ruff = default_ruff()
    package = ROOT / "moekit"
    with tempfile.TemporaryDirectory() as tmp:
        copy = formatted_copy(package, Path(tmp), ruff=ruff, config=ROOT / "pyproject.toml")
        sizes = {rel: count_source((copy / rel).read_text()).code for rel in READING_ORDER}
    lines = [
        "# Reading the book",
        "",
        "The book is what a learner's chunked forward loads on a CPU (`python -m tools.book` measures it);",
        "the Hopper wing, `moekit/hopper/`, sits beside it and is never loaded by it. Read the files in",
        "this order: it is the order of the loop's picture in `moekit/modular_kernel.py`. Sizes are code",
        "lines as `ruff format` lays them out. Generated by `python -m tools.book --reading-order`; a test",
        "keeps it current.",
        "",
        "| # | file | what it holds | code lines |",
        "|---|---|---|---|",
    ]
    for i, rel in enumerate(READING_ORDER, 1):
        lines.append(f"| {i} | [`moekit/{rel}`](../moekit/{rel}) | {first_line(package / rel)} | {sizes[rel]} |")
    lines += ["", f"In all: {sum(sizes.values())} code lines in {len(READING_ORDER)} files.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.book", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a budget is broken")
    ap.add_argument("--reading-order", action="store_true", help="print docs/reading_order.md and exit")
    args = ap.parse_args(argv)
    if args.reading_order:
        print(reading_order(), end="")
        return 0
    report = measure()
    for key in ("code_lines", "files_entered", "max_constexprs", "widest_kernel", "chunks", "count_launches"):
        print(f"{key}: {report[key]}")
    print("loaded:", len(report["loaded"]), "modules")
    for rel, n in sorted(report["lines_by_file"].items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {rel}{'  (entered)' if rel in report['entered'] else ''}")
    broken = [k for k, limit in BUDGETS.items() if report[k] > limit]
    if args.check and broken:
        print(f"over budget: {', '.join(f'{k} {report[k]} > {BUDGETS[k]}' for k in broken)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
