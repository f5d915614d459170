#!/usr/bin/env python3
"""The align's three paths at the sizes between them: what sets ``align.SMALL_MAX`` and ``MEDIUM_MAX``.

    python3 benchmarks/research/gpu_align_paths.py [--E 128] [--topk 8] [--M 1 2 4 8 16 32 64 128 256] [--rounds 5]

``moekit.kernels.align`` runs one program for up to one tile of pairs (``"one program"``), one
launch whose programs each count every pair themselves (``"one launch"``), or count, scan and
scatter (``"three launches"``); each is timed where it applies (one program: up to TILE pairs).
For each M (uniform top-k routing over E experts, 16-row blocks as the decode and small-M GEMMs use,
and 64-row blocks) both paths' layouts are compared entry by entry, then each is timed as a CUDA
graph of the align alone over 8 id sets (``benchmarks.harness.measure.graph_us``, PDL as by
default) in shuffled rounds, and profiled per kernel (without PDL). Writes
``$OUT/gpu_align_paths.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moekit  # noqa: I001  (before triton: sets the interpreter up on a CPU-only machine)
import torch

from benchmarks.harness import common, measure
from moekit.kernels import align

SETS = 8
# path -> (SMALL_MAX, MEDIUM_MAX) that force it
PATHS = {"one program": (align.TILE, 1 << 30), "one launch": (0, 1 << 30), "three launches": (0, 0)}


@contextlib.contextmanager
def _path(name: str):
    saved = align.SMALL_MAX, align.MEDIUM_MAX
    align.SMALL_MAX, align.MEDIUM_MAX = PATHS[name]
    try:
        yield
    finally:
        align.SMALL_MAX, align.MEDIUM_MAX = saved


def case(M: int, E: int, topk: int, block_m: int, rounds: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(M)
    sets = [torch.rand(M, E, device="cuda", generator=gen).topk(topk, dim=1).indices.to(torch.int32)
            for _ in range(SETS)]  # fmt: skip

    def calls(name):
        def one(ids):
            with _path(name):
                return align.launch_align(ids, block_m, E, keep_empty=True)

        return [lambda ids=ids: one(ids) for ids in sets]

    paths = [name for name in PATHS if name != "one program" or M * topk <= align.TILE]
    fns = {name: calls(name) for name in paths}
    first, *rest = (fns[name][0]() for name in paths)
    for other in rest:  # (the three-launch buffer also holds its scratch counts)
        for part in ("sorted_token_ids", "expert_ids", "num_tokens_post_padded"):
            assert torch.equal(getattr(first, part), getattr(other, part)), f"M={M}: {part} differs"
    times = measure.shuffled_rounds(fns, rounds)
    rows = []
    for name in paths:
        ph = measure.kernel_phases(fns[name][0])
        med = statistics.median(times[name])
        rows.append({"M": M, "pairs": M * topk, "E": E, "block_m": block_m, "path": name, "graph_us": med,
                     "us_rounds": times[name], "kernels": ph.kernels})  # fmt: skip
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "us_rounds"}), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 benchmarks/research/gpu_align_paths.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--E", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--M", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--block-m", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available() or moekit.device.interpreting():
        print("gpu_align_paths: needs a CUDA GPU")
        return 0
    rows = [row for bm in args.block_m for M in args.M for row in case(M, args.E, args.topk, bm, args.rounds)]
    gpu = torch.cuda.get_device_name()
    print(f"\nalign alone, E={args.E}, topk={args.topk}, {gpu}: graph us ({' / '.join(PATHS)})")
    for bm in args.block_m:
        for M in args.M:
            got = {r["path"]: r["graph_us"] for r in rows if r["M"] == M and r["block_m"] == bm}
            cells = " / ".join(f"{got[p]:6.2f}" if p in got else "     -" for p in PATHS)
            print(f"  block_m={bm:3d} M={M:5d} ({M * args.topk:6d} pairs): {cells}")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "gpu_align_paths.json"
        env = dataclasses.asdict(common.environment())
        limits = {"small_max": align.SMALL_MAX, "medium_max": align.MEDIUM_MAX}
        path.write_text(json.dumps({"args": vars(args), "environment": env, **limits, "rows": rows}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
