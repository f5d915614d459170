"""The dataclasses that the layers pass to each other.

Letters (as in vLLM): M tokens (in this chunk), K hidden size, N = w1 rows (2 x intermediate),
E experts (global or local), topk experts per token, C chunk size.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from moekit.errors import InvalidInputError, QuantizationError, WorkspaceShapeError
from moekit.quant import FP8, FP8_GROUP

if TYPE_CHECKING:
    from moekit.plan import Chunk

ALIGN_M = 128  # rows per block of the expert-sorted layout: DeepGEMM's m-alignment, and every Triton tile divides it


class ActivationFormat(Enum):
    """How activations are laid out between prepare and finalize.

    - ``STANDARD``: one row per token, ``[M, K]``.
    - ``BATCHED``: one slab per local expert, ``[E_local, max_tokens, K]``; rows past
      ``expert_num_tokens[e]`` are padding.
    """

    STANDARD = "standard"
    BATCHED = "batched"


class QuantScheme(Enum):
    """One enum instead of contradictory ``use_fp8_*`` flags.

    - ``NONE``: activations and weights in bf16, fp16 or fp32.
    - ``FP8_BLOCK``: fp8 e4m3 weights with one fp32 scale per 128x128 block, activations with one
      scale per 1x128 group of each row (DeepSeek-V3 style, what DeepGEMM consumes).
    """

    NONE = "none"
    FP8_BLOCK = "fp8_block"


def _shape(value, what: str) -> tuple[int, ...]:
    if type(value) is tuple and all(type(d) is int and d >= 0 for d in value):
        return value
    try:
        shape = tuple(int(d) for d in value)
    except TypeError:
        raise InvalidInputError(f"{what} must be a tuple of ints, got {value!r}") from None
    if any(d < 0 for d in shape):
        raise WorkspaceShapeError(f"{what} has a negative dimension: {shape}")
    return shape


@dataclass(frozen=True)
class ProblemSize:
    """The sizes one experts call sees: M rows of (token, topk slots) in this chunk.

    ``N`` is w1's row count (2 x intermediate), ``K`` the hidden size. E_global is
    ``global_num_experts`` (the id space of ``topk_ids``), E_local ``num_local_experts`` (the
    experts whose weights this rank holds).
    """

    M: int
    N: int
    K: int
    topk: int
    global_num_experts: int
    num_local_experts: int

    def __post_init__(self):
        for name in ("M", "N", "K", "topk", "global_num_experts", "num_local_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidInputError(f"ProblemSize.{name} must be an int, got {value!r}")
        if self.M < 0:
            raise InvalidInputError(f"ProblemSize.M must be >= 0, got {self.M}")
        for name in ("N", "K", "topk", "global_num_experts", "num_local_experts"):
            if getattr(self, name) <= 0:
                raise InvalidInputError(f"ProblemSize.{name} must be > 0, got {getattr(self, name)}")
        if self.N % 2:
            raise InvalidInputError(f"N (w1 rows = gate + up) must be even, got N={self.N}")
        if self.num_local_experts > self.global_num_experts:
            raise InvalidInputError(
                f"local experts ({self.num_local_experts}) > global experts ({self.global_num_experts})"
            )

    def with_M(self, M: int) -> ProblemSize:
        """The same problem for another row count (a chunk); not validated again: M comes from a plan."""
        sub = object.__new__(ProblemSize)
        sub.__dict__.update(self.__dict__, M=M)
        return sub


@functools.lru_cache(maxsize=1024)
def problem_size(M: int, N: int, K: int, topk: int, global_num_experts: int, num_local_experts: int) -> ProblemSize:
    """``ProblemSize(...)``, validated once per set of sizes (every forward asks for one)."""
    return ProblemSize(M, N, K, topk, global_num_experts, num_local_experts)


@dataclass(frozen=True)
class WorkspaceShapes:
    """What an experts class needs for one call.

    - ``workspace13``: scratch for the GEMM1 output, reused later (cache "1" and "3").
    - ``workspace2``: scratch for the activation output (cache "2").
    - ``output``: the exact shape of the unweighted, unreduced expert output. Its dim 0 must
      scale with M so that a whole-batch output can be sliced per chunk.
    - ``dtype``: the dtype of both workspaces.
    """

    workspace13: tuple[int, ...]
    workspace2: tuple[int, ...]
    output: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        for name in ("workspace13", "workspace2", "output"):
            object.__setattr__(self, name, _shape(getattr(self, name), name))
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidInputError(f"WorkspaceShapes.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def workspace_bytes(self) -> int:
        """Bytes of workspace13 plus workspace2."""
        return (math.prod(self.workspace13) + math.prod(self.workspace2)) * self.itemsize


@dataclass
class ExpertTokensMetadata:
    """Tokens per local expert, as some prepare stages (an all-to-all) return them.

    ``expert_num_tokens`` is int32 ``[E_local]`` on the compute device; ``expert_num_tokens_cpu``
    is the same on the CPU, or None. Entry e counts the (token, slot) rows routed to local
    expert e.
    """

    expert_num_tokens: torch.Tensor
    expert_num_tokens_cpu: torch.Tensor | None = None

    def __post_init__(self):
        t = self.expert_num_tokens
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidInputError(f"expert_num_tokens must be a 1-D int32 tensor, got {got}")
        c = self.expert_num_tokens_cpu
        if c is not None and (c.device.type != "cpu" or c.shape != t.shape):
            raise InvalidInputError(
                f"expert_num_tokens_cpu must be a CPU tensor of shape {tuple(t.shape)}, "
                f"got {tuple(c.shape)} on {c.device}"
            )

    @classmethod
    def from_counts(cls, counts: torch.Tensor, *, with_cpu: bool) -> ExpertTokensMetadata:
        """Wrap device counts; the CPU copy (a sync) is made only when asked."""
        return cls(counts, counts.to("cpu") if with_cpu else None)


@functools.lru_cache(maxsize=256)
def expert_bytes(N: int, K: int, dtype: torch.dtype, *, scaled: bool) -> int:
    """Bytes of one expert: w1 ``[N, K]`` and w2 ``[K, N/2]`` in ``dtype``, plus (``scaled``) their
    fp32 128x128 block scales ``[N/128, K/128]`` and ``[K/128, N/256]``."""
    weights = (N * K + K * (N // 2)) * dtype.itemsize
    if not scaled:
        return weights
    return weights + 4 * (
        math.ceil(N / FP8_GROUP) * math.ceil(K / FP8_GROUP) + math.ceil(K / FP8_GROUP) * math.ceil(N // 2 / FP8_GROUP)
    )


@dataclass
class MoEWeights:
    """Expert weights as the experts consume them.

    - ``w1`` ``[E, N, K]``: gate rows then up rows.
    - ``w2`` ``[E, K, N/2]``.
    - ``w1_scale`` ``[E, N/128, K/128]`` and ``w2_scale`` ``[E, K/128, N/256]`` fp32, for
      ``QuantScheme.FP8_BLOCK`` only.
    """

    w1: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def quant(self) -> QuantScheme:
        return QuantScheme.FP8_BLOCK if self.w1.dtype == FP8 else QuantScheme.NONE

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's w1 and w2 and their fp32 block scales: what a chunk reads per expert it touches."""
        E, N, K = self.w1.shape
        return expert_bytes(N, K, self.w1.dtype, scaled=self.w1_scale is not None) if E else 0

    def check(self, expected: QuantScheme) -> None:
        """Raise QuantizationError unless the weights match ``expected``."""
        if expected is QuantScheme.FP8_BLOCK:
            if self.w1.dtype != FP8 or self.w2.dtype != FP8:
                raise QuantizationError(
                    f"fp8 block experts need float8_e4m3fn w1/w2, got {self.w1.dtype}/{self.w2.dtype}; "
                    "quantize with moekit.quant.quantize_fp8_block"
                )
            if self.w1_scale is None or self.w2_scale is None:
                raise QuantizationError("fp8 block experts need w1_scale and w2_scale, got None")
            E, N, K = self.w1.shape
            want1 = (E, math.ceil(N / FP8_GROUP), math.ceil(K / FP8_GROUP))
            want2 = (E, math.ceil(K / FP8_GROUP), math.ceil(N // 2 / FP8_GROUP))
            for name, scale, want in (("w1_scale", self.w1_scale, want1), ("w2_scale", self.w2_scale, want2)):
                if tuple(scale.shape) != want or scale.dtype != torch.float32:
                    raise QuantizationError(
                        f"{name} must be float32 {want} (128x128 blocks), got {scale.dtype} {tuple(scale.shape)}"
                    )
        else:
            if self.w1.dtype == FP8 or self.w2.dtype == FP8:
                raise QuantizationError(
                    "got fp8 weights but the experts were built with quant=QuantScheme.NONE; "
                    "pass quant=QuantScheme.FP8_BLOCK"
                )
            if self.w1_scale is not None or self.w2_scale is not None:
                raise QuantizationError("weight scales were given but the experts are unquantized")


@dataclass
class Prepared:
    """What ``PrepareFinalize.prepare`` hands to the experts.

    - ``a1q`` ``[M, K]`` (Standard) or ``[E_local, max_tokens, K]`` (Batched), quantized if the
      experts asked for it;
    - ``a1q_scale``: ``[M, K/128]`` fp32 group scales for fp8 block, else None;
    - ``tokens_meta``: tokens per local expert, or None;
    - ``topk_ids``/``topk_weights``: the ids and weights that go with ``a1q``'s rows (after an
      all-to-all these are the received ones, not the caller's);
    - ``handle``: whatever ``finalize`` needs to undo the dispatch.
    """

    a1q: torch.Tensor
    a1q_scale: torch.Tensor | None
    tokens_meta: ExpertTokensMetadata | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    handle: object = None


@dataclass(slots=True)
class ExpertsCall:
    """Everything one ``Experts.apply`` (or ``apply_rows``) call reads and writes: one chunk.

    The modular kernel has already computed the chunk's sizes (``problem``), the buffers the
    experts declared for them (``shapes``), where the experts live (``placement``) and how many
    rows go to each local expert (``counts``); ``apply`` reads them from here and recomputes none
    of them. The fields mean the same for every kind of chunk:

    - ``chunk``: which rows to compute (:mod:`moekit.plan`): a ``TokenChunk`` computes every row of
      ``hidden``; a ``RowChunk`` computes the sorted rows ``[start, end)`` of its ``layout``, which
      index into ``hidden``; a ``SlabChunk`` computes every expert slab;
    - ``hidden``/``hidden_scale``/``topk_ids``: the rows the chunk reads, their fp8 group scales,
      their ids; ``problem``: their sizes;
    - ``output``: where the chunk writes (its slice of the whole-batch output, or the whole output
      for a row chunk, which writes the rows of its own pairs);
    - ``workspace13``/``workspace2``: flat 1-D buffers at least ``prod(shapes.workspace13)`` and
      ``prod(shapes.workspace2)`` long; ``apply`` carves its caches out of their first elements
      (what upstream's ``_resize_cache`` did);
    - ``counts``: int32 ``[E_local]`` rows of this chunk per local expert on the device, counted
      once by the modular kernel with ``count_expert_num_tokens`` (None when neither the experts,
      the metadata policy nor the trace asks for them);
    - ``tokens_meta``: the tokens per local expert the chunk is handed (this chunk's, or, under
      ``metadata_policy="whole_batch"``, the whole batch's: bug 2), or None;
    - ``a2_scale``: a static scale for the fp8 requantization between the GEMMs, or None;
    - ``guard``: run moekit's own consistency checks (for example that ``tokens_meta`` describes
      these rows). False replays what upstream did without them (``ModularKernel(guard=False)``).
    """

    chunk: Chunk
    output: torch.Tensor
    hidden: torch.Tensor
    hidden_scale: torch.Tensor | None
    topk_ids: torch.Tensor
    weights: MoEWeights
    workspace13: torch.Tensor
    workspace2: torch.Tensor
    problem: ProblemSize
    shapes: WorkspaceShapes
    placement: ExpertPlacement
    counts: torch.Tensor | None = None
    tokens_meta: ExpertTokensMetadata | None = None
    a2_scale: torch.Tensor | None = None
    guard: bool = True

    @property
    def expert_map(self) -> torch.Tensor | None:
        return self.placement.expert_map

    def tokens_per_expert(self) -> torch.Tensor | None:
        """What a consumer of the counts reads: the metadata it was handed, else the chunk's own counts."""
        return self.tokens_meta.expert_num_tokens if self.tokens_meta is not None else self.counts


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts live on this rank.

    ``expert_map`` is int ``[global_num_experts]``: global id -> local id, or -1 where the expert
    lives on another rank. None means every expert is local (global id == local id). ``owned``: the
    map is moekit's private copy, its values checked when it was made
    (:func:`moekit.validate.owned_placement`), so no forward reads them again.
    """

    global_num_experts: int
    num_local_experts: int
    expert_map: torch.Tensor | None = None
    owned: bool = field(default=False, compare=False)


@dataclass(frozen=True, eq=False)
class KernelLaunch:
    """One Triton launch as data, ``kernel[grid](*args, **consts)``: what a kernel's launcher works out.

    :meth:`run` launches it as the Triton tutorials do. The Hopper wing runs the same record again
    without Triton's per-call argument binding (its lean launcher), so the book's kernels need no
    second launcher there.
    """

    kernel: object
    grid: tuple
    args: tuple
    consts: dict

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.consts)
