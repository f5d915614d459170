"""Bug 2's cost on a GPU: DeepGemmExperts chunked with whole-batch vs per-chunk token counts.

Since vLLM #20903 DeepGEMM sizes its contiguous layout from the CPU counts. Handed the whole
batch's counts (``metadata_policy="whole_batch"``, unguarded as upstream was), every chunk lays
out the whole batch's rows: the answer stays right, but rows computed and workspace grow by
M / C. This times both policies on one fp8 layer and writes
``benchmarks/results/stale-counts-<gpu>-<date>.json`` (read by notebook 05)::

    python -m benchmarks.gpu_stale_counts [--shape qwen3_30b_a3b] [--M 4096] [--C 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moekit
from benchmarks.harness import common, measure
from moekit.backends import deep_gemm as dg
from moekit.experts import DeepGemmExperts
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.testing import make_problem

REAL, FALLBACK = "real deep_gemm", "moekit Triton fallback (not deep_gemm)"


def gemm_ran(backends: list[str]) -> str:
    """Which GEMM the chunks ran, from their trace backends: ``deep_gemm`` is the real library,
    ``deep_gemm[triton]`` moekit's own Triton GEMM in DeepGEMM's contiguous layout."""
    kinds = {REAL if b == "deep_gemm" else FALLBACK if b == "deep_gemm[triton]" else b for b in backends}
    return " + ".join(sorted(kinds))


def run(shape_name: str, M: int, C: int, *, out: str | None) -> list[dict]:
    shape = moekit.roofline.get_shape(shape_name)
    p = make_problem(M, E=shape.E, topk=shape.topk, K=shape.K, N=shape.N, quant=moekit.QuantScheme.FP8_BLOCK,
                     seed=0, device="cuda")  # fmt: skip
    rows = []
    for policy in ("per_chunk", "whole_batch"):
        kernel = moekit.ModularKernel(NoEPPrepareFinalize(return_counts=True), DeepGemmExperts(), chunk_size=C,
                                      metadata_policy=policy, guard=False)  # fmt: skip
        def call(kernel=kernel):
            return kernel(*p.inputs(), **p.options())

        result = call()
        sample = measure.sample_rows(M, 64)
        err = measure.rel_error(result[sample], p.reference(rows=slice(0, M))[sample])
        trace = kernel.last_trace
        rows.append({
            "policy": policy, "M": M, "C": C, "chunks": len(trace),
            "layout rows (all chunks)": sum(c.shapes.workspace13[0] for c in trace),
            "peak workspace MiB": round(trace.peak_workspace_bytes / 2**20, 1),
            "us": round(measure.eager_us(call), 1), "rel_err": round(err, 4), "backend": trace.backends[0],
            "gemm": gemm_ran(trace.backends), "gemm_reason": next((c.note for c in trace if c.note), ""),
        })  # fmt: skip
        print(rows[-1], flush=True)
    env = common.environment()
    if out != "-":
        status = dg.status()
        gemm = {"gemm": " + ".join(sorted({r["gemm"] for r in rows})), "deep_gemm_usable": status.usable,
                "deep_gemm_status": status.reason}  # fmt: skip
        path = common.write_json("stale-counts", env, {"shape": f"{shape_name} fp8 block", **gemm, "rows": rows},
                                 directory=out)  # fmt: skip
        print(f"wrote {path}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_stale_counts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3_30b_a3b")
    ap.add_argument("--M", type=int, default=4096)
    ap.add_argument("--C", type=int, default=1024)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; '-' writes nothing)")
    args = ap.parse_args(argv)
    if moekit.device.get_device().type != "cuda":
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    run(args.shape, args.M, args.C, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
