"""``python -m benchmarks.harness count``: tokens per expert, four ways (and the variants), on the GPU.

Contenders (each starts from the raw global ids and the optional expert_map):

- ``scan``: moekit's seed-algorithm kernel (one program per local expert reads every id);
- ``histogram``: moekit's one-pass kernel (tl.histogram per tile; stateless: one launch that
  stores directly when one program suffices, else a zero-fill and one atomic per bin per program);
- ``torch.bincount``: map and mask in torch, then ``bincount`` (it syncs with the host);
- ``torch.histc``: map and mask in torch, then ``histc`` on float ids;
- with ``--variants``, ``variant:<name>``: the histogram variants of :mod:`benchmarks.variants`
  (``benchmarks/gpu_count_variants.py`` compares them in more depth).

Every contender is checked against :func:`moekit.reference.count_reference` before it is timed.
``--sweep`` times one variant over launch shapes (the ``HistogramTuning`` of
:mod:`benchmarks.variants`) on the largest case.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from dataclasses import asdict

import torch

from benchmarks.harness.common import (
    bench_median_us,
    cpu_median_us,
    environment,
    floor_us,
    format_table,
    gpu_or_reason,
    results_path,
    write_json,
)
from benchmarks.variants.count_histogram import VARIANTS, HistogramTuning, count_variant
from moekit import count_expert_num_tokens
from moekit.reference import count_reference
from moekit.routing import contiguous_expert_map

# (M, topk, E), the target first: a run cut short by a time limit still has it.
CASES = [(262144, 8, 256), (65536, 8, 256), (4096, 8, 256), (16384, 6, 64), (128, 8, 64)]
METHODS = ("scan", "histogram", "torch.bincount", "torch.histc")
EAGER_ROUNDS = 3
ANCHORS = {  # recorded H200 anchors, do_bench medians, 262144 x 8 ids, E = 256
    "seed scan kernel, no map": 622.0,
    "seed scan kernel with a map (later upstream version)": 975.0,
    "torch.histc": 19.7,
    "one-pass tl.histogram + atomics (as recorded: same ids / EP map)": "56.6 / 13.7",
    "zero-fill + tl.histogram kernel, best of 60 launch shapes (no map / EP map)": "15.2 / 13.9",
    "target: histogram, no map / EP=8 map": "<= 8 / <= 10",
}
SWEEP = dict(block=(1024, 2048, 4096, 8192, 16384), programs_per_sm=(1, 2, 4, 8), num_warps=(4, 8, 16))


def _local_ids(ids: torch.Tensor, num_local: int, emap: torch.Tensor | None) -> torch.Tensor:
    """Local id per (token, slot), -1 where not local; plain torch, no host sync."""
    ids = ids.reshape(-1).long()
    limit = num_local if emap is None else emap.numel()
    ok = (ids >= 0) & (ids < limit)
    local = ids.clamp(0, limit - 1)
    if emap is not None:
        local = emap.long()[local]
        ok &= (local >= 0) & (local < num_local)
    return torch.where(ok, local, -1)


def contenders(num_local: int, emap: torch.Tensor | None, variants: tuple[str, ...] = ()):
    """name -> fn(ids) returning int32 counts (``variants``: names of :data:`VARIANTS` to add)."""

    def bincount(ids):  # shift by one so -1 lands in bin 0 and no boolean indexing (a sync) is needed
        return torch.bincount(_local_ids(ids, num_local, emap) + 1, minlength=num_local + 1)[1:].int()

    def histc(ids):  # -1 falls outside [0, num_local] and is not counted
        local = _local_ids(ids, num_local, emap).float()
        return torch.histc(local, bins=num_local, min=0, max=num_local).int()

    fns = {
        "scan": lambda ids: count_expert_num_tokens(ids, num_local, emap, method="scan"),
        "histogram": lambda ids: count_expert_num_tokens(ids, num_local, emap, method="histogram"),
        "torch.bincount": bincount,
        "torch.histc": histc,
    }
    for v in variants:
        fns[f"variant:{v}"] = lambda ids, v=v: count_variant(ids, num_local, emap, variant=v)
    return fns


def make_ids(M: int, topk: int, E: int, *, dtype: torch.dtype, device) -> torch.Tensor:
    """Distinct experts per row, uniform, seeded (argsort-free: topk of random scores)."""
    g = torch.Generator(device=device).manual_seed(0)
    scores = torch.rand(M, E, generator=g, device=device)
    return scores.topk(topk, dim=1).indices.to(dtype).contiguous()


def run_case(M, topk, E, ep, *, dtype, device, graph, timer, variants: tuple[str, ...] = ()) -> list[dict]:
    ids = make_ids(M, topk, E, dtype=dtype, device=device)
    emap = contiguous_expert_map(E, ep, 0, device=device) if ep > 1 else None
    num_local = E // ep
    expected = count_reference(ids, num_local, emap).cpu()
    bytes_moved = ids.numel() * ids.element_size() + num_local * 4 + (emap.numel() * 4 if ep > 1 else 0)
    rows, calls = [], {}
    for name, fn in contenders(num_local, emap, variants).items():
        got = fn(ids).cpu()
        if not torch.equal(got, expected):
            raise AssertionError(f"{name} is wrong for M={M} topk={topk} E={E} ep={ep}: {got} != {expected}")
        calls[name] = lambda fn=fn: fn(ids)
    # Eager times at per-chunk sizes are the host's launch work, which drifts from second to
    # second: every contender is timed in each of EAGER_ROUNDS interleaved rounds, median taken.
    rounds = {name: [] for name in calls}
    for _ in range(EAGER_ROUNDS):
        for name, call in calls.items():
            rounds[name].append(timer(call))
    for name, call in calls.items():
        row = dict(M=M, topk=topk, E=E, ep=ep, E_local=num_local, method=name,
                   us=statistics.median(rounds[name]), eager_rounds_us=[round(u, 2) for u in rounds[name]])
        if graph and name != "torch.bincount":  # bincount syncs: it cannot be captured
            row["graph_us"] = bench_median_us(call, cuda_graph=True)
        row["floor_us"] = floor_us(bytes_moved=bytes_moved)
        rows.append(row)
    return rows


def sweep(M, topk, E, ep, *, dtype, device, variant: str, timer=bench_median_us) -> list[dict]:
    """``variant`` timed over every launch shape of :data:`SWEEP`, fastest first."""
    ids = make_ids(M, topk, E, dtype=dtype, device=device)
    emap = contiguous_expert_map(E, ep, 0, device=device) if ep > 1 else None
    expected = count_reference(ids, E // ep, emap).cpu()
    rows = []
    for block, pps, warps in itertools.product(*SWEEP.values()):
        tuning = HistogramTuning(block=block, programs_per_sm=pps, num_warps=warps)
        fn = lambda: count_variant(ids, E // ep, emap, variant=variant, tuning=tuning)  # noqa: B023
        if not torch.equal(fn().cpu(), expected):
            raise AssertionError(f"variant {variant} wrong with {tuning}")
        rows.append(dict(variant=variant, ep=ep, block=block, programs_per_sm=pps, num_warps=warps, us=timer(fn)))
    return sorted(rows, key=lambda r: r["us"])


def _variant_names(text: str) -> tuple[str, ...]:
    names = tuple(VARIANTS) if text == "all" else tuple(n for n in text.split(",") if n)
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown variants {bad}; choose from {sorted(VARIANTS)} or 'all'")
    return names


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness count", description="tokens per expert, 4 ways")
    p.add_argument("--ep", type=int, default=8, help="EP size of the map rows (rank 0's map); 1 = none")
    p.add_argument("--ids-dtype", choices=("int32", "int64"), default="int32")
    p.add_argument("--graph", action="store_true", help="also time each call replayed in a CUDA graph")
    p.add_argument("--variants", type=_variant_names, default=(),
                   help=f"also time these histogram variants (comma list of {','.join(VARIANTS)}, or all)")
    p.add_argument("--sweep", action="store_true", help="also sweep HistogramTuning on 262144x8, E=256")
    p.add_argument("--sweep-only", action="store_true", help="only the sweep")
    p.add_argument("--sweep-variant", default="memset", choices=sorted(VARIANTS),
                   help="the variant the sweep times (default memset, the closest to moekit's histogram)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--no-json", action="store_true", help="print only")
    p.add_argument("--cpu-sanity", action="store_true", help="no GPU: tiny interpreter run, not a timing")
    return p.parse_args(argv)


def _save(args, env, payload) -> None:
    if not args.no_json:  # rewritten after every case, so a run cut short keeps what it measured
        write_json("count", env, payload, directory=args.out)


def main(argv: list[str] | None = None, *, device=None) -> int:
    """Run the count benchmark on ``device`` (default :func:`moekit.device.get_device`); returns a
    process exit code."""
    import moekit

    args = _parse(list(sys.argv[1:] if argv is None else argv))
    dtype = getattr(torch, args.ids_dtype)
    reason = gpu_or_reason()
    if reason is not None:
        if not args.cpu_sanity:
            print(f"count bench: needs a CUDA GPU ({reason}).\nRun it on a GPU, or pass --cpu-sanity.")
            return 2
        print("Triton INTERPRETER on the CPU: a correctness smoke test, NOT a GPU timing.")
        rows = run_case(64, 4, 16, 2, dtype=dtype, device="cpu", graph=False, timer=cpu_median_us,
                        variants=args.variants)
        print(format_table(rows, ["M", "topk", "E", "ep", "method", ("us", "cpu wall us", ".0f")]))
        return 0

    device = moekit.device.get_device() if device is None else torch.device(device)
    env = environment()
    print(f"{env.gpu}, torch {env.torch}, triton {env.triton}, {env.date}; ids {args.ids_dtype}")
    for what, us in ANCHORS.items():
        print(f"  anchor (H200) {what}: {us} us")
    rows: list[dict] = []
    payload = dict(ids_dtype=args.ids_dtype, anchors=ANCHORS, rows=rows, variants=list(args.variants),
                   variants_tuning=asdict(HistogramTuning()))
    cols = ["M", "topk", "E", "ep", "E_local", "method", ("us", "median us", ".1f")]
    cols += [("graph_us", "graph us", ".1f")] if args.graph else []
    cols += [("floor_us", "floor us", ".3g")]
    eps = sorted({1, args.ep})
    if not args.sweep_only:
        for (M, topk, E), ep in itertools.product(CASES, eps):  # the target case comes first
            case = run_case(M, topk, E, ep, dtype=dtype, device=device, graph=args.graph, timer=bench_median_us,
                            variants=args.variants)
            rows += case
            print("\n" + format_table(case, cols), flush=True)
            _save(args, env, payload)
        print("\nall cases:\n" + format_table(sorted(rows, key=lambda r: (r["M"], r["ep"])), cols))
    if args.sweep or args.sweep_only:
        payload["sweep"] = []
        for ep in eps:
            best = sweep(262144, 8, 256, ep, dtype=dtype, device=device, variant=args.sweep_variant)
            payload["sweep"] += best
            print(f"\nHistogramTuning sweep of variant {args.sweep_variant}, 262144x8, E=256, ep={ep} "
                  f"(best 5 of {len(best)}):")
            print(format_table(best[:5], ["block", "programs_per_sm", "num_warps", ("us", "median us", ".2f")]))
            _save(args, env, payload)
    if not args.no_json:
        print(f"\nwrote {results_path('count', env, args.out)}")
    return 0
