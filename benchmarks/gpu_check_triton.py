#!/usr/bin/env python3
"""TritonExperts on a Hopper GPU: correctness, layer time against targets, per-GEMM TF/s, tile sweep.

    python3 benchmarks/gpu_check_triton.py          # H200: Qwen3-30B-A3B layer, E=128, topk=8, K=2048, N=1536
    python3 benchmarks/gpu_check_triton.py --smoke  # tiny shapes, runs anywhere (CPU interpreter)

Cases: bf16 M in {1, 128, 4096, 16384}, fp8 block M=4096 (about 2-3 minutes). First every GEMM
variant the run needs is compiled, in parallel threads (by swapping moekit's private kernel objects
for their ``warmup``: a check's shortcut; without it they compile on first use). Then, per case:

1. correctness: ModularKernel(NoEP, TritonExperts) with separate and with fused activation against
   an fp32 reference (for fp8, one that quantizes where the kernels do);
2. times with the committed table (``do_bench`` median; CUDA graph for M <= 128): the layer
   (separate activation, then fused), the experts alone, ``moe_align_block_size`` eager and in a
   graph (the graph number is GPU time; eager adds the host's launch cost), and the floor
   ``max(bytes / 4.3 TB/s, flops / peak)``;
3. each GEMM alone (GEMM1, gated GEMM1, GEMM2): the table's tile first, then the sweep's
   candidates of ``benchmarks/triton_tiles.py`` (``t`` = weights through TMA), with TF/s (useful
   flops: real pairs, not padding) and, where memory-bound, TB/s of weights; each checked
   against the table tile's output;
4. the layer with the fastest tiles (separate and fused), through a ``TritonExperts`` whose
   ``tile_configs`` returns them.

The sweep stops at ``BUDGET_S``. Prints one line per case and a summary table last; writes
``$OUT/gpu_check_triton.json`` (after every case) when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

# moekit first: without a GPU it turns the interpreter on, which must happen before triton is
# imported at all (triton's own tl.sum & co. are jit functions decorated at import).
import moekit  # noqa: I001
import torch
import triton

from benchmarks.triton_tiles import SWEEP, FixedTiles, compile_only
from moekit import QuantScheme
from moekit.hopper.experts import HopperTritonExperts
from moekit.kernels.align import moe_align_block_size
from moekit.hopper.configs import KernelConfig, get_config
from moekit.hopper.grouped_gemm import GatedOutput, fused_moe_gemm
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.quant import FP8, FP8_GROUP, dequantize_fp8_block, quantize_fp8_block
from moekit.quant import dequantize_fp8_per_token_group as dq_act
from moekit.quant import quantize_fp8_per_token_group as q_act
from moekit.reference import moe_reference, silu_and_mul
from benchmarks.ceilings import H200
from moekit.roofline import LayerShape, layer_floor
from moekit.plan import chunk_ranges
from moekit.types import ExpertPlacement, ExpertsCall, MoEWeights, ProblemSize
from moekit.workspace import WorkspacePool

TARGET_US = {1: 35, 128: 320, 4096: 600, 16384: 2100}  # bf16 goals
VLLM_US = {("bf16", 1): 89, ("bf16", 128): 393, ("bf16", 4096): 1030, ("bf16", 16384): 3171, ("fp8", 4096): 1647}
CASES = [("bf16", 1), ("bf16", 128), ("bf16", 4096), ("bf16", 16384), ("fp8", 4096)]
BUDGET_S = 170  # no new sweep candidate past this (from the start of the script)
STAGES = ("gemm1", "gemm1_gated", "gemm2")


def bench_us(fn, graph: bool) -> float:
    if moekit.device.interpreting():  # smoke mode: one wall-clock run, just to exercise the code
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def fp8_reference(hidden, q1, q2, weights, ids, s1, s2, *, round_bf16=True):
    """fp32 layer on fp8-quantized input and weights, with the intermediate requantized.

    ``round_bf16``: GEMM1's output is rounded to bf16 before the activation, as the separate
    kernels do; the fused epilogue quantizes the fp32 value.
    """
    x = dq_act(*q_act(hidden))
    w1, w2 = dequantize_fp8_block(q1, s1), dequantize_fp8_block(q2, s2)
    out = torch.zeros(*ids.shape, w2.shape[1], device=hidden.device)
    for e in range(w1.shape[0]):
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        if rows.numel():
            h = x[rows] @ w1[e].t()
            y = silu_and_mul(h.bfloat16().float() if round_bf16 else h)
            out[rows, slots] = dq_act(*q_act(y)) @ w2[e].t()
    return (out * weights.unsqueeze(-1)).sum(dim=1)


class Case:
    """One (dtype, M): inputs, weights, and the functions that the checks and timings call."""

    def __init__(self, kind, M, shape, weights, dev):
        self.kind, self.M, (self.E, self.topk, self.K, self.N) = kind, M, shape
        self.fp8 = kind == "fp8"
        self.w1, self.w2, self.q1, self.q2, self.s1, self.s2 = weights
        self.wa, self.wb = (self.q1, self.q2) if self.fp8 else (self.w1, self.w2)
        self.scales = dict(w1_scale=self.s1, w2_scale=self.s2) if self.fp8 else {}
        self.quant = QuantScheme.FP8_BLOCK if self.fp8 else QuantScheme.NONE
        self.cdtype = FP8 if self.fp8 else torch.bfloat16
        self.graph = M <= 128
        self.hidden = torch.randn(M, self.K, device=dev).bfloat16()
        w, self.ids = torch.softmax(torch.randn(M, self.E, device=dev), dim=-1).topk(self.topk, dim=-1)
        self.weights = (w / w.sum(-1, keepdim=True)).float()
        self.r = M * self.topk / self.E
        self.bucket = "decode" if self.r <= 16 else "large"
        R, H = M * self.topk, self.N // 2
        if self.fp8:
            self.a1, self.a1_s = q_act(self.hidden)
            self.mid, self.mid_s = q_act(torch.randn(R, H, device=dev).bfloat16())
            self.gated = lambda: GatedOutput(out_scale=torch.empty(R, H // FP8_GROUP, device=dev))
            self.out_g = torch.empty(M, self.topk, H, device=dev, dtype=FP8)
        else:
            self.a1, self.a1_s, self.mid, self.mid_s = self.hidden, None, torch.randn(R, H, device=dev).bfloat16(), None
            self.gated, self.out_g = GatedOutput, torch.empty(M, self.topk, H, device=dev, dtype=torch.bfloat16)
        # fused_moe_gemm writes one row per (token, slot) pair: [M, topk, width]
        self.out1 = torch.empty(M, self.topk, self.N, device=dev, dtype=torch.bfloat16)
        self.out2 = torch.empty(M, self.topk, self.K, device=dev, dtype=torch.bfloat16)

    def table(self, stage: str) -> KernelConfig:
        s, gated = (2, False) if stage == "gemm2" else (1, stage == "gemm1_gated")
        n, k = (self.K, self.N // 2) if s == 2 else (self.N, self.K)
        cfg = get_config(self.M, n, k, self.E, self.topk, self.cdtype, stage=s, gated=gated)
        return replace(cfg, BLOCK_N=128) if self.fp8 and gated else cfg

    def candidates(self, stage: str, limit: int | None = None) -> list[KernelConfig]:
        table = self.table(stage)
        rest = [c for c in SWEEP.get((self.kind, self.bucket), {}).get(stage, []) if c != table]
        return ([table] + rest)[:limit]

    def layer(self, configs=None, fused=False):
        if configs is None:
            experts = HopperTritonExperts(quant=self.quant, fuse_activation=fused)
        else:
            experts = FixedTiles(configs, quant=self.quant, fuse_activation=fused)
        mk = moekit.ModularKernel(NoEPPrepareFinalize(), experts, trace_counts=False)
        return lambda: mk(self.hidden, self.wa, self.wb, self.weights, self.ids, **self.scales)

    def experts_alone(self):
        experts, E = HopperTritonExperts(quant=self.quant), self.E
        placement = ExpertPlacement(E, E)
        prepared = NoEPPrepareFinalize().prepare(self.hidden, self.weights, self.ids, quant=self.quant,
                                                 placement=placement)  # fmt: skip
        problem = ProblemSize(self.M, self.N, self.K, self.topk, E, E)
        shapes = experts.workspace_shapes(problem, act_dtype=prepared.a1q.dtype)
        buffers = WorkspacePool(self.hidden.device).take(shapes)
        out = torch.empty(shapes.output, dtype=shapes.dtype, device=self.hidden.device)
        w = MoEWeights(self.wa, self.wb, self.scales.get("w1_scale"), self.scales.get("w2_scale"))
        call = ExpertsCall(chunk_ranges(self.M, None)[0], out, prepared.a1q, prepared.a1q_scale, prepared.topk_ids, w,
                           buffers.workspace13, buffers.workspace2, problem, shapes, placement)  # fmt: skip
        return lambda: experts.apply(call)

    def gemm(self, stage: str, cfg: KernelConfig):
        """(fn, out) running one GEMM alone with ``cfg``."""
        blocks = moe_align_block_size(self.ids, cfg.BLOCK_M, self.E, keep_empty=True)
        if stage == "gemm2":
            a, a_s, w, w_s, out, ppr, g = self.mid, self.mid_s, self.wb, self.s2, self.out2, 1, None
        else:
            a, a_s, w, w_s, ppr = self.a1, self.a1_s, self.wa, self.s1, self.topk
            out, g = (self.out_g, self.gated()) if stage == "gemm1_gated" else (self.out1, None)
        kw = dict(pairs_per_row=ppr, config=cfg, a_scale=a_s, w_scale=w_s if self.fp8 else None, gated=g)
        return (lambda: fused_moe_gemm(a, w, out, blocks, **kw)), (out, g)

    def rates(self, stage: str, us: float) -> dict:
        """Useful TF/s (real pairs only) and, for decode, TB/s of the weights of the experts hit."""
        R, H, K = self.M * self.topk, self.N // 2, self.K
        flops = 2 * R * (self.N * K if stage != "gemm2" else K * H)
        hit = int(torch.unique(self.ids).numel())
        wbytes = hit * self.N * K * (1 if self.fp8 else 2) / (1 if stage != "gemm2" else 2)
        return dict(tflops=round(flops / us / 1e6, 1), weight_tbs=round(wbytes / us / 1e6, 2))

    def floor_us(self) -> float:
        """:func:`moekit.roofline.layer_floor` (on the H200) of this case, from the experts its routing hits."""
        shape = LayerShape("check", E=self.E, topk=self.topk, K=self.K, I=self.N // 2)
        return layer_floor(shape, self.M, int(torch.unique(self.ids).numel()), self.quant, ceilings=H200).us


def precompile(cases: list[Case], threads: int = 12) -> float:
    """Compile every GEMM variant (and the aligns they need) before timing anything."""
    t = time.time()
    with compile_only(threads):
        for case in cases:
            for stage in STAGES:
                for cfg in case.candidates(stage):
                    with contextlib.suppress(Exception):
                        case.gemm(stage, cfg)[0]()
    return time.time() - t


def check(case: Case, row: dict) -> None:
    """Correctness of the layer with separate and with fused activation."""
    for fused in (False, True):
        c = case
        if c.fp8:
            ref = fp8_reference(c.hidden, c.q1, c.q2, c.weights, c.ids, c.s1, c.s2, round_bf16=not fused)
        elif not fused:
            ref = moe_reference(c.hidden, c.w1, c.w2, c.weights, c.ids)
        out = c.layer(fused=fused)().float()
        row[f"max_err_rel{'_fused' if fused else ''}"] = round(float((out - ref).abs().max() / ref.abs().max()), 5)
    row["ok"] = max(row["max_err_rel"], row["max_err_rel_fused"]) < 2e-2


def sweep(case: Case, row: dict, t0: float, limit: int | None) -> None:
    """Time each GEMM alone: the table's tile, then the candidates (until the budget runs out)."""
    for stage in STAGES:
        results, ref = [], None
        for i, cfg in enumerate(case.candidates(stage, limit)):
            if i and time.time() - t0 > BUDGET_S:
                row.setdefault("sweep_cut", []).append(stage)
                break
            entry = dict(cfg=asdict(cfg))
            try:
                fn, (out, g) = case.gemm(stage, cfg)
                fn()
                got = out.reshape(-1, out.shape[-1]).float()  # [M * topk, width], as the scales
                got = got * (g.out_scale.repeat_interleave(128, 1) if g and g.out_scale is not None else 1)
                ref = got if ref is None else ref
                entry["diff"] = round(float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)), 4)
                # By norm: a flipped fp8 code is a few % of one element, a wrong tile is ~1.
                entry["ndiff"] = round(float((got - ref).norm() / ref.norm().clamp_min(1e-6)), 5)
                entry["us"] = round(bench_us(fn, case.graph), 1)
                entry |= case.rates(stage, entry["us"])
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"[:200]
            results.append(entry)
        row[f"sweep_{stage}"] = results
        ok = [e for e in results if "us" in e and e["ndiff"] < 1e-2]
        best = min(ok, key=lambda e: e["us"]) if ok else None
        row[f"table_{stage}"] = results[0] if results else None
        row[f"best_{stage}"] = best


def run_case(case: Case, t0: float, limit: int | None) -> dict:
    c = case
    row = dict(kind=c.kind, M=c.M, r=c.r, floor_us=round(c.floor_us(), 1), vllm_us=VLLM_US.get((c.kind, c.M)),
               target_us=TARGET_US.get(c.M) if c.kind == "bf16" else None)  # fmt: skip
    steps = [
        ("check", lambda: check(c, row)),
        ("layer_us", lambda: bench_us(c.layer(), c.graph)),
        ("layer_fused_us", lambda: bench_us(c.layer(fused=True), c.graph)),
        ("experts_us", lambda: bench_us(c.experts_alone(), c.graph)),
        ("align_us", lambda: bench_us(lambda: moe_align_block_size(c.ids, c.table("gemm1").BLOCK_M, c.E,
                                                                   keep_empty=True), False)),  # fmt: skip
        ("align_graph_us", lambda: bench_us(lambda: moe_align_block_size(c.ids, c.table("gemm1").BLOCK_M, c.E,
                                                                         keep_empty=True), True)),  # fmt: skip
        ("sweep", lambda: sweep(c, row, t0, limit)),
        ("layer_again_us", lambda: bench_us(c.layer(), c.graph)),  # the spread between two timings
    ]
    for name, fn in steps:
        try:
            value = fn()
            if value is not None:
                row[name] = round(value, 1)
        except Exception as e:  # keep going: later steps and rows still tell something
            row[f"error_{name}"] = f"{type(e).__name__}: {e}"[:300]
    b1, bg, b2 = (row.get(f"best_{s}") for s in STAGES)
    try:
        if b1 and b2:
            best = (KernelConfig(**b1["cfg"]), KernelConfig(**b2["cfg"]))
            row["layer_best_us"] = round(bench_us(c.layer(best), c.graph), 1)
        if bg and b2:
            best = (KernelConfig(**bg["cfg"]), KernelConfig(**b2["cfg"]))
            row["layer_fused_best_us"] = round(bench_us(c.layer(best, fused=True), c.graph), 1)
    except Exception as e:
        row["error_best"] = f"{type(e).__name__}: {e}"[:300]
    return row


def _cfg(e) -> str:
    if not e:
        return "-"
    c = e["cfg"]
    return f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}w{c['num_warps']}s{c['num_stages']}{'t' if c['tma'] else ''}"


def _line(row) -> str:
    f = lambda k: str(row.get(k, "-"))
    lines = [
        f"{row['kind']} M={row['M']}: ok={row.get('ok')} err={f('max_err_rel')}/{f('max_err_rel_fused')}  "
        f"layer {f('layer_us')} (again {f('layer_again_us')}) fused {f('layer_fused_us')}  best tiles "
        f"{f('layer_best_us')} / fused {f('layer_fused_best_us')}  experts {f('experts_us')}  align {f('align_us')} "
        f"(graph {f('align_graph_us')})  floor {f('floor_us')}  target {f('target_us')}  vLLM {f('vllm_us')}"
    ]
    for stage in STAGES:  # the table's tile first, then the fastest candidates
        entries = row.get(f"sweep_{stage}") or []
        timed = sorted((e for e in entries[1:] if "us" in e), key=lambda e: e["us"])[:4]
        cells = [f"{_cfg(e)} {e['us']}us {e['tflops']}TF" + (f" nd{e['ndiff']}" if e["ndiff"] > 1e-2 else "")
                 for e in entries[:1] + timed if "us" in e]  # fmt: skip
        failed = [_cfg(e) for e in entries if "error" in e]
        lines.append(f"    {stage:11s} " + " | ".join(cells) + (f"  FAILED {failed}" if failed else ""))
    lines += [f"    ERROR {k}: {v}" for k, v in row.items() if k.startswith("error")]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    args = ap.parse_args(argv)
    t0 = time.time()
    dev = moekit.device.get_device()
    smoke = args.smoke or moekit.device.interpreting()
    shape = (8, 2, 128, 256) if smoke else (128, 8, 2048, 1536)  # E, topk, K, N
    cases = [("bf16", 1), ("bf16", 24), ("fp8", 40)] if smoke else CASES
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)"
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}; E,topk,K,N = {shape}", flush=True)
    torch.manual_seed(0)
    E, _, K, N = shape
    w1 = (torch.randn(E, N, K, device=dev) / K**0.5).bfloat16()
    w2 = (torch.randn(E, K, N // 2, device=dev) / (N // 2) ** 0.5).bfloat16()
    (q1, s1), (q2, s2) = quantize_fp8_block(w1), quantize_fp8_block(w2)
    built = [Case(kind, M, shape, (w1, w2, q1, q2, s1, s2), dev) for kind, M in cases]
    meta = dict(device=name, torch=torch.__version__, triton=triton.__version__, shape=shape)
    try:
        meta["compile_s"] = round(precompile(built), 1)
        print(f"compiled all GEMM variants in {meta['compile_s']} s", flush=True)
    except Exception as e:  # they compile on first use instead
        meta["error_compile"] = f"{type(e).__name__}: {e}"[:300]
        print("precompile failed:", meta["error_compile"], flush=True)
    rows, out_dir = [], os.environ.get("OUT")
    for case in built:
        t_case = time.time()
        rows.append(run_case(case, t0, 2 if smoke else None))
        rows[-1]["case_s"] = round(time.time() - t_case, 1)
        print(_line(rows[-1]), flush=True)
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            payload = dict(meta, total_s=round(time.time() - t0, 1), rows=rows)
            Path(out_dir, "gpu_check_triton.json").write_text(json.dumps(payload, indent=1))
    print("\nsummary (us; TF/s of useful flops)")
    print(f"{'case':>12} {'layer':>7} {'fused':>7} {'best':>7} {'fbest':>7} {'align':>6} {'alignG':>6} "
          f"{'g1':>7} {'g1gated':>7} {'g2':>7} {'floor':>6} {'target':>6}")  # fmt: skip
    for r in rows:
        t = lambda s, r=r: (r.get(f"table_{s}") or {}).get("us", "-")
        print(f"{r['kind'] + ' M=' + str(r['M']):>12} {r.get('layer_us', '-'):>7} {r.get('layer_fused_us', '-'):>7} "
              f"{r.get('layer_best_us', '-'):>7} {r.get('layer_fused_best_us', '-'):>7} {r.get('align_us', '-'):>6} "
              f"{r.get('align_graph_us', '-'):>6} {t('gemm1'):>7} {t('gemm1_gated'):>7} {t('gemm2'):>7} "
              f"{r['floor_us']:>6} {r.get('target_us') or '-':>6}")  # fmt: skip
    print(f"total {time.time() - t0:.0f} s")
    return 0  # failures are in the rows and the printed lines (``ok=False``, ``ERROR ...``)


if __name__ == "__main__":
    sys.exit(main())
