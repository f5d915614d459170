#!/usr/bin/env python3
"""The whole layer at large M under the two plans: token chunks (GEMM1 writes each pair's row) against
one chunk of sorted rows (GEMM1 writes by sorted position, GEMM2 reads its activation there through TMA).

    python3 benchmarks/research/gpu_layer_plans.py [--shapes qwen3_30b_a3b:16384,deepseek_v3:16384] [--rounds 5]

Four kernels per shape: ``chunk_by="tokens"`` (one chunk) and ``chunk_by="rows"`` with R above the
layout's rows (one chunk), each with ``fuse_activation`` off and on; bf16, uniform routing. Every output
is checked against the first one, and that one against ``moekit.reference`` on its first 64 tokens,
before anything is timed. ``do_bench`` medians (L2 flushed) over ``--rounds`` rounds in a shuffled order.
Writes ``$OUT/gpu_layer_plans.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moekit  # noqa: I001  (before triton: sets the interpreter up on a CPU-only machine)
import torch
import triton.testing

from moekit.experts import TritonExperts
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.reference import moe_reference
from moekit.roofline import SHAPES
from moekit.testing import assert_close, make_problem


def run(shape_name: str, M: int, rounds: int) -> dict:
    s = SHAPES[shape_name]
    p = make_problem(M, E=s.E, topk=s.topk, K=s.K, N=2 * s.I, device="cuda")
    rows = 1 << max(M * s.topk + s.E * 128, 1).bit_length()  # above any layout's rows: one chunk
    kernels = {
        f"{plan} {'fused' if fuse else 'split'}": moekit.ModularKernel(
            NoEPPrepareFinalize(), TritonExperts(fuse_activation=fuse),
            **({"chunk_size": rows, "chunk_by": "rows"} if plan == "rows" else {}))
        for plan in ("tokens", "rows") for fuse in (False, True)
    }  # fmt: skip
    outs = {n: k(*p.inputs(), **p.options()) for n, k in kernels.items()}
    first = next(iter(outs.values()))
    # the fp32 reference on the first 64 tokens (it loops over experts: slow at M)
    want = moe_reference(p.hidden[:64], p.w1, p.w2, p.topk_weights[:64], p.topk_ids[:64], **p.options())
    assert_close(first[:64], want, dtype=torch.bfloat16)
    for o in outs.values():
        assert_close(o, first, dtype=torch.bfloat16)
    times = {n: [] for n in kernels}
    for r in range(rounds):
        order = list(kernels)
        random.Random(r).shuffle(order)
        for n in order:
            k = kernels[n]
            times[n].append(triton.testing.do_bench(lambda k=k: k(*p.inputs(), **p.options()), warmup=5, rep=100) * 1e3)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"\n== {shape_name} M={M}: layer, do_bench medians over {rounds} shuffled rounds (us)")
    for n, us in sorted(med.items(), key=lambda kv: kv[1]):
        print(f"   {n:14s} {us:9.1f}   rounds {', '.join(f'{t:.0f}' for t in times[n])}")
    return dict(shape=shape_name, M=M, rows_R=rows, median_us=med, rounds_us=times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3_30b_a3b:16384,qwen3_30b_a3b:32768,deepseek_v3:16384")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    cases = []
    for item in args.shapes.split(","):
        name, M = item.split(":")
        cases.append(run(name, int(M), args.rounds))
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "gpu_layer_plans.json").write_text(json.dumps(dict(cases=cases), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
