#!/usr/bin/env python3
"""GEMM1 with silu_and_mul in its epilogue against GEMM1 then the activation kernel, on a GPU.

    python3 benchmarks/research/gpu_gated_gemm1.py [--shapes qwen3_30b_a3b:4096,qwen3_30b_a3b:16384]

For each (shape, M), bf16, uniform routing: the unfused pair as ``TritonExperts`` runs it (the
table's GEMM1 tile into a ``[M, topk, 2I]`` workspace, then ``silu_and_mul``) against gated
GEMM1 tiles (``GatedOutput``: two fp32 accumulators, gate and up, one ``[M, topk, I]`` store).
Every output is checked against an fp32 reference on sampled pairs before it is timed
(``do_bench`` medians, L2 flushed). Writes ``$OUT/gpu_gated_gemm1.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moekit  # noqa: F401,I001  (before triton: sets the interpreter up on a CPU-only machine)
import torch
import torch.nn.functional as F
import triton.testing

from benchmarks.harness.common import environment
from benchmarks.triton_tiles import C
from moekit.kernels.activation import silu_and_mul
from moekit.kernels.align import moe_align_block_size
from moekit.hopper.configs import get_config
from benchmarks.kernel_report import kernel_reports
from moekit.hopper.grouped_gemm import GatedOutput, _fused_moe_kernel, fused_moe_gemm
from moekit.roofline import SHAPES

GATED = ["128x128x64 g8 w8 s3", "128x128x64 g8 w8 s3 t", "128x128x64 g8 w8 s4 t",
         "128x128x64 g8 w8 s4", "64x128x64 g8 w4 s4 t", "128x64x64 g8 w4 s4 t", "128x128x32 g8 w8 s5 t",
         "64x256x64 g8 w8 s3 t"]
TAILS = {"128x128x64 g8 w8 s4 t": (32, 64), "128x128x64 g8 w8 s3 t": (32,), "128x128x64 g16 w8 s4 t": (32,)}


def tail(cfg, t):
    return type(cfg)(**{**cfg.__dict__, "TAIL_M": t})


def bench(fns: dict, rounds: int = 3, *, graph: bool = False) -> dict:
    """Median us per contender: ``do_bench`` (L2 flushed before each call, so the GPU idles
    briefly between calls) or, with ``graph``, CUDA-graph replays back to back (no gaps)."""
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            if graph:
                us = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
            else:
                us = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3
            times[n].append(us)
    return {n: statistics.median(t) for n, t in times.items()}


def run(shape_name: str, M: int, gen, *, graph: bool = False, candidates: list[str] = GATED) -> dict:
    s = SHAPES[shape_name]
    E, topk, K, I = s.E, s.topk, s.K, s.I
    dev, bf16 = "cuda", torch.bfloat16
    hidden = torch.randn(M, K, device=dev, generator=gen).to(bf16)
    w1 = (torch.randn(E, 2 * I, K, device=dev, generator=gen) / K**0.5).to(bf16)
    ids = torch.rand(M, E, device=dev, generator=gen).topk(topk, dim=1).indices.int()
    table1 = get_config(M, 2 * I, K, E, topk, bf16, stage=1)
    layouts = {}

    def blocks(bm):
        if bm not in layouts:
            layouts[bm] = moe_align_block_size(ids, bm, E)
        return layouts[bm]

    ws13 = torch.empty(M, topk, 2 * I, device=dev, dtype=bf16)
    outs, fns = {}, {}
    act = torch.empty(M * topk, I, device=dev, dtype=bf16)
    b1 = blocks(table1.BLOCK_M)
    fns["split: GEMM1 (table)"] = lambda: fused_moe_gemm(hidden, w1, ws13, b1, pairs_per_row=topk, config=table1)
    fns["split: silu_and_mul"] = lambda: silu_and_mul(ws13.view(M * topk, 2 * I), out=act)
    outs["split: silu_and_mul"] = act
    configs = {}
    for spec in candidates:
        configs[spec] = C(spec)
        for t in TAILS.get(spec, ()):
            configs[f"{spec} tail{t}"] = tail(C(spec), t)
    for name, cfg in configs.items():
        out = torch.empty(M, topk, I, device=dev, dtype=bf16)
        bl = blocks(cfg.BLOCK_M)
        fns[f"gated {name}"] = (lambda out=out, bl=bl, cfg=cfg: fused_moe_gemm(
            hidden, w1, out, bl, pairs_per_row=topk, config=cfg, gated=GatedOutput()))  # fmt: skip
        outs[f"gated {name}"] = out.view(M * topk, I)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    flat = ids.flatten()
    pick = torch.randperm(flat.numel(), device=dev, generator=gen)[:256]
    y = torch.stack([hidden[p // topk].float() @ w1[flat[p]].float().t() for p in pick.tolist()])
    ref = F.silu(y[:, :I]) * y[:, I:]
    errors = {n: ((o[pick].float() - ref).abs().max() / ref.abs().max()).item() for n, o in outs.items()}
    bad = [n for n, e in errors.items() if not e < 2e-2]
    for n in bad:
        fns.pop(n)
    # The two GEMMs as a layer runs them: GEMM2 (the table's tile) reads the activation.
    table2 = get_config(M, K, I, E, topk, bf16, stage=2)
    w2 = (torch.randn(E, K, I, device=dev, generator=gen) / I**0.5).to(bf16)
    y2 = torch.empty(M * topk, 1, K, device=dev, dtype=bf16)
    b2 = blocks(table2.BLOCK_M)
    gemm2 = lambda a: fused_moe_gemm(a, w2, y2, b2, pairs_per_row=1, config=table2)
    gated_table = get_config(M, 2 * I, K, E, topk, bf16, stage=1, gated=True)
    act_g = torch.empty(M, topk, I, device=dev, dtype=bf16)
    bg = blocks(gated_table.BLOCK_M)
    fns["layer GEMMs: GEMM1 + silu_and_mul + GEMM2"] = lambda: (fns["split: GEMM1 (table)"](),
                                                                 fns["split: silu_and_mul"](), gemm2(act))
    fns["layer GEMMs: gated GEMM1 (table) + GEMM2"] = lambda: (fused_moe_gemm(
        hidden, w1, act_g, bg, pairs_per_row=topk, config=gated_table, gated=GatedOutput()),
        gemm2(act_g.view(M * topk, I)))  # fmt: skip
    times = bench(fns, graph=graph)
    split = times["split: GEMM1 (table)"] + times["split: silu_and_mul"]
    flops = 2 * M * topk * 2 * I * K
    how = "CUDA graph replays" if graph else "do_bench, L2 flushed"
    print(f"\n== {shape_name} M={M} ({how}): GEMM1 {flops / 1e9:.0f} GFLOP; split total {split:.1f} us")
    for n, us in sorted(times.items(), key=lambda kv: kv[1]):
        ratio = f"  {split / us:5.2f}x split" if n.startswith("gated") else ""
        print(f"   {n:40s} {us:9.1f} us  {flops / us / 1e6:6.0f} TF/s  err {errors.get(n, 0):.1e}{ratio}")
    for n in bad:
        print(f"   {n:40s} WRONG (err {errors[n]:.2e}): not timed")
    return dict(shape=shape_name, M=M, graph=graph, gated_table=str(gated_table), flops=flops, split_us=split,
                times_us=times, errors=errors, wrong=bad)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3_30b_a3b:4096,qwen3_30b_a3b:16384,deepseek_v3:16384")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays back to back")
    p.add_argument("--candidates", default=",".join(GATED), help="gated tiles to time (triton_tiles.C specs)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    payload = dict(env=environment().__dict__, cases=[])
    out = Path(os.environ["OUT"]) / "gpu_gated_gemm1.json" if os.environ.get("OUT") else None
    for item in args.shapes.split(","):
        name, M = item.split(":")
        payload["cases"].append(run(name, int(M), gen, graph=args.graph, candidates=args.candidates.split(",")))
        torch.cuda.empty_cache()
        if out is not None:
            out.write_text(json.dumps(payload, indent=1, default=str))
    for r in kernel_reports(_fused_moe_kernel):
        c = r.constants
        if c.get("GATED"):
            print(f"gated {c.get('BLOCK_M')}x{c.get('BLOCK_N')}x{c.get('BLOCK_K')} tail{c.get('TAIL_M')} "
                  f"i{int(bool(c.get('INTERLEAVE')))} tma{int(bool(c.get('W_TMA')))} w{r.num_warps} s{r.num_stages}: "
                  f"regs {r.n_regs} spills {r.n_spills} smem {r.shared_bytes}")
    return 1 if any(c["wrong"] for c in payload["cases"]) else 0


if __name__ == "__main__":
    sys.exit(main())
