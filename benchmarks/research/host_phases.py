"""Where one eager forward's host time goes, phase by phase, on the machine at hand.

Wraps the modular kernel's phases (door, prepare, plan, count, call, trace, the experts' launches,
finalize) in timers and prints microseconds per forward for Qwen3-30B-A3B bf16 at M=1, then a
cProfile of the same calls (top entries by own time)::

    python -m benchmarks.research.host_phases [--calls 2000] [--M 1] [--trace-counts 0|1]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moekit
from moekit.hopper.experts import HopperTritonExperts
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.testing import make_problem


def wrap(owner, name: str, label: str, acc: dict) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            acc[label] += time.perf_counter_ns() - t0

    setattr(owner, name, timed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.research.host_phases")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--M", type=int, default=1)
    ap.add_argument("--trace-counts", type=int, default=1)
    args = ap.parse_args(argv)
    import moekit.hopper.experts as T
    import moekit.hopper.pair_blocks as PB
    import moekit.modular_kernel as MK
    import moekit.plan as P
    import moekit.prepare_finalize.no_ep as NE
    import moekit.trace as TR
    import moekit.workspace as W

    device = moekit.device.get_device()
    p = make_problem(args.M, E=128, topk=8, K=2048, N=1536, dtype=torch.bfloat16, device=device)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), HopperTritonExperts(), trace_counts=bool(args.trace_counts))
    forward = lambda: kernel(*p.inputs(), **p.options())
    for _ in range(20):
        forward()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        forward()
    sync()
    print(f"M={args.M} trace_counts={args.trace_counts}: {(time.perf_counter() - t0) / args.calls * 1e6:.1f} us "
          "per forward, back to back")  # fmt: skip
    acc = collections.Counter()
    for owner, name, label in ((MK.ModularKernel, "_door", "door"), (NE.NoEPPrepareFinalize, "prepare", "prepare"),
                               (P.TokenPlanner, "plan", "plan"), (MK.ModularKernel, "_counts", "counts"),
                               (P.TokenPlan, "call", "call"), (TR.Trace, "add", "trace.add"),
                               (T.HopperTritonExperts, "apply", "apply"), (T, "launch_align", "  align"),
                               (T, "fused_moe_gemm", "  gemm x2"), (T, "run_lean", "  lean relaunch"),
                               (T, "launch_stream", "  stream"), (PB, "pair_blocks", "  pair blocks"),
                               (NE.NoEPPrepareFinalize, "finalize", "finalize"),
                               (MK.ModularKernel, "_experts_pass", "experts pass"),
                               (W.WorkspacePool, "follow", "pool.follow")):  # fmt: skip
        wrap(owner, name, label, acc)
    for _ in range(args.calls):
        forward()
    sync()
    for label, ns in acc.items():
        print(f"{label:14s} {ns / args.calls / 1000:8.2f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls // 4):
        forward()
    prof.disable()
    sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(35)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
