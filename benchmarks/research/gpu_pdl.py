#!/usr/bin/env python3
"""The layer with and without programmatic dependent launch (``moekit.hopper.pdl``), in one process.

    python3 benchmarks/research/gpu_pdl.py [--shape qwen3_30b_a3b] [--M 1 8 128 1024 4096] [--rounds 5]
    python3 benchmarks/research/gpu_pdl.py --compare steps    # the align/reduce launch shapes, new / old
    python3 benchmarks/research/gpu_pdl.py --compare pairs --M 1 2 4   # decode without the align, by PAIR_MAX

For each M and both ``TritonExperts`` pipelines (``fuse_activation`` off and on), bf16, uniform
routing, with and without PDL (``--compare steps``: with the align's one-launch path for up to
``MEDIUM_MAX`` pairs and the weighted sum's grid of at least ``MIN_PROGRAMS`` programs, and with
both as they were before: three align launches past one tile, the sum's fixed tile; ``--compare
pairs``: one pair per block without an align up to ``pair_blocks.PAIR_MAX`` pairs, as committed, never
(``align``), or up to 16 and 32 pairs): the outputs are compared bit for bit, and against
``moekit.reference`` (first 64 tokens), before anything is timed. Then, per round and in a
shuffled order, each variant is timed as a CUDA graph over 8 input sets (M <= ``--graph-max-M``;
``benchmarks.harness.measure.graph_us``, the harness's graph mode) and eagerly, ``calls``
back-to-back plain calls cycling over the sets with one synchronize (what a user's loop gets;
no L2 flush, as in ``benchmarks/gpu_eager.py``). Medians over the rounds; ``spread`` = (max - min)
/ median. The SM clock is logged beside (``--clocks``). Writes ``$OUT/gpu_<compare>.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moekit  # noqa: I001  (before triton: sets the interpreter up on a CPU-only machine)
import torch

from benchmarks.harness import common, measure
from moekit.experts import TritonExperts
from moekit.hopper import pair_blocks, pdl
from moekit.hopper.configs import KernelConfig
from moekit.kernels import align, reduce
from moekit.modular_kernel import ModularKernel
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.roofline import SHAPES
from moekit.testing import assert_close, make_problem

SETS = 8


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 benchmarks/research/gpu_pdl.py", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3_30b_a3b", choices=sorted(SHAPES))
    ap.add_argument("--compare", default="pdl", choices=sorted(COMPARISONS))
    ap.add_argument("--M", type=int, nargs="+", default=[1, 8, 128, 1024, 4096])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--graph-max-M", type=int, default=128)
    ap.add_argument("--calls", type=int, default=400, help="eager calls per timing at M <= 128 (fewer above)")
    ap.add_argument("--clocks", default=None, help="a CSV path for the SM clock log")
    ap.add_argument("--profile", action="store_true",
                    help="also per-kernel profiler times with and without PDL (with it, a kernel's time "
                         "includes its wait for the previous one)")
    ap.add_argument("--gemm2", type=_tile, default=None, metavar="BMxBNxBK:WARPS:STAGES",
                    help="GEMM2's tile instead of the table's (e.g. 16x128x64:4:4)")
    return ap.parse_args(argv)


def _tile(text: str) -> KernelConfig:
    dims, warps, stages = text.split(":")
    bm, bn, bk = (int(v) for v in dims.split("x"))
    return KernelConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=int(warps), num_stages=int(stages))


class _Gemm2Tile(TritonExperts):
    """The table's tiles, GEMM2's replaced (``--gemm2``)."""

    def __init__(self, gemm2: KernelConfig | None, **kwargs):
        super().__init__(**kwargs)
        self._gemm2 = gemm2

    def tile_configs(self, problem, dtype):
        cfg1, cfg2 = super().tile_configs(problem, dtype)
        return cfg1, self._gemm2 or cfg2


@contextlib.contextmanager
def _old_steps():
    """The align and the weighted sum launched as before 2026-12-02's change (module limits)."""
    saved = align.MEDIUM_MAX, reduce.MIN_PROGRAMS
    align.MEDIUM_MAX, reduce.MIN_PROGRAMS = align.TILE, 0
    try:
        yield
    finally:
        align.MEDIUM_MAX, reduce.MIN_PROGRAMS = saved


@contextlib.contextmanager
def _pair_max(limit: int):
    """TritonExperts skips the align up to ``limit`` pairs (``moekit.hopper.pair_blocks.PAIR_MAX``)."""
    saved = pair_blocks.PAIR_MAX
    pair_blocks.PAIR_MAX = limit
    try:
        yield
    finally:
        pair_blocks.PAIR_MAX = saved


# Per comparison: the variants' names (the first is the default path) and how to enter each.
COMPARISONS = {
    "pdl": {"pdl": contextlib.nullcontext, "off": pdl.disabled},
    "steps": {"new": contextlib.nullcontext, "old": _old_steps},
    "pairs": {"pairs": contextlib.nullcontext, "align": lambda: _pair_max(0), "pairs16": lambda: _pair_max(16),
              "pairs32": lambda: _pair_max(32)},
}
def _variant(fn, enter):
    def call():
        with enter():
            return fn()

    return call


def case(shape, M: int, fuse: bool, args) -> list[dict]:
    variants = COMPARISONS[args.compare]
    names = tuple(variants)
    problems = [make_problem(M, E=shape.E, topk=shape.topk, K=shape.K, N=2 * shape.I, device="cuda", seed=s)
                for s in range(SETS)]  # fmt: skip
    w1, w2 = problems[0].w1, problems[0].w2  # one layer's weights, 8 token sets
    kernel = ModularKernel(NoEPPrepareFinalize(), _Gemm2Tile(args.gemm2, fuse_activation=fuse), trace_counts=False)
    calls = {v: [_variant(lambda p=p: kernel(p.hidden, w1, w2, p.topk_weights, p.topk_ids), enter) for p in problems]
             for v, enter in variants.items()}  # fmt: skip
    outs = {v: calls[v][0]().clone() for v in names}
    for v in names[1:]:
        torch.testing.assert_close(outs[v], outs[names[0]], rtol=0, atol=0)
    p0 = problems[0]
    rows = slice(0, min(M, 64))
    ref = moekit.reference.moe_reference(p0.hidden[rows].float(), w1.float(), w2.float(), p0.topk_weights[rows],
                                         p0.topk_ids[rows])  # fmt: skip
    assert_close(outs[names[0]][rows], ref, dtype=torch.bfloat16)
    n = args.calls if M <= 128 else max(40, args.calls // (M // 128))
    timings = {(v, mode): [] for v in names for mode in ("graph", "eager")}
    order = [(v, mode) for v, mode in timings if mode == "eager" or M <= args.graph_max_M]
    for r in range(args.rounds):
        random.Random(r).shuffle(order)
        for v, mode in order:
            fns = calls[v]
            us = measure.graph_us(fns) if mode == "graph" else measure.back_to_back_us(fns, n)
            timings[(v, mode)].append(us)
    out = []
    if args.profile:
        for v in names:
            # PDL's own A/B profiles its "pdl" side with it (the "off" calls are wrapped already);
            # other comparisons profile without it, so that a kernel's time holds no wait.
            ph = measure.kernel_phases(calls[v][0], with_pdl=args.compare == "pdl" and v == "pdl")
            out.append({"M": M, "fuse_activation": fuse, "variant": v, "mode": "profile", "kernels": ph.kernels})
            print(json.dumps(out[-1]), flush=True)
    for (v, mode), values in timings.items():
        if not values:
            continue
        med = statistics.median(values)
        out.append({"M": M, "fuse_activation": fuse, "variant": v, "mode": mode, "us": med, "us_rounds": values,
                    "spread": (max(values) - min(values)) / med, "bitwise_equal": True})  # fmt: skip
    return out


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available() or moekit.device.interpreting():
        print("gpu_pdl: needs a CUDA GPU")
        return 0
    if args.compare == "pdl" and not pdl.supported(torch.cuda.current_device()):
        print(f"gpu_pdl: programmatic dependent launch is off here ({torch.cuda.get_device_name()})")
        return 0
    shape = SHAPES[args.shape]
    rows = []
    with common.clock_log(args.clocks):
        for M in args.M:
            for fuse in (False, True):
                for row in case(shape, M, fuse, args):
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "us_rounds"}), flush=True)
    names = tuple(COMPARISONS[args.compare])
    print(f"\n{args.shape} bf16, {torch.cuda.get_device_name()}: median us ({' / '.join(names)})")
    for M in args.M:
        for fuse in (False, True):
            for mode in ("graph", "eager"):
                got = {r["variant"]: r["us"] for r in rows if r["M"] == M and r["fuse_activation"] == fuse
                       and r["mode"] == mode}  # fmt: skip
                if len(got) == len(names):
                    cells = " / ".join(f"{got[v]:8.1f}" for v in names)
                    ratio = got[names[0]] / got[names[1]]
                    print(f"  M={M:5d} fused={fuse!s:5} {mode:5}: {cells}  ({ratio:.3f}x {names[1]})")
    if os.environ.get("OUT"):
        env = common.environment()
        path = Path(os.environ["OUT"]) / f"gpu_{args.compare}.json"
        given = {k: str(v) if isinstance(v, KernelConfig) else v for k, v in vars(args).items()}
        payload = {"args": given, "environment": dataclasses.asdict(env), "rows": rows}
        path.write_text(json.dumps(payload, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
