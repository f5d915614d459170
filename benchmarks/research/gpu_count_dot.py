#!/usr/bin/env python3
"""The one-hot product count (``benchmarks.variants.count_dot``) against moekit's histogram, on a GPU.

    python3 benchmarks/research/gpu_count_dot.py          # H200, about a minute
    python3 benchmarks/research/gpu_count_dot.py --smoke  # CPU interpreter: exactness only

Every launch shape is checked exact against ``count_reference`` first, then timed in the same
process as ``moekit.count_expert_num_tokens``: ``graph`` (20 calls in one CUDA graph, per call)
and ``eager`` (``do_bench`` median, L2 flushed). Writes ``$OUT/gpu_count_dot.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moekit  # noqa: I001  (first: it turns the interpreter on without a GPU)
import torch

from benchmarks.gpu_count_variants import eager_us, graph_us, inputs, same
from benchmarks.harness.common import environment, format_table
from benchmarks.variants.count_dot import count_dot

CASES = [(262144, 8, 256, 1), (262144, 8, 256, 8), (65536, 8, 256, 1), (4096, 8, 256, 1), (128, 8, 64, 1)]
SMOKE_CASES = [(300, 4, 64, 1), (300, 4, 64, 8), (40, 8, 300, 1)]
# k (ids per product), split (products per tile), programs per SM, warps, fp16 operands (else int8)
_BASE = [(256, 1, 8, 1), (256, 1, 16, 1), (128, 1, 16, 1), (512, 1, 8, 1), (256, 2, 8, 2), (256, 4, 4, 4),
         (256, 4, 8, 4), (128, 4, 8, 4), (256, 8, 2, 8), (128, 8, 4, 8), (1024, 1, 4, 4), (512, 1, 8, 2)]
SHAPES = [(*shape, fp16) for fp16 in (False, True) for shape in _BASE]
SMOKE_SHAPES = [(64, 1, 2, 1, False), (32, 4, 2, 4, True), (64, 2, 1, 2, False)]
BUDGET_S = 400


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available() and not moekit.device.interpreting()
    device = "cuda" if on_gpu else "cpu"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else 2
    cases, shapes = (CASES, SHAPES) if on_gpu and not args.smoke else (SMOKE_CASES, SMOKE_SHAPES)
    env = environment()
    out = Path(os.environ["OUT"]) / "gpu_count_dot.json" if os.environ.get("OUT") else None
    payload = dict(env=asdict(env), cases={})
    start = time.perf_counter()
    bad = 0
    for case in cases:
        ids, num_local, emap, expected = inputs(*case, device=device)
        rows = []
        fn = lambda: moekit.count_expert_num_tokens(ids, num_local, emap)  # noqa: B023
        row = dict(what="moekit histogram", exact=same(fn(), expected))
        if on_gpu:
            row["graph_us"] = graph_us(fn)[0]
            row["eager_us"] = eager_us(fn)
        rows.append(row)
        for k, split, pps, warps, fp16 in shapes:
            if time.perf_counter() - start > BUDGET_S:
                break
            fn = lambda: count_dot(ids, num_local, emap, k=k, split=split, programs_per_sm=pps,  # noqa: B023
                                   num_warps=warps, sms=sms, fp16=fp16)  # noqa: B023
            row = dict(what=f"dot {'fp16' if fp16 else 'int8'} k={k} split={split} pps={pps} w={warps}")
            try:
                row["exact"] = same(fn(), expected) and same(fn(), expected)
                if on_gpu and row["exact"]:
                    row["graph_us"], got = graph_us(fn)
                    row["eager_us"] = eager_us(fn)
                    row["exact"] = same(got, expected)
            except Exception as e:  # a shape that fails to compile must not cost the others
                row["exact"] = False
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            bad += not row["exact"]
            rows.append(row)
        title = f"{case[0]}x{case[1]} ids, E={case[2]}, ep={case[3]} (E_local={num_local})"
        print(f"\n== {title}\n" + format_table(rows, ["what", "exact", ("graph_us", "graph us", ".2f"),
                                                       ("eager_us", "eager us", ".2f"), "error"]), flush=True)
        payload["cases"][title] = rows
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(payload, indent=1, default=str))
    if on_gpu:  # registers, spills and shared memory of every compiled variant
        from benchmarks.kernel_report import kernel_reports
        from benchmarks.variants.count_dot import _count_dot_kernel
        from moekit.kernels.count import _count_histogram_kernel

        reports = [asdict(r) for fn in (_count_dot_kernel, _count_histogram_kernel) for r in kernel_reports(fn)]
        for r in reports:
            print(r["name"], {k: r["constants"].get(k) for k in ("SPLIT", "K", "HI", "FP16", "BLOCK", "NUM_BINS")},
                  "warps", r["num_warps"], "regs", r["n_regs"], "spills", r["n_spills"], "smem", r["shared_bytes"])
        payload["compiler"] = reports
        if out is not None:
            out.write_text(json.dumps(payload, indent=1, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
