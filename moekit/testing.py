"""Helpers shared by the tests, the notebooks and the benchmarks.

- :func:`assert_close` compares with a tolerance chosen by dtype (one table for the project).
- :func:`expect_raises` is the notebook-friendly ``pytest.raises``: it fails when nothing is
  raised, so a demonstration of a crash cannot silently stop crashing.
- :func:`make_problem` builds one seeded random MoE layer (weights, routing, activations), fp8
  block-quantized on request, with its fp32 oracle (:meth:`MoEProblem.reference`).
- :func:`wall_ms` times a call on the host (a median of a few runs): for the interpreter's scaling
  in the notebooks, never for GPU speed (use ``triton.testing.do_bench`` there).
- :func:`experts_call` builds one chunk's :class:`~moekit.types.ExpertsCall` by hand, the way the
  modular kernel builds it, to call ``Experts.apply`` directly (tests, notebook 01).
"""

from __future__ import annotations

import contextlib
import re
import statistics
import timeit
from dataclasses import dataclass, replace

import torch

from moekit.device import get_device
from moekit.errors import InvalidInputError
from moekit.plan import Batch, SlabChunk, TokenChunk
from moekit.quant import (
    FP8,
    FP8_GROUP,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.reference import moe_reference
from moekit.routing import contiguous_expert_map, skewed_router
from moekit.types import ExpertPlacement, ExpertsCall, ExpertTokensMetadata, MoEWeights, ProblemSize, QuantScheme
from moekit.workspace import WorkspacePool

# (atol, rtol) against the fp32 reference; atol is relative to the largest |expected|.
# fp8 is compared on dequantized inputs. e4m3 keeps 3 mantissa bits (2**-4 relative rounding),
# and the fp8 layer quantizes twice (activations, then the intermediate), so one element may be
# off by a few percent of the maximum; fp8 results must also be within NORM_TOLERANCE in norm.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (2e-4, 2e-4),  # as fp32: the reference computes in fp32
    torch.float32: (2e-4, 2e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
    FP8: (6e-2, 6e-2),
}
NORM_TOLERANCE = {FP8: 4e-2}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for results computed in ``dtype``.

    Raises:
        InvalidInputError: a dtype moekit computes nothing in (an int dtype, complex).
    """
    if dtype not in TOLERANCES:
        names = ", ".join(str(d).removeprefix("torch.") for d in TOLERANCES)
        raise InvalidInputError(f"tolerance: moekit computes in {names}, got {dtype!r}")
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype, scale: float | None = None):
    """``torch.testing.assert_close`` with the project's per-dtype tolerance.

    ``atol`` is relative to ``scale`` (default: the largest magnitude in ``expected``), so a
    layer whose outputs are around 0.01 and one whose outputs are around 10 are held to the same
    relative standard.
    """
    atol, rtol = tolerance(dtype)
    ref = expected.detach().float().cpu()
    if scale is None:
        scale = float(ref.abs().max()) if ref.numel() else 1.0
    got = actual.detach().float().cpu()
    torch.testing.assert_close(got, ref, atol=atol * max(scale, 1e-6), rtol=rtol)
    if dtype in NORM_TOLERANCE and ref.numel():
        rel = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
        assert rel <= NORM_TOLERANCE[dtype], f"relative error in norm {rel:.3g} > {NORM_TOLERANCE[dtype]} ({dtype})"


@dataclass
class Raised:
    """What :func:`expect_raises` caught (``.error`` is the exception)."""

    error: BaseException | None = None

    @property
    def message(self) -> str:
        return str(self.error)


@contextlib.contextmanager
def expect_raises(kind: type[BaseException] | tuple[type[BaseException], ...], match: str | None = None):
    """Assert that the block raises ``kind`` (and that its message matches ``match``).

    Example::

        with expect_raises(moekit.errors.WorkspaceShapeError, match="bug 1") as caught:
            kernel(hidden, w1, w2, weights, ids)
        print(caught.message)
    """
    caught = Raised()
    try:
        yield caught
    except kind as e:  # noqa: B902
        caught.error = e
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"raised {type(e).__name__}, but {match!r} is not in: {e}") from e
        return
    names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
    raise AssertionError(f"expected {names} to be raised, but the block finished normally")


@dataclass
class MoEProblem:
    """One MoE layer's inputs (see :func:`make_problem`).

    ``problem.inputs()`` and ``problem.options()`` are what ``ModularKernel.forward`` (or
    ``moekit.fused_moe``) takes: ``kernel(*p.inputs(), **p.options())``.
    """

    hidden: torch.Tensor  # [M, K]
    w1: torch.Tensor  # [E, N, K], fp8 for QuantScheme.FP8_BLOCK
    w2: torch.Tensor  # [E, K, N/2]
    topk_weights: torch.Tensor  # [M, topk] fp32
    topk_ids: torch.Tensor  # [M, topk] int32, global ids, -1 = empty slot
    quant: QuantScheme
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    expert_map: torch.Tensor | None = None
    global_num_experts: int | None = None

    @property
    def M(self) -> int:
        return self.hidden.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype that sets the tolerance: fp8 for fp8 block, else the activations'."""
        return FP8 if self.quant is QuantScheme.FP8_BLOCK else self.hidden.dtype

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.hidden, self.w1, self.w2, self.topk_weights, self.topk_ids

    def options(self) -> dict:
        opts = {"expert_map": self.expert_map, "global_num_experts": self.global_num_experts}
        if self.quant is QuantScheme.FP8_BLOCK:
            opts.update(w1_scale=self.w1_scale, w2_scale=self.w2_scale)
        return opts

    def float_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``w1``, ``w2`` (dequantized for fp8)."""
        if self.quant is QuantScheme.FP8_BLOCK:
            return dequantize_fp8_block(self.w1, self.w1_scale), dequantize_fp8_block(self.w2, self.w2_scale)
        return self.w1.float(), self.w2.float()

    def reference(self, *, apply_weights: bool = True, rows: slice | None = None) -> torch.Tensor:
        """The fp32 oracle (:func:`moekit.reference.moe_reference`) on what the experts see:
        for fp8, the activations quantized as prepare quantizes them and the dequantized weights.
        ``rows`` restricts it to some tokens."""
        rows = rows or slice(None)
        hidden = self.hidden[rows]
        if self.quant is QuantScheme.FP8_BLOCK:
            hidden = dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(hidden))
        return moe_reference(
            hidden,
            *self.float_weights(),
            self.topk_weights[rows],
            self.topk_ids[rows],
            expert_map=self.expert_map,
            apply_weights=apply_weights,
        )

    def check(self, out: torch.Tensor) -> None:
        """Assert ``out`` matches :meth:`reference` within the tolerance of :attr:`dtype`."""
        assert_close(out, self.reference(), dtype=self.dtype)

    def shard(self, rank: int, world_size: int) -> MoEProblem:
        """Rank ``rank``'s share under expert parallelism: its contiguous block of experts (see
        :func:`moekit.routing.contiguous_expert_map`), the map, and E_global; same tokens."""
        E = self.w1.shape[0]
        emap = contiguous_expert_map(E, world_size, rank, device=self.w1.device)
        mine = (emap >= 0).nonzero().flatten()
        scales = {}
        if self.quant is QuantScheme.FP8_BLOCK:
            scales = {"w1_scale": self.w1_scale[mine], "w2_scale": self.w2_scale[mine]}
        return replace(self, w1=self.w1[mine], w2=self.w2[mine], expert_map=emap, global_num_experts=E, **scales)


def make_problem(
    M: int,
    *,
    E: int = 8,
    topk: int = 2,
    K: int = 128,
    N: int = 256,
    dtype: torch.dtype = torch.bfloat16,
    quant: QuantScheme = QuantScheme.NONE,
    skew: float = 0.0,
    empty_every: int | None = None,
    seed: int = 0,
    device=None,
) -> MoEProblem:
    """A seeded random MoE layer: fresh ``randn`` activations (never zeros), weights scaled by
    ``1/sqrt(fan_in)`` so values stay O(1) through both GEMMs, and router decisions from
    :func:`moekit.routing.skewed_router` (``skew=0`` is uniform).

    Args:
        M, E, topk, K, N: the letters of :mod:`moekit.types` (N = w1 rows = 2 x intermediate).
        dtype: the activations' dtype, and the weights' when unquantized.
        quant: ``QuantScheme.FP8_BLOCK`` quantizes the weights to fp8 with 128x128 block scales
            (then K and N/2 should be multiples of 128).
        empty_every: every n-th token's last slot becomes -1 (an empty slot).
        seed: everything is drawn from generators seeded with it, on the CPU, then moved.
        device: default :func:`moekit.device.get_device`.
    """
    device = get_device() if device is None else torch.device(device)
    g = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(M, K, generator=g, device=device).to(dtype)
    fp8 = quant is QuantScheme.FP8_BLOCK
    w1, s1 = _random_weights(E, N, K, dtype=dtype, fp8=fp8, generator=g, device=device)
    w2, s2 = _random_weights(E, K, N // 2, dtype=dtype, fp8=fp8, generator=g, device=device)
    weights, ids = skewed_router(M, E, topk, skew=skew, seed=seed + 1, device="cpu")
    if empty_every and M:
        ids[::empty_every, -1] = -1
    return MoEProblem(hidden, w1, w2, weights.to(device), ids.contiguous().to(device), quant, s1, s2)


def _random_weights(E, R, C, *, dtype, fp8, generator, device, block: int = 16):
    """``randn(E, R, C) / sqrt(C)``, made (and fp8-quantized) a block of experts at a time, so a
    DeepSeek-V3-sized layer never needs an fp32 copy of all its experts."""
    w = torch.empty(E, R, C, dtype=FP8 if fp8 else dtype, device=device)
    scale = torch.empty(E, -(-R // FP8_GROUP), -(-C // FP8_GROUP), device=device) if fp8 else None
    for e0 in range(0, E, block):
        part = torch.randn(min(block, E - e0), R, C, generator=generator, device=device) * C**-0.5
        if fp8:
            w[e0 : e0 + block], scale[e0 : e0 + block] = quantize_fp8_block(part)
        else:
            w[e0 : e0 + block] = part
    return w, scale


def experts_call(
    experts,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: MoEWeights,
    *,
    hidden_scale: torch.Tensor | None = None,
    placement: ExpertPlacement | None = None,
    tokens_meta: ExpertTokensMetadata | None = None,
    fill: float | None = None,
    pool=None,
) -> ExpertsCall:
    """One chunk's call as ``ModularKernel`` builds it: sizes from the tensors, the shapes
    ``experts`` declares for them, buffers from ``pool`` (a fresh one by default), an output
    of the declared shape and the chunk's counts (when ``experts.uses_tokens_meta``), no
    ``a2_scale``. ``fill`` pre-fills workspaces and output (NaN: a canary that shows any element
    the experts forgot to write). ``hidden`` is what prepare hands over (fp8 for fp8 experts, with
    ``hidden_scale``)."""
    E_local, N, K = weights.w1.shape
    placement = placement or ExpertPlacement(E_local, E_local)
    rows = hidden.shape[1] if hidden.dim() == 3 else hidden.shape[0]  # batched: the slab height
    problem = ProblemSize(rows, N, K, topk_ids.shape[-1], placement.global_num_experts, E_local)
    shapes = experts.workspace_shapes(problem, act_dtype=hidden.dtype, tokens_meta=tokens_meta)
    buffers = (pool or WorkspacePool(hidden.device)).take(shapes)
    output = torch.empty(shapes.output, dtype=experts.compute_dtype(hidden.dtype), device=hidden.device)
    if fill is not None:
        for t in (buffers.workspace13, buffers.workspace2, output):
            t.fill_(fill)
    counts = experts.count_tokens(topk_ids, placement) if experts.uses_tokens_meta and hidden.dim() == 2 else None
    chunk = (SlabChunk if hidden.dim() == 3 else TokenChunk)(0, 0, rows)
    batch = Batch(None, weights, placement, problem, output.dtype, a2_scale=None, guard=True)  # no prepare ran
    return batch.call(
        chunk, output, hidden, hidden_scale, topk_ids, problem, buffers, shapes, counts, tokens_meta, None
    )


def wall_ms(fn, *, repeats: int = 3) -> float:
    """Median wall-clock milliseconds of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    return statistics.median(timeit.repeat(fn, repeat=repeats, number=1)) * 1e3
