"""Expert parallelism on GPUs over NCCL: correctness, then dispatch and combine time against M.

    python benchmarks/gpu_ep_bench.py              # 2 GPUs, NCCL (about a minute)
    python benchmarks/gpu_ep_bench.py --world 1    # one GPU: the exchange is a local copy, so this
                                                   # measures the stage's own cost (host sync or not)
    python benchmarks/gpu_ep_bench.py --smoke      # 2 CPU ranks over gloo, tiny sizes (checks the script)

1. Correctness: ``moekit.ep.run_rank`` on every rank (bf16 TritonExperts; fp8 block
   TritonOrDeepGemmExperts chunked at 128 so that chunks cross the M >= 128 switch; one rank
   with M=0), compared with the fp32 reference over the full weights.
2. Timing of ``All2AllPrepareFinalize`` alone, DeepSeek-V3-like shapes (K=7168, E=256, topk=8):
   ``prepare`` (split exchange + one host sync + rows/ids[/scales] exchange) and ``finalize``
   (reverse exchange + weighted sum), for M tokens per rank, in each ``--modes`` (``exact``;
   ``capacity``: fixed blocks of M rows per rank pair, no host sync, and also timed as one CUDA
   graph of prepare + finalize). CUDA events around each call, a barrier before it, median of the
   repetitions. "GB/s" is bytes this rank sends / time.

Prints a table; writes ``$OUT/gpu_ep_bench.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import moekit  # noqa: I001  (first: it turns Triton's interpreter on before triton is imported)
import torch
import torch.distributed as dist

from moekit.distributed import launch
from moekit.ep import EPConfig, run_rank
from moekit.prepare_finalize.all2all import All2AllPrepareFinalize
from moekit.routing import contiguous_expert_map, uniform_router
from moekit.types import ExpertPlacement, QuantScheme


def _correctness(rank, world, smoke):
    big = dict(K=128, N=256) if smoke else dict(K=2048, N=1536)
    Ms = (24, 0) if smoke else (1024, 0)
    cases = [
        EPConfig((33, 22) if smoke else (512, 384), E=16, topk=2, chunk_size=None, **big),
        EPConfig(Ms, E=16, topk=4, chunk_size=8 if smoke else 256, **big),
        EPConfig((40, 30) if smoke else (700, 300), E=32, topk=8, chunk_size=16 if smoke else 128,
                 experts="triton_or_deep_gemm", quant=QuantScheme.FP8_BLOCK, **big),
    ]
    rows = []
    for c in cases:
        r = run_rank(rank, world, c, gather=False)
        rows.append(dict(experts=c.experts, quant=c.quant.value, Ms=list(c.Ms), chunk=c.chunk_size, rank=rank,
                         received=r.received, chunks=len(r.backends), backends=sorted(set(r.backends)),
                         max_abs_err=r.max_abs_err, close=r.close, error=r.error))
    return rows


def _time(fn, reps, warmup, device):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def _timing(rank, world, smoke, reps, modes=("exact",)):
    device = moekit.device.get_device()
    K, E, topk = (256, 16, 4) if smoke else (7168, 256, 8)
    Ms = (16, 64) if smoke else (1, 128, 1024, 4096, 16384)
    placement = ExpertPlacement(E, E // world, contiguous_expert_map(E, world, rank, device=device))
    rows = []
    for mode, M, quant in [(m, M, q) for m in modes for M in Ms for q in (QuantScheme.NONE, QuantScheme.FP8_BLOCK)]:
        capacity = mode == "capacity"
        kw = dict(mode="capacity", max_tokens_per_rank=M, check="deferred") if capacity else {}
        pf = All2AllPrepareFinalize(**kw)
        hidden = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        w, ids = uniform_router(M, E, topk, seed=rank + M, device=device)
        prep = pf.prepare(hidden, w, ids, quant=quant, placement=placement)
        R = prep.a1q.shape[0]
        fused = torch.randn(R, topk if capacity else 1, K, device=device, dtype=torch.bfloat16)
        out = torch.empty(M, K, device=device, dtype=torch.bfloat16)

        def dispatch(pf=pf, hidden=hidden, w=w, ids=ids, quant=quant):
            return pf.prepare(hidden, w, ids, quant=quant, placement=placement)

        def combine(pf=pf, fused=fused, prep=prep, out=out):
            return pf.finalize(fused, prep, output=out)

        t_dispatch, t_combine = _time(dispatch, reps, 3, device), _time(combine, reps, 3, device)
        sent = world * M if capacity else prep.handle.pairs.numel()  # capacity: fixed blocks
        row_bytes = K * (1 if quant is QuantScheme.FP8_BLOCK else 2)
        row = dict(rank=rank, M=M, mode=mode, quant=quant.value, rows_sent=sent, received=R,
                   dispatch_us=t_dispatch, combine_us=t_combine, dispatch_GBps=sent * row_bytes / t_dispatch / 1e3,
                   combine_GBps=R * K * 2 / t_combine / 1e3)  # fmt: skip
        if capacity and device.type == "cuda":
            row["graph_us"] = _graph_us(lambda c=combine, d=dispatch: c(prep=d()))
        rows.append(row)
    return rows


def _graph_us(fn, replays: int = 20) -> float | str:
    """Median us of one CUDA-graph replay of ``fn`` (prepare + finalize), or the capture's error."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # a sync or an uncapturable call is a result
        return f"{type(e).__name__}: {str(e)[:120]}"
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def bench_rank(rank, world, smoke, reps, modes=("exact", "capacity")):
    """Rank function for launch: correctness rows, then timing rows."""
    correctness = _correctness(rank, world, smoke) if world == 2 else []
    return {"correctness": correctness, "timing": _timing(rank, world, smoke, reps, modes)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="2 CPU ranks over gloo, tiny sizes")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=170.0)
    ap.add_argument("--world", type=int, default=2, help="ranks (one GPU each); 1: the stage's own cost")
    ap.add_argument("--modes", nargs="+", default=["exact", "capacity"], choices=["exact", "capacity"])
    args = ap.parse_args(argv)
    backend = "gloo" if args.smoke else "nccl"
    if not args.smoke and torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}; try --smoke", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    results = launch(bench_rank, args.world, backend=backend, args=(args.smoke, args.reps, tuple(args.modes)),
                     timeout_s=args.timeout)  # fmt: skip
    correctness = [row for r in results for row in r["correctness"]]
    timing = [row for r in results for row in r["timing"]]
    print(f"backend {backend}, {args.world} rank(s), {time.monotonic() - t0:.0f} s")
    print("\ncorrectness (every rank vs the fp32 reference over all experts)")
    for c in correctness:
        status = c["error"] or f"max|err| {c['max_abs_err']:.3g} {'ok' if c['close'] else 'MISMATCH'}"
        print(f"  rank {c['rank']} {c['experts']:<20} {c['quant']:<9} Ms={c['Ms']} chunk={c['chunk']} "
              f"recv={c['received']} chunks={c['chunks']} {c['backends']}: {status}")
    print("\nall-to-all time per call (median, rank 0; graph: prepare + finalize as one CUDA graph)")
    print(f"  {'mode':<9} {'M/rank':>7} {'quant':<9} {'dispatch us':>12} {'combine us':>11} {'graph us':>10}")
    for a in (t for t in timing if t["rank"] == 0):
        g = a.get("graph_us", "-")
        g = f"{g:.1f}" if isinstance(g, float) else str(g)[:40]
        print(f"  {a['mode']:<9} {a['M']:>7} {a['quant']:<9} {a['dispatch_us']:>12.1f} {a['combine_us']:>11.1f} "
              f"{g:>10}")
    out = os.environ.get("OUT")
    if out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
        os.makedirs(out, exist_ok=True)  # as the other checks do
        with open(os.path.join(out, "gpu_ep_bench.json"), "w") as f:
            report = {"backend": backend, "device": device, "correctness": correctness, "timing": timing}
            json.dump(report, f, indent=1)
    return 0 if all(c["close"] for c in correctness) else 1


if __name__ == "__main__":
    sys.exit(main())
