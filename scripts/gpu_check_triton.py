#!/usr/bin/env python3
"""TritonExperts on a Hopper GPU: correctness, layer time against targets, and a tile sweep.

    python3 scripts/gpu_check_triton.py          # H200: Qwen3-30B-A3B layer, E=128, topk=8, K=2048, N=1536
    python3 scripts/gpu_check_triton.py --smoke  # tiny shapes, runs anywhere (CPU interpreter)

For M in {1, 128, 4096, 16384} and bf16 then fp8 block (about 2-3 minutes, mostly compiles):

1. correctness: ModularKernel(NoEP, TritonExperts) against an fp32 reference (for fp8, one that
   quantizes where the kernels do: the input, and the intermediate in 1x128 groups);
2. layer time with the committed table (``do_bench`` median; CUDA graph for M <= 128), the
   experts alone (align, GEMM1, activation, GEMM2: no prepare/finalize), align alone, and the
   floor ``max(bytes / 4.3 TB/s, flops / peak)`` (bytes: weights of the experts hit plus
   activations; peak 790 TF/s bf16, 1365 TF/s fp8);
3. the same with ``TritonExperts(fuse_activation=True)`` (silu_and_mul, and for fp8 the
   requantization, in GEMM1's epilogue);
4. a sweep of candidate tiles for GEMM1, gated GEMM1 and GEMM2 separately (each checked against
   the first candidate's output), then the layer with the fastest tiles. The "suggested table"
   entries it prints are the ``gemm1`` / ``gemm1_gated`` / ``gemm2`` keys of a bucket of
   ``moekit/configs/fused_moe.json``.

Prints tables; writes ``$OUT/gpu_check_triton.json`` when ``OUT`` is set (after every row).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

# moekit first: without a GPU it turns the interpreter on, which must happen before triton is
# imported at all (triton's own tl.sum & co. are jit functions decorated at import).
import moekit  # noqa: I001
import torch
import triton

from moekit import QuantScheme
from moekit.experts.triton import TritonExperts
from moekit.kernels.align import moe_align_block_size
from moekit.kernels.configs import KernelConfig, get_config
from moekit.kernels.fused_moe import GatedOutput, fused_moe_gemm
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.quant import dequantize_fp8_block, quantize_fp8_block
from moekit.quant import dequantize_fp8_per_token_group as dq_act
from moekit.quant import quantize_fp8_per_token_group as q_act
from moekit.reference import moe_reference, silu_and_mul
from moekit.types import ExpertPlacement, ExpertsCall, MoEWeights, ProblemSize
from moekit.workspace import WorkspacePool

TARGET_US = {1: 35, 128: 320, 4096: 600, 16384: 2100}  # bf16 goals
VLLM_US = {("bf16", 1): 89, ("bf16", 128): 393, ("bf16", 4096): 1030, ("bf16", 16384): 3171, ("fp8", 4096): 1647}
PEAK = {"bf16": 790e12, "fp8": 1365e12}
BUDGET_S = 165  # stop sweeping past this, so the whole run stays under 3 minutes


def C(bm, bn, bk, g, w, s):
    return KernelConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_warps=w, num_stages=s)


# Candidates per bucket of rows per expert (r = M * topk / E), for GEMM1 and GEMM2, and for the
# gated GEMM1 (silu_and_mul fused: two accumulators and two weight tiles per program, so about
# half the columns fit in registers and shared memory; fp8 needs BLOCK_N = 128 there).
CANDIDATES = {
    "bf16": {
        "decode": [C(16, 64, 128, 1, 4, 4), C(16, 32, 128, 1, 4, 4), C(16, 128, 128, 1, 4, 3)],
        "mid": [C(64, 128, 64, 8, 4, 4), C(128, 128, 64, 8, 8, 3), C(64, 256, 64, 8, 8, 3)],
        "large": [C(128, 128, 64, 8, 8, 3), C(128, 256, 64, 8, 8, 3), C(128, 128, 64, 8, 8, 4)],
    },
    "fp8": {
        "decode": [C(16, 64, 128, 1, 4, 4), C(16, 32, 128, 1, 4, 4)],
        "mid": [C(64, 128, 128, 8, 4, 3), C(128, 128, 128, 8, 8, 3)],
        "large": [C(128, 128, 128, 8, 8, 3), C(128, 256, 128, 8, 8, 3)],
    },
}
GATED = {
    "bf16": {
        "decode": [C(16, 32, 128, 1, 4, 4), C(16, 64, 128, 1, 4, 4)],
        "mid": [C(64, 128, 64, 8, 8, 3), C(64, 64, 64, 8, 4, 4)],
        "large": [C(128, 128, 64, 8, 8, 3), C(128, 64, 64, 8, 4, 4)],
    },
    "fp8": {
        "decode": [C(16, 128, 128, 1, 4, 3), C(16, 128, 128, 1, 4, 4)],
        "mid": [C(64, 128, 128, 8, 4, 3), C(64, 128, 128, 8, 8, 3)],
        "large": [C(128, 128, 128, 8, 8, 3), C(64, 128, 128, 8, 4, 4)],
    },
}


def bucket(r: float) -> str:
    return "decode" if r <= 16 else ("mid" if r <= 512 else "large")


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
    kernels do; the fused epilogue quantizes the fp32 value. Near a rounding boundary of e4m3,
    that one bf16 rounding flips a code, so each path is checked against its own reference.
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


def floor_us(M, ids, K, N, topk, kind) -> float:
    hit = int(torch.unique(ids).numel())
    wbytes = 1 if kind == "fp8" else 2
    bytes_ = hit * (N * K + K * N // 2) * wbytes + 2 * M * K * 2
    flops = 2 * M * topk * (N * K + K * N // 2)
    return max(bytes_ / 4.3e12, flops / PEAK[kind]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    args = ap.parse_args()
    t0 = time.time()
    dev = moekit.device.get_device()
    if args.smoke:
        E, topk, K, N, Ms = 8, 2, 128, 256, (1, 8, 24)
    else:
        E, topk, K, N, Ms = 128, 8, 2048, 1536, (1, 128, 4096, 16384)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)"
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}; E={E} topk={topk} K={K} N={N}")
    torch.manual_seed(0)
    w1 = (torch.randn(E, N, K, device=dev) / K**0.5).bfloat16()
    w2 = (torch.randn(E, K, N // 2, device=dev) / (N // 2) ** 0.5).bfloat16()
    (q1, s1), (q2, s2) = quantize_fp8_block(w1), quantize_fp8_block(w2)
    rows, suggested = [], {}
    out_dir = os.environ.get("OUT")

    def save():
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            payload = dict(device=name, shape=dict(E=E, topk=topk, K=K, N=N), rows=rows, suggested=suggested)
            Path(out_dir, "gpu_check_triton.json").write_text(json.dumps(payload, indent=1))

    for kind in ("bf16", "fp8"):
        wa, wb, scales = (q1, q2, dict(w1_scale=s1, w2_scale=s2)) if kind == "fp8" else (w1, w2, {})
        for M in Ms:
            row = run_case(kind, M, E, topk, K, N, dev, (wa, wb, scales), (w1, w2, q1, q2, s1, s2), t0)
            rows.append(row)
            if "best_gemm1" in row:
                suggested.setdefault(kind, {})[f"M={M} (r={M * topk / E:g})"] = {
                    k: row[f"best_{k}"] for k in ("gemm1", "gemm1_gated", "gemm2")}  # fmt: skip
            save()
            print(_line(row), flush=True)
    print("\nsuggested table (fastest tile per GEMM and M):")
    for kind, per_m in suggested.items():
        for key, best in per_m.items():
            print(f"  {kind} {key}:")
            for name, cfg in best.items():
                print(f'      "{name}": {json.dumps(cfg)},')
    print(f"total {time.time() - t0:.0f} s")


def run_case(kind, M, E, topk, K, N, dev, weights_used, all_weights, t0) -> dict:
    """Correctness, layer time, and (within the time budget) the tile sweep for one (dtype, M)."""
    wa, wb, scales = weights_used
    w1, w2, q1, q2, s1, s2 = all_weights
    quant = QuantScheme.FP8_BLOCK if kind == "fp8" else QuantScheme.NONE
    cdtype = torch.float8_e4m3fn if kind == "fp8" else torch.bfloat16
    hidden = torch.randn(M, K, device=dev).bfloat16()
    weights, ids = torch.softmax(torch.randn(M, E, device=dev), dim=-1).topk(topk, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).float()
    row = dict(kind=kind, M=M, target_us=TARGET_US.get(M) if kind == "bf16" else None,
               vllm_us=VLLM_US.get((kind, M)), floor_us=round(floor_us(M, ids, K, N, topk, kind), 1))  # fmt: skip
    graph = M <= 128

    def layer(configs=None, fused=False):
        experts = TritonExperts(quant=quant, configs=configs, fuse_activation=fused)
        mk = moekit.ModularKernel(NoEPPrepareFinalize(), experts, trace_counts=False)
        return lambda: mk(hidden, wa, wb, weights, ids, **scales)

    try:  # 1. correctness, separate and fused activation
        for fused in (False, True):
            if kind == "fp8":
                ref = fp8_reference(hidden, q1, q2, weights, ids, s1, s2, round_bf16=not fused)
            elif not fused:
                ref = moe_reference(hidden, w1, w2, weights, ids)
            out = layer(fused=fused)().float()
            err = float((out - ref).abs().max() / ref.abs().max())
            row[f"max_err_rel{'_fused' if fused else ''}"] = round(err, 5)
        row["ok"] = max(row["max_err_rel"], row["max_err_rel_fused"]) < 2e-2
    except Exception as e:  # keep going: later rows still tell something
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])

    def experts_alone():
        experts = TritonExperts(quant=quant)
        prepared = NoEPPrepareFinalize().prepare(hidden, weights, ids, quant=quant, placement=ExpertPlacement(E, E))
        shapes = experts.workspace_shapes(ProblemSize(M, N, K, topk, E, E), act_dtype=prepared.a1q.dtype)
        views = WorkspacePool(dev).take(shapes)
        out = torch.empty(shapes.output, dtype=shapes.dtype, device=dev)
        w = MoEWeights(wa, wb, scales.get("w1_scale"), scales.get("w2_scale"))
        call = ExpertsCall(out, prepared.a1q, prepared.a1q_scale, ids, w, views.workspace13, views.workspace2, E)
        return lambda: experts.apply(call)

    try:  # 2. layer, experts alone and align with the table's configs
        row["layer_us"] = round(bench_us(layer(), graph), 1)
        row["layer_fused_us"] = round(bench_us(layer(fused=True), graph), 1)
        row["experts_us"] = round(bench_us(experts_alone(), graph), 1)
        c1 = get_config(M, N, K, E, topk, cdtype, stage=1)
        c2 = get_config(M, K, N // 2, E, topk, cdtype, stage=2)
        row["table"] = [c1.launch, c2.launch]
        row["align_us"] = round(bench_us(lambda: moe_align_block_size(ids, c1.BLOCK_M, E, keep_empty=True), graph), 1)
    except Exception as e:
        row["error_time"] = f"{type(e).__name__}: {e}"[:300]
    if time.time() - t0 > BUDGET_S:
        row["sweep"] = "skipped (time budget)"
        return row
    try:  # 3. sweep each GEMM, then the layer with the best pair
        sweep(row, kind, M, E, topk, K, N, hidden, ids, wa, wb, scales, graph)
        best2 = KernelConfig(**row["best_gemm2"])
        row["layer_best_us"] = round(bench_us(layer((KernelConfig(**row["best_gemm1"]), best2)), graph), 1)
        best_gated = (KernelConfig(**row["best_gemm1_gated"]), best2)
        row["layer_fused_best_us"] = round(bench_us(layer(best_gated, fused=True), graph), 1)
    except Exception as e:
        row["error_sweep"] = f"{type(e).__name__}: {e}"[:300]
    return row


def sweep(row, kind, M, E, topk, K, N, hidden, ids, wa, wb, scales, graph):
    """Time GEMM1, gated GEMM1 and GEMM2 alone for each candidate; record the fastest of each."""
    fp8, R, H, dev = kind == "fp8", M * topk, N // 2, hidden.device
    if fp8:
        a1, a1_s = q_act(hidden)
        mid, mid_s = q_act(torch.randn(R, H, device=dev).bfloat16())
        out_g = torch.empty(R, H, device=dev, dtype=torch.float8_e4m3fn)
        gated = GatedOutput(out_scale=torch.empty(R, H // 128, device=dev))
    else:
        a1, a1_s, mid, mid_s = hidden, None, torch.randn(R, H, device=dev).bfloat16(), None
        out_g, gated = torch.empty(R, H, device=dev, dtype=torch.bfloat16), GatedOutput()
    cands, gated_cands = CANDIDATES[kind][bucket(M * topk / E)], GATED[kind][bucket(M * topk / E)]
    stages = {  # name: (a, a_scale, w, w_scale, out, pairs_per_row, gated, candidates)
        "gemm1": (a1, a1_s, wa, scales.get("w1_scale"), torch.empty(R, N, device=dev, dtype=torch.bfloat16),
                  topk, None, cands),
        "gemm1_gated": (a1, a1_s, wa, scales.get("w1_scale"), out_g, topk, gated, gated_cands),
        "gemm2": (mid, mid_s, wb, scales.get("w2_scale"), torch.empty(R, K, device=dev, dtype=torch.bfloat16),
                  1, None, cands),
    }  # fmt: skip
    for name, (a, a_s, w, w_s, out, ppr, g, tries) in stages.items():
        results, ref = [], None
        for cfg in tries:
            blocks = moe_align_block_size(ids, cfg.BLOCK_M, E, keep_empty=True)
            kw = dict(pairs_per_row=ppr, config=cfg, a_scale=a_s, w_scale=w_s, gated=g)
            fn = lambda: fused_moe_gemm(a, w, out, blocks, **kw)  # noqa: B023
            try:
                fn()
                got = out.float().clone()
                ref = got if ref is None else ref
                bad = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
                results.append((bench_us(fn, graph), cfg, bad))
            except Exception as e:
                results.append((float("inf"), cfg, f"{type(e).__name__}: {e}"[:200]))
        row[f"sweep_{name}"] = [dict(cfg=c.launch, us=round(us, 1), diff=b if isinstance(b, str) else round(b, 4))
                                for us, c, b in results]  # fmt: skip
        ok = [(us, c) for us, c, b in results if not isinstance(b, str) and b < 5e-2]  # fp8 codes may flip
        fastest = min(ok, key=lambda t: t[0]) if ok else (None, tries[0])
        row[f"best_{name}"], row[f"best_{name}_us"] = fastest[1].launch, fastest[0] and round(fastest[0], 1)


def _line(row) -> str:
    f = lambda k: (f"{row[k]:.1f}" if isinstance(row.get(k), float) else str(row.get(k, "-")))
    return (
        f"{row['kind']:>4} M={row['M']:>6}  ok={row.get('ok')} err={row.get('max_err_rel', '-')}  "
        f"layer {f('layer_us')} us (best tiles {f('layer_best_us')}; fused act {f('layer_fused_us')}, "
        f"best {f('layer_fused_best_us')})  experts {f('experts_us')}  align {f('align_us')}  "
        f"gemm1 {f('best_gemm1_us')} (gated {f('best_gemm1_gated_us')}) gemm2 {f('best_gemm2_us')}  "
        f"floor {f('floor_us')}  "
        f"target {row.get('target_us') or '-'}  vLLM {row.get('vllm_us') or '-'}"
        + (f"  ERROR {row.get('error') or row.get('error_time') or row.get('error_sweep')}"
           if any(k.startswith("error") for k in row) else "")  # fmt: skip
    )


if __name__ == "__main__":
    main()
