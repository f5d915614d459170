#!/usr/bin/env python3
"""Split-K decode GEMMs at the Qwen3-30B-A3B bf16 shape, against the table's GEMMs (a measurement, not a path).

    python3 benchmarks/research/gpu_split_k_decode.py            # M=1 and M=8; MS="1 2 4" for others

At M=1 the table's GEMM1 (16x128x128) runs 96 programs on 132 SMs and GEMM2 128, each streaming
one expert's column slice: is the weight stream short of programs? Here each tile's K range is
split S ways (1, 2, 4, 8; GEMM2: 1-3), the fp32 partials summed in a fixed order by the consumer
(``reduce_silu_kernel``: the sum then silu_and_mul; for GEMM2 ``reduce_sum_kernel``: the sum with
the routing weights and the top-k sum, as a finalize would), so the results stay deterministic.
Every variant is checked against the table's kernels first (bf16 tolerance), then timed as CUDA
graphs over 8 token sets with one layer's weights, 5 shuffled rounds, medians
(``benchmarks.harness.measure``). The weights go through TMA (host descriptors), as the table's
tiles do. Writes ``$OUT/splitk.json`` when OUT is set. Result (H200, 2026-12-02,
``benchmarks/results/checks/split-k-decode-*``): no split beats the table; GEMM1 stays at 14.4-16 us
with 96 to 768 programs, so the decode GEMMs are not short of programs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moekit  # noqa: I001  (before triton: sets the interpreter up on a CPU-only machine)
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.harness import measure
from moekit.kernels.align import launch_align
from moekit.kernels.activation import launch_silu_and_mul
from moekit.hopper.configs import get_config
from moekit.hopper.grouped_gemm import fused_moe_gemm
from moekit.kernels.reduce import launch_weighted_topk_sum
from moekit.testing import make_problem


@triton.jit
def splitk_kernel(a_ptr, w_desc, part_ptr, blocks_ptr, expert_off, post_off, N, K, numel, stride_am,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                  PAIRS: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    s = pid % SPLIT
    t = pid // SPLIT
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = t // num_pid_n
    pid_n = t % num_pid_n
    if pid_m * BLOCK_M >= tl.load(blocks_ptr + post_off):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(blocks_ptr + offs_m)
    live = pair < numel
    expert = tl.load(blocks_ptr + expert_off + pid_m)
    row = tl.where(live, pair // PAIRS, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k_steps = K // BLOCK_K // SPLIT
    k0 = s * k_steps * BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_row = (expert * N + pid_n * BLOCK_N).to(tl.int32)
    for k in tl.range(0, k_steps, num_stages=STAGES):
        kk = k0 + k * BLOCK_K
        a = tl.load(a_ptr + row[:, None] * stride_am + (kk + offs_k)[None, :], mask=live[:, None], other=0.0)
        b = w_desc.load([w_row, kk]).T
        acc = tl.dot(a, b, acc)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dest = part_ptr + s * numel * N + pair.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(dest, acc, mask=live[:, None] & (offs_n[None, :] < N))


@triton.jit
def reduce_silu_kernel(part_ptr, out_ptr, R, H, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < R) & (cols[None, :] < H)
    gate = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    up = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        base = part_ptr + s * R * 2 * H + rows.to(tl.int64)[:, None] * 2 * H + cols[None, :]
        gate += tl.load(base, mask=mask, other=0.0)
        up += tl.load(base + H, mask=mask, other=0.0)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reduce_sum_kernel(part_ptr, w_ptr, out_ptr, M, K, TOPK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        wt = tl.load(w_ptr + m * TOPK + j).to(tl.float32)
        v = tl.zeros([BLOCK_K], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            v += tl.load(part_ptr + s * M * TOPK * K + (m * TOPK + j) * K + cols, mask=cols < K, other=0.0)
        acc += wt * v
    tl.store(out_ptr + m * K + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < K)


def case(M: int, *, E: int, topk: int, K: int, I: int) -> list[dict]:
    """Every variant at M tokens: checked against the table's kernels, then timed."""
    N = 2 * I
    rows = []
    base = make_problem(M, E=E, topk=topk, K=K, N=N, device="cuda", seed=M)
    sets = [base] + [dataclasses.replace(make_problem(M, E=E, topk=topk, K=K, N=N, device="cuda", seed=M + i),
                                         w1=base.w1, w2=base.w2) for i in range(1, 8)]
    cfg1 = get_config(M, N, K, E, topk, torch.bfloat16, stage=1)
    cfg2 = get_config(M, K, N // 2, E, topk, torch.bfloat16, stage=2)
    R = M * topk
    blocks = [launch_align(p.topk_ids, 16, E, keep_empty=True) for p in sets]
    ws13 = torch.empty(M, topk, N, device="cuda", dtype=torch.bfloat16)
    ws2 = torch.empty(R, I, device="cuda", dtype=torch.bfloat16)
    out2 = torch.empty(M, topk, K, device="cuda", dtype=torch.bfloat16)
    fin = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    part = torch.empty(8, R, max(N, K), device="cuda", dtype=torch.float32)

    def base1(i, cfg=cfg1):
        fused_moe_gemm(sets[i].hidden, base.w1, ws13, blocks[i], pairs_per_row=topk, config=cfg, check=False)
        launch_silu_and_mul(ws13, ws2, R, I, x_stride=N, out_stride=I)

    def base1_only(i, cfg=cfg1):
        fused_moe_gemm(sets[i].hidden, base.w1, ws13, blocks[i], pairs_per_row=topk, config=cfg, check=False)

    def base2(i, cfg=cfg2):
        fused_moe_gemm(ws2, base.w2, out2, blocks[i], pairs_per_row=1, config=cfg, check=False)
        launch_weighted_topk_sum(out2, sets[i].topk_weights, fin)

    def split1(i, S, BN, stages, act=True):
        b = blocks[i]
        desc = TensorDescriptor(base.w1.view(E * N, K), [E * N, K], [K, 1], [BN, 128])
        grid = (b.max_blocks * triton.cdiv(N, BN) * S,)
        splitk_kernel[grid](sets[i].hidden, desc, part, b.buffer, b.expert_offset, b.post_offset, N, K, R,
                            sets[i].hidden.stride(0), BLOCK_M=16, BLOCK_N=BN, BLOCK_K=128, SPLIT=S, PAIRS=topk,
                            STAGES=stages, num_warps=4, num_stages=stages)
        if act:
            reduce_silu_kernel[(triton.cdiv(R, 2), triton.cdiv(I, 1024))](part, ws2, R, I, SPLIT=S, BLOCK_R=2,
                                                                          BLOCK_H=1024)

    def split2(i, S, BN, stages):
        b = blocks[i]
        desc = TensorDescriptor(base.w2.view(E * K, I), [E * K, I], [I, 1], [BN, 128])
        grid = (b.max_blocks * triton.cdiv(K, BN) * S,)
        splitk_kernel[grid](ws2, desc, part, b.buffer, b.expert_offset, b.post_offset, K, I, R,
                            ws2.stride(0), BLOCK_M=16, BLOCK_N=BN, BLOCK_K=128, SPLIT=S, PAIRS=1,
                            STAGES=stages, num_warps=4, num_stages=stages)
        reduce_sum_kernel[(M, triton.cdiv(K, 256))](part, sets[i].topk_weights, fin, M, K, TOPK=topk, SPLIT=S,
                                                    BLOCK_K=256)

    # correctness: split vs table
    base1(0)
    ref_act = ws2.clone()
    calls = {"g1 table+act": [lambda i=i: base1(i) for i in range(8)],
             "g1 table only": [lambda i=i: base1_only(i) for i in range(8)]}
    for bn in (64, 32):
        c = dataclasses.replace(cfg1, BLOCK_N=bn)
        calls[f"g1 16x{bn} only"] = [lambda i=i, c=c: base1_only(i, c) for i in range(8)]
    for S in (1, 2, 4, 8):
        for BN in (128, 64):
            for st in (3, 4):
                if 2048 // 128 // S < 1:
                    continue
                split1(0, S, BN, st)
                torch.testing.assert_close(ws2.float(), ref_act.float(), rtol=2e-2, atol=2e-2)
                calls[f"g1 split S{S} BN{BN} s{st} +act"] = [lambda i=i, S=S, BN=BN, st=st: split1(i, S, BN, st)
                                                          for i in range(8)]
                calls[f"g1 split S{S} BN{BN} s{st} only"] = [
                    lambda i=i, S=S, BN=BN, st=st: split1(i, S, BN, st, act=False) for i in range(8)]
    base2(0)
    ref_fin = fin.clone()
    calls["g2 table+sum"] = [lambda i=i: base2(i) for i in range(8)]
    for S in (1, 2, 3):
        for BN in (128, 64):
            if (768 // 128) % S:
                continue
            split2(0, S, BN, 4)
            torch.testing.assert_close(fin.float(), ref_fin.float(), rtol=2e-2, atol=2e-2)
            calls[f"g2 split S{S} BN{BN} s4 +sum"] = [lambda i=i, S=S, BN=BN: split2(i, S, BN, 4) for i in range(8)]
    times = measure.shuffled_rounds(calls, 5)
    for name, v in times.items():
        row = {"M": M, "variant": name, "graph_us": statistics.median(v), "spread": (max(v) - min(v)) / min(v)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows

def main() -> int:
    if not torch.cuda.is_available() or moekit.device.interpreting():
        print("gpu_split_k_decode: needs a CUDA GPU")
        return 0
    E, topk, K, I = 128, 8, 2048, 768
    rows = []
    for M in [int(x) for x in os.environ.get("MS", "1 8").split()]:
        rows += case(M, E=E, topk=topk, K=K, I=I)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "splitk.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
