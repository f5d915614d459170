#!/usr/bin/env python3
"""Each grouped GEMM of a MoE layer against vLLM's Triton kernel: same process, same layout.

    python3 benchmarks/research/gpu_gemm_vs_vllm.py [--shape qwen3_30b_a3b] [--M 4096 16384]
        [--vllm third_party/vllm_fused_moe_kernel.py] [--before third_party/moekit_fused_moe_074e1a4.py]

Both GEMMs (GEMM1 = hidden x w1, GEMM2 = activations x w2) run on one ``moe_align_block_size``
layout of uniform routing. Contenders: moekit's kernel with its committed table's tiles and with
candidate tiles (``TAIL_M`` included); vLLM's ``fused_moe_kernel`` with its H200 config entry,
when a copy of that kernel is given (``--vllm``: a file defining ``fused_moe_kernel``, kept out of
this repository; GEMM2 multiplies the router weight, as vLLM runs it); an earlier moekit kernel
file (``--before``), to measure one change at a time. Every contender's output is checked against
an fp32 product on sampled pairs before it is timed. Times are ``do_bench`` medians, interleaved
over ``--rounds`` rounds (the median of those is reported). Last, the compiler's report of every
variant: registers per thread, spills and shared memory. Writes ``$OUT/gemm-vs-vllm.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moekit  # noqa: F401,I001  (before triton: sets the interpreter up on a CPU-only machine)
import torch
import triton
import triton.language as tl

from moekit.kernels.align import moe_align_block_size
from moekit.hopper.configs import KernelConfig, get_config
from benchmarks.kernel_report import kernel_reports
from moekit.hopper.grouped_gemm import _fused_moe_kernel, fused_moe_gemm
from moekit.roofline import SHAPES

# vLLM's H200 entries for E=128, N=768 (Qwen3-30B-A3B at TP 1), by batch size (vLLM takes the
# nearest key; one config for both GEMMs): vllm/model_executor/layers/fused_moe/configs/
# E=128,N=768,device_name=NVIDIA_H200.json, keys 1, 128 and 1024 and up.
VLLM_H200 = {
    1: dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=5),
    128: dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2),
    1024: dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=16, num_warps=8, num_stages=4),
}


def vllm_config(M: int) -> dict:
    return VLLM_H200[min(VLLM_H200, key=lambda k: abs(k - M))]


def as_moekit(c: dict) -> KernelConfig:
    return KernelConfig(c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["BLOCK_SIZE_K"], GROUP_M=c["GROUP_SIZE_M"],
                        num_warps=c["num_warps"], num_stages=c["num_stages"])  # fmt: skip


def candidates(table: KernelConfig, M: int) -> dict[str, KernelConfig]:
    """Tiles to try around the table's (names are what the report prints)."""

    def cfg(bm, bn, bk, g, w, s, tail=0, tma=False):
        return KernelConfig(bm, bn, bk, GROUP_M=g, num_warps=w, num_stages=s, TAIL_M=tail, tma=tma)

    out = {"table": table, "vllm-cfg": as_moekit(vllm_config(M))}
    if M <= 128:  # weight streaming: enough programs to keep every SM reading
        for bn, bk, w, st in ((32, 128, 4, 4), (32, 128, 2, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3),
                              (32, 128, 4, 5), (64, 128, 4, 5), (128, 128, 4, 5)):  # fmt: skip
            out[f"16x{bn}x{bk} w{w} s{st}"] = cfg(16, bn, bk, 1, w, st)
            out[f"16x{bn}x{bk} w{w} s{st} tma"] = cfg(16, bn, bk, 1, w, st, tma=True)
        return out
    for g in (8, 16, 32):
        for tail in (0, 32, 64):
            out[f"128x256x64 g{g} w8 s4 tail{tail} tma"] = cfg(128, 256, 64, g, 8, 4, tail, True)
    out["128x256x64 g16 w8 s3 tail32 tma"] = cfg(128, 256, 64, 16, 8, 3, 32, True)
    return out


def load_file(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def vllm_launch(module, a, w, out, blocks, *, top_k, weights, mul_weight, config):
    """vLLM's kernel as its launcher calls it (bf16, no quantization)."""
    c = config
    em = blocks.sorted_token_ids.shape[0]
    if a.shape[0] < c["BLOCK_SIZE_M"]:  # as vLLM's launcher: few tokens launch fewer blocks
        em = min(em, a.shape[0] * top_k * c["BLOCK_SIZE_M"])
    grid = (triton.cdiv(em, c["BLOCK_SIZE_M"]) * triton.cdiv(w.shape[1], c["BLOCK_SIZE_N"]),)
    return module.fused_moe_kernel[grid](
        a, w, out, None, None, weights, blocks.sorted_token_ids, blocks.expert_ids, blocks.num_tokens_post_padded,
        w.shape[1], w.shape[2], em, blocks.numel,
        a.stride(0), a.stride(1), w.stride(0), w.stride(2), w.stride(1), out.stride(1), out.stride(2),
        0, 0, 0, 0, 0, 0, 0,
        MUL_ROUTED_WEIGHT=mul_weight, top_k=top_k, compute_type=tl.bfloat16, use_fp8_w8a8=False,
        use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False, **c,
    )  # fmt: skip


def sampled_reference(a, w, ids, pairs_per_row, samples=256):
    """(pairs, fp32 products) for ``samples`` random (token, slot) pairs."""
    flat_ids = ids.flatten()
    pick = torch.randperm(flat_ids.numel(), device=ids.device)[:samples]
    ref = torch.stack([a[p // pairs_per_row].float() @ w[flat_ids[p]].float().t() for p in pick.tolist()])
    return pick, ref


def sampled_error(out, pick, ref, weights=None):
    """max |out - fp32 product| / max |product| over the sampled pairs."""
    if weights is not None:
        ref = ref * weights.flatten()[pick, None]
    return ((out.flatten(0, 1)[pick].float() - ref).abs().max() / ref.abs().max()).item()


def bench(fns: dict, rounds: int, *, graph: bool) -> dict[str, float]:
    """Median µs per contender: ``do_bench``, or CUDA-graph replays (``graph``, for small M
    where a launch's host time would be most of an eager median)."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if graph:
                us = triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3
            else:
                us = triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median") * 1e3
            times[name].append(us)
    return {name: statistics.median(t) for name, t in times.items()}


def run_case(shape, M, args, vllm, before, gen) -> dict:
    E, topk, K, I = shape.E, shape.topk, shape.K, shape.I
    dev = "cuda"
    hidden = torch.randn(M, K, device=dev, generator=gen).bfloat16()
    w1 = (torch.randn(E, 2 * I, K, device=dev, generator=gen) / K**0.5).bfloat16()
    w2 = (torch.randn(E, K, I, device=dev, generator=gen) / I**0.5).bfloat16()
    act = torch.randn(M * topk, I, device=dev, generator=gen).bfloat16()
    ids = torch.rand(M, E, device=dev, generator=gen).topk(topk, dim=1).indices.int()  # uniform routing
    weights = torch.rand(M, topk, device=dev, generator=gen)
    numel = M * topk
    bf16 = torch.bfloat16
    stages = {
        "gemm1": dict(a=hidden, w=w1, out_n=2 * I, ppr=topk, table=get_config(M, 2 * I, K, E, topk, bf16, stage=1)),
        "gemm2": dict(a=act, w=w2, out_n=K, ppr=1, table=get_config(M, K, I, E, topk, bf16, stage=2)),
    }
    layouts = {bm: moe_align_block_size(ids, bm, E) for bm in (16, 32, 64, 128)}
    padded = {bm: int(b.num_tokens_post_padded.item()) for bm, b in layouts.items()}
    row = {"shape": args.shape, "M": M, "padding": {bm: 1 - numel / p for bm, p in padded.items()}, "stages": {}}
    print(
        f"\n== {args.shape} M={M}: padded rows {padded} for {numel} pairs "
        f"(padding {row['padding'][128]:.1%} at 128-row blocks, {row['padding'][64]:.1%} at 64)"
    )
    for stage, s in stages.items():
        flops = 2 * numel * s["out_n"] * s["w"].shape[2]
        outs, fns, errors = {}, {}, {}
        for name, cfg in candidates(s["table"], M).items():
            out = torch.empty(M, topk, s["out_n"], device=dev, dtype=torch.bfloat16)
            blocks = layouts[cfg.BLOCK_M]
            fn = (lambda s=s, out=out, blocks=blocks, cfg=cfg:
                  fused_moe_gemm(s["a"], s["w"], out, blocks, pairs_per_row=s["ppr"], config=cfg))  # fmt: skip
            outs[f"moekit {name}"], fns[f"moekit {name}"] = out, fn
        if before is not None:
            out = torch.empty(M, topk, s["out_n"], device=dev, dtype=torch.bfloat16)
            blocks = layouts[s["table"].BLOCK_M]
            outs["moekit-before table"] = out
            fns["moekit-before table"] = (lambda s=s, out=out, blocks=blocks: before.fused_moe_gemm(
                s["a"], s["w"], out, blocks, pairs_per_row=s["ppr"], config=s["table"]))  # fmt: skip
        if vllm is not None:
            out = torch.empty(M, topk, s["out_n"], device=dev, dtype=torch.bfloat16)
            mul = stage == "gemm2"
            outs["vllm"] = out
            vcfg = vllm_config(M)
            fns["vllm"] = lambda s=s, out=out, mul=mul, vcfg=vcfg: vllm_launch(
                vllm, s["a"], s["w"], out, layouts[vcfg["BLOCK_SIZE_M"]], top_k=s["ppr"], weights=weights,
                mul_weight=mul, config=vcfg,
            )
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        pick, ref = sampled_reference(s["a"], s["w"], ids, s["ppr"])
        for name, out in outs.items():
            w = weights if name == "vllm" and stage == "gemm2" else None
            errors[name] = sampled_error(out, pick, ref, w)
        bad = {n: e for n, e in errors.items() if not e < 2e-2}
        for n in bad:
            fns.pop(n)
        times = bench(fns, args.rounds, graph=M <= 128)
        base = times.get("vllm")
        print(f"-- {stage}: {s['a'].shape[0]}x{s['w'].shape[2]} -> {s['out_n']}, {flops / 1e9:.0f} GFLOP useful")
        for name, us in sorted(times.items(), key=lambda kv: kv[1]):
            vs = f"  {base / us:5.2f}x vLLM" if base else ""
            print(f"   {name:36s} {us:9.1f} us  {flops / us / 1e6:6.0f} TF/s  err {errors[name]:.2e}{vs}")
        for n, e in bad.items():
            print(f"   {n:36s} WRONG (err {e:.2e}): not timed")
        row["stages"][stage] = {
            "flops": flops,
            "us": times,
            "errors": errors,
            "configs": {n: asdict(c) for n, c in candidates(s["table"], M).items()},
        }
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3_30b_a3b", choices=sorted(SHAPES))
    p.add_argument("--M", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--vllm", default="third_party/vllm_fused_moe_kernel.py")
    p.add_argument("--before", default="third_party/moekit_fused_moe_074e1a4.py")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_gemm_vs_vllm needs a CUDA GPU")
    vllm = load_file(args.vllm, "vllm_kernel") if os.path.exists(args.vllm) else None
    before = load_file(args.before, "moekit_before") if os.path.exists(args.before) else None
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"vLLM kernel: {'yes' if vllm else 'no (' + args.vllm + ' missing)'}; before: {'yes' if before else 'no'}"
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [run_case(SHAPES[args.shape], M, args, vllm, before, gen) for M in args.M]
    print("\n== compiler report (moekit grouped GEMM variants)")
    reports = []
    theirs = kernel_reports(vllm.fused_moe_kernel) if vllm is not None else []
    for who, r in [("moekit", r) for r in kernel_reports(_fused_moe_kernel)] + [("vLLM", r) for r in theirs]:
        c = r.constants
        bm, bn, bk = (c.get(f"BLOCK_{x}", c.get(f"BLOCK_SIZE_{x}")) for x in "MNK")
        tag = f"{who} {bm}x{bn}x{bk} tail{c.get('TAIL_M', 0)} gated{int(bool(c.get('GATED', 0)))}"
        print(
            f"   {tag:36s} w{r.num_warps} s{r.num_stages} regs {r.n_regs:3d}  spills {r.n_spills:4d}  "
            f"shared {r.shared_bytes / 1024:6.1f} KiB"
        )
        reports.append({"who": who, **asdict(r)})
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": rows,
        "compiler": reports,
    }
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "gemm-vs-vllm.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
