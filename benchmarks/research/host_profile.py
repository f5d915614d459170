"""Where the host's time goes in one eager MoE forward (GPU idle, so every microsecond is Python).

Prints host microseconds per call of: a bare Triton launch and a torch op (to calibrate this
machine's host speed), ``count_expert_num_tokens`` (scan and histogram, per-chunk size), and the
whole Qwen3-30B-A3B layer at M=1, and at M=16384 in chunks of 8192 sorted rows (host time per
call while the GPU is busy: the enqueue cost alone), then a cProfile of both call trees::

    python -m benchmarks.research.host_profile [--calls 300] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moekit
from moekit import roofline
from moekit.hopper.experts import HopperTritonExperts
from moekit.hopper.graphed import GraphedKernel
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.testing import make_problem


@triton.jit
def _noop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def host_us(fn, calls: int) -> float:
    """Host microseconds per call: ``calls`` calls back to back, one sync at the end."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.research.host_profile")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    x = torch.zeros(64, device="cuda")
    ids = torch.randint(0, 64, (128, 8), device="cuda", dtype=torch.int32)
    shape = roofline.get_shape("qwen3_30b_a3b")
    p = make_problem(1, E=shape.E, topk=shape.topk, K=shape.K, N=shape.N, dtype=torch.bfloat16, device="cuda")
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), HopperTritonExperts(), trace_counts=False)
    graphed = GraphedKernel(moekit.ModularKernel(NoEPPrepareFinalize(), HopperTritonExperts(), trace_counts=False))
    big = make_problem(16384, E=shape.E, topk=shape.topk, K=shape.K, N=shape.N, dtype=torch.bfloat16, device="cuda")
    row_kernel = moekit.ModularKernel(NoEPPrepareFinalize(), HopperTritonExperts(), chunk_size=8192, chunk_by="rows",
                                trace_counts=False)  # fmt: skip
    graphed(*p.inputs(), **p.options())  # captured: the pieces of one replay below
    replay = next(iter(graphed._graphs.values()))
    statics, givens = list(replay.inputs), [p.hidden, p.topk_weights, p.topk_ids]
    event = torch.cuda.Event()
    timed = {
        "bare triton launch": lambda: _noop_kernel[(1,)](x, 64, BLOCK=64),
        "replay piece: 3 copy_": lambda: [s.copy_(g) for s, g in zip(statics, givens, strict=True)],
        "replay piece: _foreach_copy_": lambda: torch._foreach_copy_(statics, givens),
        "replay piece: graph.replay()": replay.graph.replay,
        "replay piece: output clone": replay.output.clone,
        "replay piece: event record": event.record,
        "fused_moe M=1 (replays)": lambda: moekit.fused_moe(*p.inputs()),
        "torch.empty(64)": lambda: torch.empty(64, device="cuda"),
        "count scan 128x8 E=64": lambda: moekit.count_expert_num_tokens(ids, 64, method="scan"),
        "count histogram 128x8 E=64": lambda: moekit.count_expert_num_tokens(ids, 64),
        "layer qwen3 bf16 M=1": lambda: kernel(*p.inputs(), **p.options()),
        "layer qwen3 bf16 M=1 GraphedKernel": lambda: graphed(*p.inputs(), **p.options()),
        "layer qwen3 M=16384 R=8192 rows": lambda: row_kernel(*big.inputs(), **big.options()),
    }
    for name, fn in timed.items():
        calls = 5 if "rows" in name else args.calls  # its GPU time (~3 ms) would fill the launch queue
        print(f"{name:<32} {host_us(fn, calls):8.1f} us host per call", flush=True)
    print(f"row-chunked call: {len(row_kernel.last_trace)} chunks")
    for what, fn, calls in (("M=1", lambda: kernel(*p.inputs(), **p.options()), args.calls),
                            ("fused_moe M=1 (replays)", lambda: moekit.fused_moe(*p.inputs()), args.calls),
                            ("M=16384 rows", lambda: row_kernel(*big.inputs(), **big.options()), 5)):  # fmt: skip
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key).print_stats(args.top)
            print(f"== {what}, by {key} ({calls} calls)\n" + "\n".join(out.getvalue().splitlines()[4:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
