"""Measuring one layer call on the GPU: correctness first, then time, memory and phases.

- :func:`sample_rows`: the rows checked against the oracle (:mod:`benchmarks.harness.problem`);
- :func:`rel_error`: ``||out - ref|| / ||ref||`` (NaN fails every comparison);
- :func:`eager_us`: ``triton.testing.do_bench`` median, L2 flushed before each call;
- :func:`back_to_back_us`: plain calls in a loop, one synchronize (a user's eager loop);
- :func:`graph_us`: one CUDA graph replaying the call over several input sets in turn (so the
  same experts' weights are not served from L2 every time), median per call;
- :func:`shuffled_rounds`: several contenders, each timed once per round in a shuffled order;
- :func:`host_syncs`: the host syncs one call makes, with the moekit line that made each
  (what stops a CUDA graph capture);
- :func:`peak_bytes`: ``torch.cuda.max_memory_allocated`` delta of one call;
- :func:`kernel_phases`: per-kernel device time from ``torch.profiler``, split GEMM / rest.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

GEMM_KERNEL = re.compile(r"gemm|fused_moe|persistent_moe|matmul|cutlass|nvjet|xmma|wgmma|grouped_mm", re.IGNORECASE)
# An activation kernel between the GEMMs (a peer that fuses it into GEMM1 has none).
ACTIVATION_KERNEL = re.compile(r"silu|swiglu|gelu|act_and_mul", re.IGNORECASE)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sample_rows(M: int, count: int = 256) -> torch.Tensor:
    """Up to ``count`` distinct row indices spread over ``[0, M)``, first and last included."""
    if M <= count:
        return torch.arange(M)
    return torch.linspace(0, M - 1, count).round().long().unique()


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp32; NaN or inf in ``out`` gives inf."""
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def eager_us(fn: Callable[[], object], *, rep_ms: float = 100.0) -> float:
    """do_bench median in us; at least ~10 timed calls even for a 25 ms layer."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep = max(rep_ms, 10 * start.elapsed_time(end))
    return do_bench(fn, warmup=max(25.0, rep / 4), rep=rep, return_mode="median") * 1e3


def back_to_back_us(fns: list[Callable[[], object]], calls: int) -> float:
    """Wall-clock us per call of ``calls`` plain calls cycling over ``fns``, one synchronize at the end
    (what a user's eager loop gets: host and GPU overlap, no L2 flush; one warm-up call of each first)."""
    import time

    for f in fns:
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def graph_us(calls: list[Callable[[], object]], *, target_ms: float = 20.0, replays: int = 10) -> float:
    """Median us per call of a CUDA graph that runs ``calls`` in turn, repeated to ~target_ms.

    Raises whatever the capture raises (a host sync inside a call, for example).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch's docs advise
        for c in calls * 2:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in calls:
        c()
    end.record()
    torch.cuda.synchronize()
    per_call_ms = max(start.elapsed_time(end) / len(calls), 1e-3)
    rounds = max(1, min(64, int(target_ms / (per_call_ms * len(calls)))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for c in calls:
                c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (rounds * len(calls)))
    del graph
    return statistics.median(times) * 1e3


Calls = list[Callable[[], object]]


def shuffled_rounds(calls: dict[str, Calls], rounds: int, *, timer: Callable[[Calls], float] = graph_us
                    ) -> dict[str, list[float]]:  # fmt: skip
    """``{name: [us per round]}``: every contender timed once per round by ``timer``, in an order
    shuffled per round (seeded by the round: the same order on every machine)."""
    import random

    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for name in order:
            times[name].append(timer(calls[name]))
    return times


def host_syncs(fn: Callable[[], object], *, limit: int = 5) -> list[str]:
    """The synchronizing operations of one call, each as ``"file:line: code"`` of the innermost
    moekit frame (torch's sync debug mode; it sees most, not all, syncs)."""
    import moekit

    found: list[str] = []
    package = str(Path(moekit.__file__).resolve().parent)  # frames of the library, not of the harness

    def hook(message, category, filename, lineno, file=None, line=None):
        stack = traceback.extract_stack()
        ours = [f for f in stack if str(Path(f.filename).resolve()).startswith(package + os.sep)]
        if ours:
            f = ours[-1]
            where = f"moekit/{Path(f.filename).resolve().relative_to(package).as_posix()}:{f.lineno}: {f.line}"
        else:
            where = f"{filename}:{lineno}: {str(message)[:80]}"
        if where not in found:
            found.append(where)

    torch.cuda.synchronize()
    old = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    torch.cuda.synchronize()
    return found[:limit]


def peak_bytes(fn: Callable[[], object], *, release: Callable[[], None] = lambda: None) -> int:
    """Bytes allocated at the peak of one call above what was held before it (cached
    workspaces released first, so they count)."""
    release()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


@dataclass
class Phases:
    """Device time per call, split into GEMM kernels and everything else (us); ``activation_us`` is
    the part of ``other_us`` spent in activation kernels."""

    gemm_us: float
    other_us: float
    kernels: list[dict] = field(default_factory=list)  # top kernels: name, us per call, gemm?
    activation_us: float = 0.0

    @property
    def gemm_and_activation_us(self) -> float:
        """The GEMMs plus the activation: like for like with a peer that fuses it into GEMM1."""
        return self.gemm_us + self.activation_us

    @property
    def total_us(self) -> float:
        return self.gemm_us + self.other_us

    @property
    def non_gemm_fraction(self) -> float:
        return self.other_us / self.total_us if self.total_us else float("nan")


def kernel_phases(fn: Callable[[], object], *, iters: int = 3, top: int = 12, with_pdl: bool = False) -> Phases:
    """Profile ``iters`` calls; sum each kernel's device time (memcpy/memset count as 'other').

    moekit's kernels run without programmatic dependent launch here (``moekit.hopper.pdl``): with it
    a kernel starts before the previous one ends and its profiled time includes that wait, so the
    per-kernel times would overlap (``with_pdl=True`` keeps it, to show that). The layer times
    (``eager_us``, ``graph_us``) keep it on."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from moekit.hopper import pdl

    with contextlib.nullcontext() if with_pdl else pdl.disabled():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
    per_name: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            per_name[evt.name] = per_name.get(evt.name, 0.0) + evt.time_range.elapsed_us() / iters
    return phases_of(per_name, top=top)


def phases_of(per_name: dict[str, float], *, top: int = 12) -> Phases:
    """Kernel name -> us per call, split by :data:`GEMM_KERNEL` and :data:`ACTIVATION_KERNEL`."""
    gemm = sum(t for n, t in per_name.items() if GEMM_KERNEL.search(n))
    other = sum(per_name.values()) - gemm
    act = sum(t for n, t in per_name.items() if not GEMM_KERNEL.search(n) and ACTIVATION_KERNEL.search(n))
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    kernels = [{"name": n[:120], "us": round(t, 2), "gemm": bool(GEMM_KERNEL.search(n))} for n, t in ranked]
    return Phases(gemm, other, kernels, activation_us=act)
