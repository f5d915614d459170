"""Where a Triton launch spends its host time, piece by piece, for every launch of one moekit forward.

Records the launches of one eager forward (Qwen3-30B-A3B bf16, M=1 and M=128) by wrapping
``JITFunction.run``, then times, per recorded launch: the plain ``fn[grid](...)`` launch, Triton's
argument binder alone, its cache-key step alone, and the compiled kernel's ``run`` called directly
with the bound arguments (what a lean launch path would do). Also times ``torch.empty``, a stream
query, and the forward's host time (synchronized before each call, so the GPU never blocks it)
with a cProfile of it::

    python -m benchmarks.research.gpu_launch_cost [--calls 2000] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton
from triton.runtime import driver
from triton.runtime import jit as triton_jit

import moekit
from moekit import roofline
from moekit.experts import TritonExperts
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.testing import make_problem


def per_call_us(fn, calls: int) -> float:
    """Median host microseconds of ``fn()`` over ``calls`` calls, synchronized before each one."""
    fn()
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def back_to_back_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def record_launches(forward) -> list:
    """(jit function, args, kwargs, grid) of every Triton launch ``forward()`` makes."""
    seen = []
    original = triton_jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        seen.append((self, args, dict(kwargs), grid))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    triton_jit.JITFunction.run = run
    try:
        forward()
        torch.cuda.synchronize()
    finally:
        triton_jit.JITFunction.run = original
    return seen


def launch_pieces(fn, args, kwargs, grid, calls: int) -> dict:
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    kernel_cache, kernel_key_cache, target, backend, binder = fn.device_caches[device]
    full = dict(kwargs)
    full["debug"] = full.get("debug", fn.debug) or triton.knobs.runtime.debug
    full["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    bound, spec, options = binder(*args, **full)
    key = triton_jit.compute_cache_key(kernel_key_cache, spec, options)
    compiled = kernel_cache[key]
    values = tuple(bound.values())
    g = tuple(grid) + (1,) * (3 - len(grid))

    def direct():
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    return {
        "kernel": fn.__name__,
        "args": len(values),
        "plain_us": per_call_us(lambda: fn[grid](*args, **kwargs), calls),
        "binder_us": per_call_us(lambda: binder(*args, **full), calls),
        "cache_key_us": per_call_us(lambda: triton_jit.compute_cache_key(kernel_key_cache, spec, options), calls),
        "direct_run_us": per_call_us(direct, calls),
        "direct_run_b2b_us": back_to_back_us(direct, calls),
    }


def profile_text(fn, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.research.gpu_launch_cost")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    out = Path(args.out)
    shape = roofline.get_shape("qwen3_30b_a3b")
    result = {"cpu": platform.processor() or platform.machine(), "triton": triton.__version__,
              "torch": torch.__version__}  # fmt: skip
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
        result["cpu_model"] = next(line.split(":", 1)[1].strip() for line in lines if "model name" in line)
    except (OSError, StopIteration):
        pass
    x = torch.empty(64, device="cuda")
    result["torch_empty_us"] = per_call_us(lambda: torch.empty(64, device="cuda"), args.calls)
    empty_2d = lambda: torch.empty((1, 2048), dtype=torch.bfloat16, device="cuda")
    result["torch_empty_2d_us"] = per_call_us(empty_2d, args.calls)
    result["current_stream_us"] = per_call_us(lambda: torch.cuda.current_stream(), args.calls)
    result["view_slice_us"] = per_call_us(lambda: x[3:9], args.calls)
    result["layers"] = []
    for M in (1, 128):
        p = make_problem(M, E=shape.E, topk=shape.topk, K=shape.K, N=shape.N, dtype=torch.bfloat16, device="cuda")
        for trace_counts in (True, False):
            kernel = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(), trace_counts=trace_counts)
            fwd = lambda k=kernel, p=p: k(*p.inputs(), **p.options())
            launches = record_launches(fwd)
            row = {
                "M": M, "trace_counts": trace_counts, "launches": len(launches),
                "forward_host_us": per_call_us(fwd, max(200, args.calls // 4)),
                "forward_b2b_us": back_to_back_us(fwd, max(200, args.calls // 4)),
                "pieces": [launch_pieces(*launch, calls=args.calls // 2) for launch in launches],
            }
            result["layers"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "pieces"}), flush=True)
            for piece in row["pieces"]:
                print("   ", json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in piece.items()}))
            if M == 1 and trace_counts:
                text = profile_text(fwd, 300, 45)
                (out / "launch-cost-profile-M1.txt").write_text(text)
                print(text[:6000])
    (out / "launch-cost.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "layers"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
