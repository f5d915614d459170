"""The chunk explorer (notebook 03): sliders for M, C, E, topk, skew and EP size.

The logic is two pure functions that run headless and are unit-tested:

- :func:`explorer_view` routes M tokens with a skewed router, counts tokens per (chunk, local
  expert) on EP rank 0, and sweeps the expert-weight bytes that all chunks read against C;
- :func:`draw` turns that into one figure (heatmap, stacked bars, bytes vs C).

:func:`explorer` only wires ipywidgets sliders to them (:func:`moekit.widgets.display.live_box`);
ipywidgets is imported inside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moekit import routing, viz
from moekit.widgets.display import live_box, nearest

CHUNK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
EXPERTS = (4, 8, 16, 32, 64, 128, 256)
EP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ExplorerParams:
    """What the sliders set. ``N``/``K`` (w1 is ``[E, N, K]``) size the weight bytes."""

    M: int = 256
    C: int = 64
    E: int = 16
    topk: int = 2
    skew: float = 1.2
    ep_size: int = 1
    seed: int = 0
    N: int = 256
    K: int = 128

    def normalized(self) -> ExplorerParams:
        """Clamp to a valid problem: ``1 <= topk <= E``, ``1 <= C <= M``, ``ep_size`` divides E."""
        E = max(1, int(self.E))
        ep = max(1, min(int(self.ep_size), E))
        while E % ep:
            ep -= 1
        return dataclasses.replace(
            self,
            M=max(1, int(self.M)),
            C=min(max(1, int(self.C)), max(1, int(self.M))),  # C > M is one chunk: the same as C = M
            E=E,
            topk=min(max(1, int(self.topk)), E),
            skew=max(0.0, float(self.skew)),
            ep_size=ep,
        )


@dataclass
class ExplorerView:
    """Everything the explorer draws, for one setting of the sliders."""

    params: ExplorerParams
    counts: torch.Tensor  # int64 [num_chunks, E_local]: tokens per (chunk, local expert)
    chunk_sizes: list[int]
    weight_bytes: list[int]  # all chunks together, for each of chunk_sizes
    bytes_per_expert: int

    @property
    def num_local_experts(self) -> int:
        """Experts on EP rank 0: ``E / ep_size``."""
        return self.counts.shape[1]

    @property
    def touched(self) -> list[int]:
        """How many local experts each chunk touches (and so reads the weights of)."""
        return (self.counts > 0).sum(dim=1).tolist()

    def summary(self) -> str:
        """One line: chunks, experts touched per chunk, weight bytes read."""
        p, n = self.params, len(self.touched)
        mean = sum(self.touched) / max(n, 1)
        read = viz.weight_bytes_read(self.counts, self.bytes_per_expert)
        once = self.num_local_experts * self.bytes_per_expert
        return (
            f"M={p.M} tokens in {n} chunk(s) of C={p.C}; each chunk touches {mean:.1f} of "
            f"{self.num_local_experts} local experts (EP rank 0 of {p.ep_size}); weights read "
            f"{read / 2**20:.2f} MiB = {read / max(once, 1):.1f} x reading each local expert once"
        )


def explorer_view(params: ExplorerParams) -> ExplorerView:
    """Route, count per chunk on EP rank 0, and sweep weight bytes over power-of-two C."""
    p = params.normalized()
    r = routing.skewed_router(p.M, p.E, p.topk, skew=p.skew, seed=p.seed, device="cpu")
    E_local = p.E // p.ep_size
    emap = routing.contiguous_expert_map(p.E, p.ep_size, 0) if p.ep_size > 1 else None
    per_expert = viz.expert_weight_bytes(p.N, p.K)
    sizes = [c for c in CHUNK_SIZES if c < p.M] + [p.M]
    counts_at = lambda C: viz.chunk_counts(r.topk_ids, C, E_local, expert_map=emap)  # [num_chunks, E_local]
    swept = [viz.weight_bytes_read(counts_at(c), per_expert) for c in sizes]
    return ExplorerView(p, counts_at(p.C), sizes, swept, per_expert)


def draw(view: ExplorerView):
    """Heatmap, stacked bars and weight bytes vs C, side by side; returns the Figure."""
    fig, axes = viz.new_axes(3, width=5.2, height=3.8)
    viz.plot_counts_heatmap(view.counts, ax=axes[0], title=f"tokens per (chunk, expert), C={view.params.C}")
    viz.plot_stacked_chunks(view.counts, ax=axes[1])
    whole = view.num_local_experts * view.bytes_per_expert
    label = f"skew={view.params.skew:g}"
    viz.plot_weight_bytes(view.chunk_sizes, {label: view.weight_bytes}, whole=whole, mark=view.params.C, ax=axes[2])
    return fig


def explorer(params: ExplorerParams | None = None, **overrides):
    """A VBox of sliders over a live figure; ``box.last_view`` holds the latest ExplorerView."""
    import ipywidgets as w

    p = dataclasses.replace(params or ExplorerParams(), **overrides).normalized()
    style = {"description_width": "60px"}
    sliders = {
        "M": w.IntSlider(value=p.M, min=16, max=4096, step=16, description="M tokens", style=style),
        "C": w.SelectionSlider(options=CHUNK_SIZES, value=nearest(p.C, CHUNK_SIZES), description="C chunk"),
        "E": w.SelectionSlider(options=EXPERTS, value=nearest(p.E, EXPERTS), description="E experts"),
        "topk": w.IntSlider(value=p.topk, min=1, max=8, description="topk", style=style),
        "skew": w.FloatSlider(value=p.skew, min=0.0, max=3.0, step=0.1, description="skew", style=style),
        "ep_size": w.SelectionSlider(options=EP_SIZES, value=nearest(p.ep_size, EP_SIZES), description="EP size"),
    }
    # `draw` is looked up at each redraw, not bound here: a patched one takes effect
    view_for = lambda values: explorer_view(dataclasses.replace(p, **values))
    return live_box(sliders, view_for=view_for, figure_for=lambda view: draw(view))
