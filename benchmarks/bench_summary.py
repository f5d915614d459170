"""Print one compact table of every layer/chunking/count result JSON in a folder.

    python benchmarks/bench_summary.py "$OUT"      # or: python -m benchmarks.bench_summary "$OUT"

``benchmarks/gpu_bench_all.sh`` ends with this, so the last screen of its output holds every
number of the run (the device tool returns only the tail of the output).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def layer_lines(record: dict) -> list[str]:
    args = record.get("args", {})
    tag = f"{args.get('shape', '?')[:8]} {args.get('dtype', '?')}"
    lines = []
    for r in record.get("rows", []):
        verdicts = [t["met"] for t in r.get("targets", []) if t.get("met") is not None]
        target = ("met" if all(verdicts) else "MISSED") if verdicts else "-"
        anchors = r.get("anchors_us") or {}
        vllm = anchors.get("vllm_triton", anchors.get("vllm_triton_tuned"))
        status = r.get("status", "")
        if r.get("graph_error"):
            status += " | graph failed"
        gemm = f" gemm {_f(r.get('gemm_tflops'), '.0f')}TF/s {_f(r.get('non_gemm_fraction'), '.0%')} other" \
            if r.get("gemm_us") else ""
        pct = 100 * r["floor_fraction"] if r.get("floor_fraction") else None
        lines.append(
            f"{tag:<13} {r['M']:>6} {r['peer']:<16} {r.get('mode', '-'):<9} {_f(r.get('us'), '10.1f')} "
            f"{_f(r.get('floor_us'), '9.1f')} {_f(pct, '4.0f')}% "
            f"vllm {_f(vllm, '7.0f')} {target:<6} {_f((r.get('peak_bytes') or 0) / 2**20, '7.0f')}MiB "
            f"err {_f(r.get('rel_err'), '.1e')}{gemm} {status[:70]}"
        )
        for s in r.get("host_syncs", [])[:3]:
            lines.append(f"{'':>14} host sync: {s[:110]}")
    return lines


def chunking_lines(record: dict) -> list[str]:
    lines = []
    for r in record.get("rows", []):
        C = "None" if r.get("C") is None else r["C"]
        met = (r.get("target") or {}).get("met")
        verdict = "" if met is None else ("met" if met else "MISSED")
        lines.append(
            f"chunking M={r.get('M')} C={C!s:>5} chunks {r.get('chunks', '-'):>3} "
            f"{_f(r.get('us'), '9.1f')} us x{_f(r.get('ratio_vs_unchunked'), '.3f')} {verdict} "
            f"ws {_f((r.get('peak_workspace_bytes') or 0) / 2**20, '.1f')}MiB "
            f"peak {_f((r.get('peak_bytes') or 0) / 2**20, '.0f')}MiB err {_f(r.get('rel_err'), '.1e')} "
            f"{r.get('status', '')[:60]}"
        )
    return lines


def count_lines(record: dict) -> list[str]:
    return [
        f"count M={r.get('M')} E={r.get('E')} ep={r.get('ep')} {r.get('method', '?'):<15} "
        f"{_f(r.get('us'), '8.1f')} us graph {_f(r.get('graph_us'), '8.1f')} "
        f"floor {_f(r.get('floor_us'), '.2f')}"
        for r in record.get("rows", [])
        if r.get("M") in (4096, 262144)
    ]


def main(folder: str) -> int:
    files = sorted(Path(folder).glob("*.json"))
    if not files:
        print(f"no result JSON under {folder}")
        return 1
    env = None
    for path in files:
        record = json.loads(path.read_text())
        env = env or record.get("environment")
        name = record.get("name", path.stem)
        print(f"\n== {path.name}")
        if name.startswith("layer"):
            print(f"{'shape':<13} {'M':>6} {'peer':<16} {'mode':<9} {'us':>10} {'floor':>9} %flr")
            print("\n".join(layer_lines(record)))
        elif name.startswith("chunking"):
            print("\n".join(chunking_lines(record)))
        elif name.startswith("count"):
            print("\n".join(count_lines(record)))
    if env:
        versions = f"torch {env.get('torch')} | triton {env.get('triton')}"
        print(f"\n{env.get('gpu')} | {env.get('date')} | {versions}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"))
