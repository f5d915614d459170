#!/usr/bin/env python3
"""DeepGemmExperts on a Hopper GPU: correctness and timing at a DeepSeek-V3-like fp8 layer.

    python3 benchmarks/gpu_check_deep_gemm.py          # H200: E=256, topk=8, K=7168, I=2048, M=4096
    python3 benchmarks/gpu_check_deep_gemm.py --smoke  # tiny shapes, runs anywhere (CPU interpreter)

What it does (about 1-2 minutes on an H200, most of it Triton compiles):

1. builds the layer (:func:`moekit.testing.make_problem`: fp8 128x128 block weights, uniform
   routing) and checks DeepGemmExperts
   (moekit's Triton contiguous GEMM) against an fp32 reference on a sample of tokens;
2. sweeps a few tile configs of the contiguous GEMM for GEMM1 and GEMM2 (TF/s);
3. times every phase of one experts call (count, permute, GEMM1, silu_and_mul + fp8 requant,
   GEMM2, unpermute) and the whole layer through ModularKernel + NoEPPrepareFinalize;
4. does the same with the real deep_gemm when ``moekit.backends.deep_gemm.status()`` says usable.

TF/s are "useful" (2 * pairs * N * K, the flops the layer needs) and "executed" (over all M_sum
rows of the padded layout, as a GEMM without padding skip would spend). A table is printed;
JSON goes to ``$OUT/gpu_check_deep_gemm.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import moekit  # noqa: I001  (first: it turns Triton's interpreter on before triton is imported)
import torch

from benchmarks.harness.problem import reference_for
from moekit.backends import deep_gemm as dg
from moekit.cli import collect_info
from moekit.experts.deep_gemm import DeepGemmExperts
from moekit.kernels.activation import silu_and_mul_fp8_group
from moekit.kernels.contiguous_gemm import GemmConfig, contiguous_gemm
from moekit.kernels.count import count_expert_num_tokens
from moekit.kernels.permute import alloc_layout, permute_to_contiguous, unpermute_from_contiguous
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.quant import quantize_fp8_per_token_group
from moekit.testing import MoEProblem, make_problem
from moekit.types import ProblemSize, QuantScheme

SWEEP = [
    # The default (64x128, 4 warps, 3 stages, by TMA on Hopper) first: every other config is checked against it.
    GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=3, tma=True),
    GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4, tma=True),
    GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4),  # pointer loads
    GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4),
    GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4, tma=True),
    GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=2, tma=True),
    GemmConfig(block_m=64, block_n=128, group_m=4, num_warps=4, num_stages=3, tma=True),
    GemmConfig(block_m=64, block_n=128, group_m=16, num_warps=4, num_stages=3, tma=True),
    GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=8, num_stages=3, tma=True),
    GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3, tma=True),
    GemmConfig(block_m=128, block_n=64, group_m=8, num_warps=4, num_stages=4, tma=True),
    GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=5, tma=True),
    # 256 columns span two weight-scale blocks: the per-column scale path.
    GemmConfig(block_m=64, block_n=256, group_m=8, num_warps=8, num_stages=3, tma=True),
    # Smaller row tiles waste less on an expert's last, partly filled 128-row block.
    GemmConfig(block_m=32, block_n=128, group_m=8, num_warps=4, num_stages=4, tma=True),
]


def computed_rows(block_rows: torch.Tensor, block_m: int) -> int:
    """Rows in the tiles a GEMM with ``block_m``-row tiles computes (tiles of pure padding skip)."""
    return int((torch.div(block_rows + block_m - 1, block_m, rounding_mode="floor") * block_m).sum())


def timer_ms(fn, *, cuda: bool) -> float:
    """Median milliseconds of ``fn()``: do_bench on the GPU, a few perf_counter runs on the CPU."""
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


class FixedTileExperts(DeepGemmExperts):
    """DeepGemmExperts whose Triton contiguous GEMM runs one tile config (None: the default)."""

    def __init__(self, config: GemmConfig | None = None, **kwargs):
        super().__init__(**kwargs)
        self.config = config

    def gemm_config(self, num_rows: int, N: int, K: int) -> GemmConfig:
        return self.config or super().gemm_config(num_rows, N, K)


def check(kernel_out, ref):
    err = kernel_out.float() - ref
    return {
        "rel_norm_err": float(err.norm() / ref.norm()),
        "max_err_over_max": float(err.abs().max() / ref.abs().max()),
    }


def phase_times(hidden, w, ids, E, gemm, *, cuda):
    """Milliseconds of each phase of one experts call (the kernels DeepGemmExperts.apply runs)."""
    w1, s1, w2, s2 = w
    M, K = hidden.shape
    topk, N = ids.shape[1], w1.shape[1]
    q, s = quantize_fp8_per_token_group(hidden)
    M_sum = DeepGemmExperts().num_rows(ProblemSize(M, N, K, topk, E, E))
    counts = count_expert_num_tokens(ids, E)
    layout = alloc_layout(M_sum, K, M * topk, E, device=hidden.device)
    permute_to_contiguous(q, s, ids, counts, num_rows=M_sum, out=layout)
    mm1 = torch.empty(M_sum, N, dtype=torch.bfloat16, device=hidden.device)
    mm2 = torch.empty(M_sum, K, dtype=torch.bfloat16, device=hidden.device)
    gemm(layout.a, layout.a_scale, w1, s1, mm1, layout)
    q2, qs2 = silu_and_mul_fp8_group(mm1, column_major_scales=True)
    out = torch.empty(M, topk, K, dtype=torch.bfloat16, device=hidden.device)
    phases = {
        "count": lambda: count_expert_num_tokens(ids, E),
        "permute": lambda: permute_to_contiguous(q, s, ids, counts, num_rows=M_sum, out=layout),
        "gemm1": lambda: gemm(layout.a, layout.a_scale, w1, s1, mm1, layout),
        "act_quant": lambda: silu_and_mul_fp8_group(mm1, out_q=q2, out_scale=qs2),
        "gemm2": lambda: gemm(q2, qs2, w2, s2, mm2, layout),
        "unpermute": lambda: unpermute_from_contiguous(mm2, layout.inv_perm, out=out),
    }
    ms = {name: timer_ms(fn, cuda=cuda) for name, fn in phases.items()}
    gemm(layout.a, layout.a_scale, w1, s1, mm1, layout)
    return ms, M_sum, layout.block_rows, mm1[layout.inv_perm.flatten().long()]  # GEMM1's rows of the pairs


def triton_gemm(config):
    def gemm(a, a_s, b, b_s, out, layout):
        contiguous_gemm(a, a_s, b, b_s, layout.m_indices, out=out, block_rows=layout.block_rows, config=config)

    return gemm


def real_gemm(a, a_s, b, b_s, out, layout):
    dg.grouped_gemm_contiguous(a, a_s, b, b_s, out, layout.m_indices)


def report_backend(name, problem: MoEProblem, gemm, experts, *, cuda, sample):
    hidden, ids, E = problem.hidden, problem.topk_ids, problem.w1.shape[0]
    w = (problem.w1, problem.w1_scale, problem.w2, problem.w2_scale)
    M, K = hidden.shape
    topk, N = ids.shape[1], w[0].shape[1]
    ms, M_sum, _, _ = phase_times(hidden, w, ids, E, gemm, cuda=cuda)
    pairs = M * topk
    flops = {"gemm1": 2 * N * K, "gemm2": 2 * K * (N // 2)}
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), experts)
    run = lambda: kernel(*problem.inputs(), **problem.options())
    out = run()
    layer_ms = timer_ms(run, cuda=cuda)
    total = sum(ms.values())
    row = {
        "backend": kernel.last_trace.backends[0],
        "M_sum": M_sum,
        "pairs": pairs,
        "layer_ms": layer_ms,
        "phases_ms": ms,
        "phase_fraction": {k: v / total for k, v in ms.items()},
        "tflops_useful": {g: flops[g] * pairs / ms[g] / 1e9 for g in flops},
        "tflops_executed": {g: flops[g] * M_sum / ms[g] / 1e9 for g in flops},
        "layer_tflops_useful": (flops["gemm1"] + flops["gemm2"]) * pairs / layer_ms / 1e9,
        "check": check(out[sample], reference_for(problem, sample)),
    }
    print(f"\n== {name}: backend {row['backend']}, M_sum {M_sum} rows for {pairs} pairs")
    print(f"{'phase':<10} {'ms':>9} {'share':>7} {'TF/s useful':>12} {'TF/s exec':>10}")
    for k, v in ms.items():
        tf_u = f"{row['tflops_useful'][k]:.0f}" if k in flops else ""
        tf_e = f"{row['tflops_executed'][k]:.0f}" if k in flops else ""
        print(f"{k:<10} {v:9.3f} {v / total:7.1%} {tf_u:>12} {tf_e:>10}")
    tf = row["layer_tflops_useful"]
    print(f"whole layer (prepare + experts + finalize): {layer_ms:.3f} ms = {tf:.0f} TF/s useful")
    print(f"vs fp32 reference on {len(sample)} tokens: {row['check']}")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter or a quick GPU check)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    args = ap.parse_args()
    dev = moekit.device.get_device()
    cuda = dev.type == "cuda"
    if args.smoke:
        M, E, topk, K, I = 48, 4, 2, 256, 128
    else:
        M, E, topk, K, I = 4096, 256, 8, 7168, 2048
        if not cuda:
            print("needs a CUDA GPU (use --smoke on the CPU)")
            return 2
    result = {"shape": dict(M=M, E=E, topk=topk, K=K, I=I, N=2 * I), "device": collect_info().device}
    st = dg.status()
    result["deep_gemm_status"] = {"usable": st.usable, "reason": st.reason, "api": st.api}
    print(f"device {result['device']}; shape {result['shape']}; deep_gemm: {st.reason}")
    t0 = time.time()
    problem = make_problem(M, E=E, topk=topk, K=K, N=2 * I, quant=QuantScheme.FP8_BLOCK, device=dev)
    hidden, ids = problem.hidden, problem.topk_ids
    w = (problem.w1, problem.w1_scale, problem.w2, problem.w2_scale)
    sample = torch.randperm(M, device=dev)[: min(M, 64)]
    print(f"layer built in {time.time() - t0:.1f} s")

    best = None
    if not args.no_sweep and not args.smoke:
        rows, first = [], None
        print(f"\n== tile sweep (contiguous GEMM), {'config':<60} gemm1 / gemm2 ms")
        for cfg in SWEEP:
            try:
                ms, _, block_rows, pairs_out = phase_times(hidden, w, ids, E, triton_gemm(cfg), cuda=cuda)
            except Exception as e:  # a config that does not compile (shared memory) is skipped
                print(f"   {cfg}: failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            first = pairs_out if first is None else first  # every config must give the first one's GEMM1
            differs = float((pairs_out.float() - first.float()).norm() / first.float().norm())
            if not differs < 1e-2:
                print(f"   {cfg}: WRONG: GEMM1 differs from the first config's by {differs:.2e}; not a candidate")
                continue
            pairs, rows_done = M * topk, computed_rows(block_rows, cfg.block_m)
            tf = {g: 2 * pairs * n * k / ms[g] / 1e9 for g, n, k in (("gemm1", 2 * I, K), ("gemm2", K, I))}
            rows.append({"config": cfg.__dict__, "gemm1_ms": ms["gemm1"], "gemm2_ms": ms["gemm2"],
                         "computed_rows": rows_done, "tflops_useful": tf,
                         "tflops_computed": {g: v * rows_done / pairs for g, v in tf.items()}})
            print(f"   {str(cfg):<70} {ms['gemm1']:.3f} / {ms['gemm2']:.3f}  useful {tf['gemm1']:.0f} / "
                  f"{tf['gemm2']:.0f} TF/s, {rows_done} rows computed for {pairs} pairs")
            if best is None or ms["gemm1"] + ms["gemm2"] < best[1]:
                best = (cfg, ms["gemm1"] + ms["gemm2"])
        result["sweep"] = rows
    cfg = best[0] if best else None
    result["triton_config"] = cfg.__dict__ if cfg else "default"
    experts = FixedTileExperts(cfg, backend="triton")
    result["triton"] = report_backend(
        "DeepGemmExperts, Triton contiguous GEMM", problem, triton_gemm(cfg), experts, cuda=cuda, sample=sample,
    )  # fmt: skip
    if st.usable:
        try:
            result["deep_gemm"] = report_backend(
                "DeepGemmExperts, real deep_gemm", problem, real_gemm,
                DeepGemmExperts(backend="deep_gemm"), cuda=cuda, sample=sample,
            )  # fmt: skip
        except Exception as e:
            result["deep_gemm"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"real deep_gemm failed: {result['deep_gemm']['error']}")
    if cuda:  # registers, spills and shared memory of every contiguous-GEMM variant compiled
        from benchmarks.kernel_report import kernel_reports
        from moekit.kernels.contiguous_gemm import _contiguous_gemm_kernel

        reports = kernel_reports(_contiguous_gemm_kernel)
        result["compiler"] = [r.__dict__ for r in reports]
        for r in reports:
            c = r.constants
            print(f"contiguous {c.get('BLOCK_M')}x{c.get('BLOCK_N')}x{c.get('BLOCK_K')} g{c.get('GROUP_M')} "
                  f"w{r.num_warps} s{r.num_stages}: regs {r.n_regs} spills {r.n_spills} smem {r.shared_bytes}")
    ok = result["triton"]["check"]["rel_norm_err"] < 4e-2
    print(f"\ncorrectness {'OK' if ok else 'FAILED'}; total {time.time() - t0:.0f} s")
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "gpu_check_deep_gemm.json").write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
