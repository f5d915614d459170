"""The contiguous layout that :func:`moekit.kernels.permute.permute_to_contiguous` fills.

Its shapes, and a worked example, are in the module docstring of :mod:`moekit.kernels.permute`.
Here: the constants, the :class:`ContiguousLayout` record and its allocation helpers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALIGN = 128  # rows per block of the contiguous layout (DeepGEMM's m-alignment on Hopper)
OVERFLOW = 1  # ContiguousLayout.flags bits
MISMATCH = 2
FP8 = torch.float8_e4m3fn


@dataclass
class ContiguousLayout:
    """The permuted activations and the indices that describe them (shapes: :mod:`moekit.kernels.permute`).

    ``expert_start`` is int32 ``[E + 1]``: where each expert's padded segment starts, and the
    total padded rows last. ``block_rows`` is int32 ``[M_sum / 128]``: rows holding data at the
    start of each 128-row block (0 for blocks of pure padding). ``cursor`` is scratch; after
    the permute it is ``expert_start[:-1]`` plus the pairs routed to each expert. ``flags`` is
    int32 ``[1]``: bit :data:`OVERFLOW` when ``counts`` undercount an expert or need more rows
    than M_sum (the rows that do not fit are dropped, never written out of bounds), bit
    :data:`MISMATCH` when ``counts`` differ at all from the pairs ``topk_ids`` route.
    """

    a: torch.Tensor
    a_scale: torch.Tensor
    m_indices: torch.Tensor
    inv_perm: torch.Tensor
    block_rows: torch.Tensor
    expert_start: torch.Tensor
    cursor: torch.Tensor
    flags: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.a.shape[0]


def column_major_scale(num_rows: int, groups: int, *, device, storage: torch.Tensor | None = None) -> torch.Tensor:
    """A ``[num_rows, groups]`` fp32 view over column-major storage ``[groups, round_up(num_rows, 4)]``."""
    padded = (num_rows + 3) // 4 * 4
    if storage is None:
        storage = torch.empty(groups * padded, dtype=torch.float32, device=device)
    return storage[: groups * padded].view(groups, padded)[:, :num_rows].t()


def alloc_layout(num_rows: int, K: int, num_pairs: int, num_experts: int, *, device) -> ContiguousLayout:
    """Fresh buffers for a layout of ``num_rows`` rows (experts carve theirs from workspaces)."""
    i32 = dict(dtype=torch.int32, device=device)
    return ContiguousLayout(
        a=torch.empty(num_rows, K, dtype=FP8, device=device),
        a_scale=column_major_scale(num_rows, math.ceil(K / ALIGN), device=device),
        m_indices=torch.empty(num_rows, **i32),
        inv_perm=torch.empty(num_pairs, **i32),
        block_rows=torch.empty(num_rows // ALIGN, **i32),
        expert_start=torch.empty(num_experts + 1, **i32),
        cursor=torch.empty(num_experts, **i32),
        flags=torch.empty(1, **i32),
    )
