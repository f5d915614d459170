#!/usr/bin/env python3
"""Every histogram variant of the count kernel (``benchmarks.variants``) on a GPU: exact, then timed.

    python3 benchmarks/gpu_count_variants.py          # H200, about a minute (< 90 s)
    python3 benchmarks/gpu_count_variants.py --smoke  # CPU interpreter: exactness only

Variants are the keys of ``benchmarks.variants.count_histogram.VARIANTS``, each run through
``count_variant`` (validation and Python launch included, as in ``moekit.count_expert_num_tokens``,
which is timed beside them as ``moekit``). Sections, printed as tables and written to
``$OUT/gpu_count_variants.json`` (when OUT is set) after each one:

1. baselines: a trivial Triton kernel (launch overhead) and ``torch.zeros(256)`` (the memset);
2. per case x variant: exact against ``count_reference`` (3 calls in a row, again after timing,
   and the graph's output), then
   - ``eager``: ``do_bench`` median (L2 flushed before each call; launches + Python included),
   - ``graph``: 20 calls captured in one CUDA graph, per call (L2 warm; no Python),
   - ``host``: Python-side microseconds per call (no sync: how fast calls can be issued);
3. int64 ids against int32 (bytes), on the two large cases;
4. a launch-shape sweep (block, programs per SM, warps) of the default and the fastest variant
   on the two large cases, as long as the time budget lasts;
5. the fastest exact variant per case against the targets (<= 8 us no map, <= 10 us EP=8 map).

Exit status 1 when any variant was wrong or failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

# moekit first: without a GPU it turns the interpreter on, which must happen before triton is
# imported at all (triton's own tl.sum & co. are jit functions decorated at import).
import moekit  # noqa: I001
import torch
import triton
import triton.language as tl
import triton.testing

from benchmarks.harness.common import environment, format_table
from benchmarks.variants import count_histogram as hist_mod
from benchmarks.variants.count_histogram import HistogramTuning, count_variant
from moekit import count_expert_num_tokens
from moekit.reference import count_reference
from moekit.routing import contiguous_expert_map

CASES = [(262144, 8, 256, 1), (262144, 8, 256, 8), (4096, 8, 256, 1), (128, 8, 64, 1)]  # M, topk, E, ep
SMOKE_CASES = [(300, 4, 64, 1), (300, 4, 64, 8), (40, 8, 32, 1), (3, 2, 16, 1)]
TARGETS_US = {(262144, 8, 256, 1): 8.0, (262144, 8, 256, 8): 10.0}
ANCHORS_US = {
    "memset variant as measured (best of 60 shapes), no map / EP=8 map": "15.2 / 13.9",
    "torch.histc, no map": 19.7,
    "earlier tl.histogram + atomics, no map / EP=8 map": "56.6 / 13.7",
    "bytes floor (8 MB / 4.3 TB/s)": 2.0,
}
SWEEP = [(2048, 4, 8), (4096, 1, 16), (4096, 2, 8), (4096, 2, 16), (4096, 4, 8), (8192, 1, 16), (8192, 2, 8),
         (8192, 2, 16), (8192, 4, 8), (16384, 1, 8)]  # block, programs per SM, warps
SWEEP_SMALL = [(512, 2, 4), (1024, 2, 8), (2048, 2, 16), (4096, 2, 16)]  # for 4096 x 8 ids
MOEKIT = "moekit"  # the row of moekit's own count_expert_num_tokens, timed beside the variants
BUDGET_S = 75  # the sweep stops here, so the whole run stays under 90 s
GRAPH_CALLS = 20


@triton.jit
def _trivial_kernel(x_ptr):
    tl.store(x_ptr + tl.program_id(0), 1)


def eager_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3


def graph_us(fn):
    """(us per call, last call's output): calls captured in one graph on a side stream, replayed."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # an eager warm-up: creates the zeroed scratch that captured calls use
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = [fn() for _ in range(GRAPH_CALLS)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return statistics.median(times), outs[-1]


def host_us(fn, calls: int = 200) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() and not moekit.device.interpreting() else (lambda: 0)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls * 1e6


def make_ids(M, topk, E, *, device, dtype=torch.int32):
    """Distinct experts per row, uniform, seeded (as benchmarks.harness.count does)."""
    g = torch.Generator(device=device).manual_seed(0)
    return torch.rand(M, E, generator=g, device=device).topk(topk, dim=1).indices.to(dtype).contiguous()


def same(got, expected) -> bool:
    return torch.equal(got.cpu(), expected.cpu())


def run_variant(name, ids, num_local, emap, expected, *, timed, tuning=None) -> dict:
    """One variant on one input: exactness first, then times. Never raises: errors go in the row.

    ``name`` "moekit" is moekit's own ``count_expert_num_tokens`` (no launch shape to report)."""
    if name == MOEKIT:  # `tuning` does not apply: the library chooses its own launch
        fn = lambda: count_expert_num_tokens(ids, num_local, emap)
        row = dict(variant=name)
    else:
        fn = lambda: count_variant(ids, num_local, emap, variant=name, tuning=tuning)
        shape = hist_mod.launch_shape(ids.numel(), num_local, ids.device, tuning or HistogramTuning(),
                                      hist_mod.VARIANTS[name])
        row = dict(variant=name, block=shape.block, grid=shape.grid, warps=shape.num_warps, bins=shape.bins)
    try:
        row["exact"] = all(same(fn(), expected) for _ in range(3))
        if timed and row["exact"]:
            row["eager_us"] = eager_us(fn)
            row["exact"] = same(fn(), expected)  # the counter still resets after hundreds of calls
            row["graph_us"], out = graph_us(fn)
            row["exact"] = row["exact"] and same(out, expected)
        row["host_us"] = host_us(fn, calls=200 if timed else 3)
    except Exception as e:  # one variant that fails to compile must not cost the others' numbers
        row["exact"] = False
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return row


def baselines() -> list[dict]:
    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    for what, fn in [("trivial Triton kernel", lambda: _trivial_kernel[(1,)](x)),
                     ("torch.zeros(256, int32)", lambda: torch.zeros(256, dtype=torch.int32, device="cuda"))]:
        graph, _ = graph_us(fn)
        rows.append(dict(what=what, eager_us=eager_us(fn), graph_us=graph, host_us=host_us(fn)))
    return rows


class Report:
    """Collects sections, prints them, and rewrites the JSON after each one."""

    def __init__(self, env):
        self.payload = dict(env=asdict(env), anchors_us=ANCHORS_US, default_variant=hist_mod.DEFAULT_VARIANT,
                            default_tuning=asdict(HistogramTuning()), sections={})
        self.out = Path(os.environ["OUT"]) / "gpu_count_variants.json" if os.environ.get("OUT") else None

    def section(self, title, rows, cols):
        print(f"\n== {title}\n" + format_table(rows, cols), flush=True)
        self.payload["sections"][title] = rows
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(self.payload, indent=1, default=str))


VARIANT_COLS = ["variant", "block", "grid", "warps", "bins", "exact", ("eager_us", "eager us", ".2f"),
                ("graph_us", "graph us", ".2f"), ("host_us", "host us", ".1f"), "error"]


def inputs(M, topk, E, ep, *, device, dtype=torch.int32):
    """(ids, E_local, expert_map or None, expected counts) for one case; the map is rank 0's."""
    ids = make_ids(M, topk, E, device=device, dtype=dtype)
    emap = contiguous_expert_map(E, ep, 0, device=device) if ep > 1 else None
    return ids, E // ep, emap, count_reference(ids, E // ep, emap)


def sweep(name, case, shapes, *, device, deadline) -> list[dict]:
    """Eager time of one variant over launch shapes, until the deadline."""
    ids, num_local, emap, expected = inputs(*case, device=device)
    rows = []
    for block, pps, warps in shapes:
        if time.perf_counter() > deadline:
            break
        tuning = HistogramTuning(block=block, programs_per_sm=pps, num_warps=warps)
        fn = lambda: count_variant(ids, num_local, emap, variant=name, tuning=tuning)  # noqa: B023
        try:
            exact = same(fn(), expected)
            us = eager_us(fn) if exact else None
        except Exception as e:
            exact, us = False, type(e).__name__
        rows.append(dict(variant=name, M=case[0], ep=case[3], block=block, programs_per_sm=pps,
                         num_warps=warps, exact=exact, eager_us=us))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes, exactness only")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    device = moekit.device.get_device()
    timed = device.type == "cuda"
    if not timed and not args.smoke:
        print("needs a CUDA GPU (or pass --smoke for an interpreter exactness run)")
        return 2
    env = environment()
    print(f"{env.gpu} ({env.sms} SMs), torch {env.torch}, triton {env.triton}; default variant "
          f"{hist_mod.DEFAULT_VARIANT}, {HistogramTuning()}")
    for what, us in ANCHORS_US.items():
        print(f"  anchor: {what}: {us} us")
    report = Report(env)
    if timed:
        report.section("baselines", baselines(), ["what", ("eager_us", "eager us", ".2f"),
                                                  ("graph_us", "graph us", ".2f"), ("host_us", "host us", ".1f")])
    # The interpreter pretends 2 SMs: small tiles there give several programs and the last-program path.
    tuning = None if timed else HistogramTuning(block=128, programs_per_sm=3)
    failed, best, fastest_variant = False, {}, {}
    for case in SMOKE_CASES if args.smoke else CASES:
        ids, num_local, emap, expected = inputs(*case, device=device)
        rows = [run_variant(name, ids, num_local, emap, expected, timed=timed, tuning=tuning)
                for name in (MOEKIT, *hist_mod.VARIANTS)]
        failed |= not all(r["exact"] for r in rows)
        timed_rows = [r for r in rows if r["exact"] and "eager_us" in r]
        if timed_rows:
            best[case] = min(timed_rows, key=lambda r: r["eager_us"])
        if [r for r in timed_rows if r["variant"] != MOEKIT]:
            fastest_variant[case] = min((r for r in timed_rows if r["variant"] != MOEKIT),
                                        key=lambda r: r["eager_us"])["variant"]
        M, topk, E, ep = case
        title = f"{M}x{topk} ids, E={E}, ep={ep} (E_local={E // ep}), at {time.perf_counter() - t0:.0f} s"
        report.section(title, rows, VARIANT_COLS)
    if not timed:
        print(f"\n{'SOME VARIANT WAS WRONG OR FAILED' if failed else 'all variants exact'} (interpreter)")
        return 1 if failed else 0

    rows = []
    for case in CASES[:2]:
        ids, num_local, emap, expected = inputs(*case, device=device, dtype=torch.int64)
        for name in dict.fromkeys([MOEKIT, hist_mod.DEFAULT_VARIANT, "memset"]):
            row = run_variant(name, ids, num_local, emap, expected, timed=True)
            rows.append(dict(case=f"ep={case[3]}", ids="int64", **row))
    failed |= not all(r["exact"] for r in rows)
    report.section("int64 ids (compare with the int32 rows above)", rows, ["case", "ids", *VARIANT_COLS])

    fastest = fastest_variant.get(CASES[0], hist_mod.DEFAULT_VARIANT)  # moekit's has no launch shape to sweep
    plan = [(hist_mod.DEFAULT_VARIANT, CASES[0], SWEEP), (hist_mod.DEFAULT_VARIANT, CASES[1], SWEEP),
            (hist_mod.DEFAULT_VARIANT, CASES[2], SWEEP_SMALL)]
    if fastest != hist_mod.DEFAULT_VARIANT:
        plan += [(fastest, CASES[0], SWEEP), (fastest, CASES[1], SWEEP)]
    rows = [row for name, case, shapes in plan for row in sweep(name, case, shapes, device=device,
                                                                 deadline=t0 + BUDGET_S)]
    failed |= not all(r["exact"] for r in rows)
    cols = ["variant", "M", "ep", "block", "programs_per_sm", "num_warps", "exact", ("eager_us", "eager us", ".2f")]
    report.section(f"launch-shape sweep (eager; stops at {BUDGET_S} s)", rows, cols)

    summary = [dict(case=f"{c[0]}x{c[1]} E={c[2]} ep={c[3]}", best=r["variant"], eager_us=r["eager_us"],
                    graph_us=r["graph_us"], target_us=TARGETS_US.get(c),
                    met=r["eager_us"] <= TARGETS_US[c] if c in TARGETS_US else None) for c, r in best.items()]
    cols = ["case", "best", ("eager_us", "eager us", ".2f"), ("graph_us", "graph us", ".2f"), "target_us", "met"]
    report.section("fastest exact variant per case (default tuning)", summary, cols)
    print(f"\n{'SOME VARIANT WAS WRONG OR FAILED' if failed else 'all variants exact'}; "
          f"{time.perf_counter() - t0:.0f} s" + (f"; wrote {report.out}" if report.out else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
