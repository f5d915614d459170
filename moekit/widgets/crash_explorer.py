"""The bug-1 explorer (notebook 02): sliders for M and C; per chunk, the backend and buffers, and
what the pre-fix loop did with them, recomputed live by running it.

:func:`crash_view` is the logic, headless and unit-tested: it runs the real pre-fix modular
kernel (parent commit 41060c6e0: workspaces declared once, DeepGEMM's 2-D output, no guard) and
the fixed one on the same fp8 problem, and keeps both traces and what each raised.
:func:`pre_fix_crashes` says from the plan alone whether that run crashes.
:func:`crash_explorer` wires two ipywidgets sliders to it, their ranges derived from the values
it starts at (a slider clamps a value past its end without a word); ipywidgets is imported
inside it.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass

from moekit.experts.triton_or_deep_gemm import DEEP_GEMM_MIN_M, TritonOrDeepGemmExperts
from moekit.modular_kernel import ModularKernel
from moekit.plan import chunk_ranges
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.testing import make_problem
from moekit.trace import Trace
from moekit.types import QuantScheme
from moekit.widgets.display import live_box


@dataclass(frozen=True)
class CrashParams:
    """What the sliders set (M tokens, C chunk size) and the fixed rest of the fp8 problem."""

    M: int = 130
    C: int = 128
    E: int = 8
    topk: int = 2
    K: int = 128
    N: int = 256
    seed: int = 0


@dataclass
class CrashView:
    """Both runs at one setting: the pre-fix one (``error`` is what it raised, or None) and the fix."""

    params: CrashParams
    pre_fix: Trace
    error: BaseException | None
    fixed: Trace

    def summary(self) -> str:
        p, backends = self.params, " | ".join(self.fixed.backends)
        if self.error is None:
            outcome = "the pre-fix loop ran through (no chunk needed another layout)"
        else:
            failed = next((c.index for c in self.pre_fix if not c.completed), "?")
            outcome = f"the pre-fix loop crashed at chunk {failed}: {type(self.error).__name__}: {self.error}"
        return f"M={p.M}, C={p.C}: chunks ran {backends}; {outcome}"


def pre_fix_crashes(M: int, C: int, *, N: int = 256, K: int = 128) -> bool:
    """Whether the pre-fix loop crashes at M tokens in chunks of C, from the plan alone: the
    whole-batch output is declared by DeepGEMM's rule (M >= 128, N and K multiples of 128: 2-D
    then) and some chunk holds fewer than 128 tokens, so Triton runs it on a 2-D slice."""
    deep_gemm_output = M >= DEEP_GEMM_MIN_M and N % 128 == 0 and K % 128 == 0
    return deep_gemm_output and any(r.size < DEEP_GEMM_MIN_M for r in chunk_ranges(M, C))


def slider_end(*values: int, least: int = 512) -> int:
    """A slider's end for starting values ``values``: at least ``least`` and twice the largest,
    rounded up to a multiple of 128, so the starting value and its neighbourhood are reachable."""
    return -(-max(least, 2 * max(values)) // 128) * 128


def pre_fix_kernel(C: int) -> ModularKernel:
    """The loop as the parent commit ran it: declared once, DeepGEMM's 2-D output, no guard."""
    experts = TritonOrDeepGemmExperts(quant=QuantScheme.FP8_BLOCK, flat_output=True)
    return ModularKernel(NoEPPrepareFinalize(), experts, chunk_size=C, workspace_policy="once", guard=False)


def crash_view(params: CrashParams) -> CrashView:
    """Run the pre-fix and the fixed kernel on one seeded fp8 problem (see the module docstring)."""
    p = dataclasses.replace(params, M=max(1, int(params.M)), C=max(1, int(params.C)))
    problem = make_problem(p.M, E=p.E, topk=p.topk, K=p.K, N=p.N, quant=QuantScheme.FP8_BLOCK, seed=p.seed)
    pre_fix, error = pre_fix_kernel(p.C), None
    try:
        pre_fix(*problem.inputs(), **problem.options())
    except IndexError as e:  # the launcher indexing a third dimension of a 2-D output slice
        error = e
    fixed = ModularKernel(NoEPPrepareFinalize(), TritonOrDeepGemmExperts(), chunk_size=p.C)
    problem.check(fixed(*problem.inputs(), **problem.options()))
    return CrashView(p, pre_fix.last_trace, error, fixed.last_trace)


def draw(view: CrashView):
    """The per-chunk table of the pre-fix run (handed vs needed) as a figure."""
    from moekit import viz

    return viz.plot_table(view.pre_fix.handed_vs_needed(), title=textwrap.fill(view.summary(), 100))


def crash_explorer(params: CrashParams | None = None, **overrides):
    """Sliders for M and C over the live table; ``box.last_view`` holds the latest CrashView."""
    import ipywidgets as w

    p = dataclasses.replace(params or CrashParams(), **overrides)
    end_M, end_C = slider_end(p.M), slider_end(p.M, p.C)  # C may reach past M: one chunk
    sliders = {  # rerun on release only: each run takes a second or two
        "M": w.IntSlider(value=p.M, min=1, max=end_M, description="M tokens", continuous_update=False),
        "C": w.IntSlider(value=p.C, min=1, max=end_C, description="C chunk", continuous_update=False),
    }
    clamped = {k: (s.value, getattr(p, k)) for k, s in sliders.items() if s.value != getattr(p, k)}
    if clamped:  # a start below 1 (not past the end, with the ends above): a slider would clamp it silently
        raise ValueError(f"a slider cannot hold its starting value: {clamped}")
    view_for = lambda values: crash_view(dataclasses.replace(p, **values))
    return live_box(sliders, view_for=view_for, figure_for=draw)
