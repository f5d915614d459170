#!/usr/bin/env python3
"""Decode tiles (the table's first bf16 bucket, r = M * topk / E <= 1) with deeper pipelines, as whole layers.

    python3 benchmarks/research/gpu_decode_tiles.py [--shape qwen3_30b_a3b] [--M 1 8] [--rounds 3]

At M=1 the grouped GEMMs stream a few experts' weights with one 16-row block each, so a program's
speed is set by the bytes it keeps in flight (stages x tile) and the grid by BLOCK_N. The committed
decode tiles were chosen among 3 and 4 stages (``benchmarks/triton_tiles.py``); this times deeper
ones (shared memory up to 227 KB) for each GEMM in turn, the other GEMM at the table's tile, as the
layer's CUDA-graph time (``benchmarks.harness.measure.graph_us`` over 8 input sets, PDL on as by
default). Every variant's output is checked against the table's, within bf16 tolerance, first.
Then the best GEMM1 with every GEMM2 candidate. Medians over ``--rounds`` shuffled rounds.
Writes ``$OUT/gpu_decode_tiles.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moekit  # noqa: I001  (before triton: sets the interpreter up on a CPU-only machine)
import torch

from benchmarks.harness import measure
from benchmarks.triton_tiles import C, FixedTiles
from moekit.experts import TritonExperts
from moekit.modular_kernel import ModularKernel
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.roofline import SHAPES
from moekit.testing import assert_close, make_problem
from moekit.types import ProblemSize

GATED = ["16x64x128 g1 s4", "16x64x128 g1 s5", "16x64x128 g1 s6", "16x32x128 g1 s6", "16x32x128 g1 s8",
         "16x64x64 g1 s8", "16x128x64 g1 s6", "16x32x64 g1 s8"]  # fmt: skip
GEMM2 = ["16x128x128 g1 s4", "16x128x128 g1 s6", "16x64x128 g1 s6", "16x64x128 g1 s8", "16x128x64 g1 s8",
         "16x256x64 g1 w8 s6", "16x32x128 g1 s8"]  # fmt: skip


def _layer(tiles, fuse: bool) -> ModularKernel:
    experts = FixedTiles(tiles, fuse_activation=fuse) if tiles else TritonExperts(fuse_activation=fuse)
    return ModularKernel(NoEPPrepareFinalize(), experts, trace_counts=False)


def sweep(sets, candidates: dict, rounds: int) -> dict:
    """{name: median graph us}; each candidate checked against the first one's output first."""
    w1, w2 = sets[0].w1, sets[0].w2
    calls, base = {}, None
    for name, kernel in candidates.items():
        fns = [lambda p=p, k=kernel: k(p.hidden, w1, w2, p.topk_weights, p.topk_ids) for p in sets]
        out = fns[0]().float()
        if base is None:
            base = out
        assert_close(out, base, dtype=torch.bfloat16)
        calls[name] = fns
    times = measure.shuffled_rounds(calls, rounds)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 benchmarks/research/gpu_decode_tiles.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3_30b_a3b", choices=sorted(SHAPES))
    ap.add_argument("--M", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available() or moekit.device.interpreting():
        print("gpu_decode_tiles: needs a CUDA GPU")
        return 0
    s = SHAPES[args.shape]
    result = {"args": vars(args), "gpu": torch.cuda.get_device_name(), "rows": []}
    for M in args.M:
        base = make_problem(M, E=s.E, topk=s.topk, K=s.K, N=2 * s.I, device="cuda", seed=M)
        sets = [base] + [make_problem(M, E=s.E, topk=s.topk, K=s.K, N=2 * s.I, device="cuda", seed=M + i)
                         for i in range(1, 8)]  # fmt: skip
        sets = [dataclasses.replace(p, w1=base.w1, w2=base.w2) for p in sets]  # one layer, 8 token sets
        table = TritonExperts(fuse_activation=True).tile_configs(
            ProblemSize(M=M, N=2 * s.I, K=s.K, topk=s.topk, global_num_experts=s.E, num_local_experts=s.E),
            torch.bfloat16)  # fmt: skip
        g2 = table[1]
        first = {"table": _layer(None, True)} | {f"gemm1 {t}": _layer((C(t), g2), True) for t in GATED}
        t1 = sweep(sets, first, args.rounds)
        best1 = min((k for k in t1 if k.startswith("gemm1 ")), key=t1.get)
        g1 = C(best1[len("gemm1 "):])
        second = {"table": _layer(None, True)} | {f"{best1} + gemm2 {t}": _layer((g1, C(t)), True) for t in GEMM2}
        t2 = sweep(sets, second, args.rounds)
        for name, us in list(t1.items()) + list(t2.items()):
            row = {"M": M, "variant": name, "graph_us": us}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        del sets, base
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "gpu_decode_tiles.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
