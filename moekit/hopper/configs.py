"""Tile sizes of the grouped GEMM (``moekit.hopper.grouped_gemm``): a committed table, no autotune.

The table (``moekit/hopper/fused_moe_tiles.json``) is keyed by compute dtype and by the expected
rows per expert, ``r = M * topk / E``: that, more than M alone, decides whether the GEMM streams
weights (r ~ 1, decode) or is compute-bound (r in the hundreds). Each entry holds one config per
GEMM. Under Triton's interpreter every program costs Python time, so there a fixed config of a
few large tiles is used instead.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

import torch

from moekit.device import interpreting
from moekit.errors import InvalidInputError
from moekit.kernels.fused_moe import INTERPRETER_TILES, Tiles

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}


@dataclass(frozen=True)
class KernelConfig(Tiles):
    """Launch shape of one grouped GEMM.

    ``BLOCK_M`` rows of (token, slot) pairs by ``BLOCK_N`` output columns per program, stepping
    ``BLOCK_K`` along the reduction. ``GROUP_M`` row blocks share one sweep over the columns (so
    an expert's weight tiles are reused from L2). All tile sizes are powers of two >= 16.
    ``tma``: load the weight tiles with the tensor-memory accelerator (a host-side descriptor)
    instead of per-thread copies, where the weights allow it (contiguous, 16-byte rows); the
    gathered activation rows always use per-thread copies. ``TAIL_M`` (0: off): a block with
    at most ``TAIL_M`` real rows (an expert's last block, mostly padding) runs a ``TAIL_M``-row
    tile, so padding costs less of the tensor cores; a power of two >= 16 below ``BLOCK_M``.
    ``persistent``: one program per SM walks the tiles (the persistent walk of
    :mod:`moekit.hopper.grouped_gemm`); no ``TAIL_M`` then. ``warp_specialize``: ask Triton to split
    that walk's loop into producer and consumer warps (``tl.range(warp_specialize=True)``; persistent
    only). ``interleave``: a gated GEMM1 (silu_and_mul in the epilogue) multiplies gate and up as one
    ``2 * BLOCK_N``-wide product whose columns alternate gate, up (one accumulator, one MMA per k-step,
    the ``BLOCK_M`` rows of ``a`` read once for both); ``BLOCK_N`` stays the output's width.
    """

    tma: bool = False
    TAIL_M: int = 0
    persistent: bool = False
    warp_specialize: bool = False
    interleave: bool = False

    def __post_init__(self):
        super().__post_init__()  # the tile shape, warps and stages, as the book's Tiles
        tail = self.TAIL_M
        if (
            not isinstance(tail, int)
            or isinstance(tail, bool)
            or (tail and (tail < 16 or tail & (tail - 1) or tail >= self.BLOCK_M))
        ):
            raise InvalidInputError(
                f"KernelConfig.TAIL_M must be 0 or a power of two >= 16 below BLOCK_M={self.BLOCK_M}, got {tail!r}"
            )
        for name in ("tma", "persistent", "warp_specialize", "interleave"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"KernelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.persistent and tail:
            raise InvalidInputError(f"KernelConfig: a persistent kernel has no TAIL_M tile, got TAIL_M={tail}")
        if self.warp_specialize and not self.persistent:
            raise InvalidInputError("KernelConfig.warp_specialize needs persistent=True (it splits the tile walk)")
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in self.__dataclass_fields__)))

    def __hash__(self) -> int:  # computed once: a config is part of every GEMM launch's key
        return self._hash


# The book's tiles under the interpreter: few, large programs (its cost is per program and per k-step).
_INTERPRETER = KernelConfig(**INTERPRETER_TILES.launch)


@functools.cache
def load_table() -> dict:
    """The JSON table, with dtype aliases (``"fp16": "bf16"``) resolved."""
    text = resources.files("moekit").joinpath("hopper/fused_moe_tiles.json").read_text()
    table = {k: v for k, v in json.loads(text).items() if not k.startswith("_")}
    return {k: table[v] if isinstance(v, str) else v for k, v in table.items()}


def get_config(
    M: int, N: int, K: int, E: int, topk: int, dtype: torch.dtype, *, stage: int = 1, gated: bool = False
) -> KernelConfig:
    """The config for one GEMM of a layer with M tokens.

    Args:
        M: tokens in this call (a chunk's M). N, K: the GEMM's output width and reduction
            (stage 1: w1's N and K; stage 2: K and N/2). E: global experts. topk: slots per token.
        dtype: compute dtype of the operands (``torch.float8_e4m3fn`` for fp8 block).
        stage: 1 for GEMM1 (gate/up), 2 for GEMM2 (down).
        gated: GEMM1 with silu_and_mul in its epilogue (two accumulators per program): the
            bucket's ``gemm1_gated`` entry when it has one, else ``gemm1``.

    Returns:
        A :class:`KernelConfig`; under the interpreter, a fixed small-grid config.

    Raises:
        InvalidInputError: an unknown dtype or stage.
    """
    if dtype not in _DTYPE_KEYS:
        raise InvalidInputError(f"no fused_moe config for dtype {dtype}; expected one of {list(_DTYPE_KEYS)}")
    if stage not in (1, 2):
        raise InvalidInputError(f"stage must be 1 or 2, got {stage!r}")
    if interpreting():
        return _INTERPRETER
    return table_config(M * topk / max(E, 1), dtype, stage=stage, gated=gated)


@functools.lru_cache(maxsize=256)  # a launch asks for its tiles every call: keep that off the host's path
def table_config(rows_per_expert: float, dtype: torch.dtype, *, stage: int = 1, gated: bool = False) -> KernelConfig:
    """The table's entry for ``rows_per_expert`` (the first bucket with ``r <= max_rows``)."""
    for entry in load_table()[_DTYPE_KEYS[dtype]]:
        if entry["max_rows"] is None or rows_per_expert <= entry["max_rows"]:
            key = "gemm1_gated" if stage == 1 and gated and "gemm1_gated" in entry else f"gemm{stage}"
            return KernelConfig(**entry[key])
    raise InvalidInputError(f"the fused_moe table for {dtype} has no bucket for {rows_per_expert:.3g} rows per expert")
