"""What every peer of :mod:`benchmarks.harness.peers` shares, :mod:`benchmarks.harness.tk_peer` included.

- :class:`Peer`: a contender, ``run(problem) -> [M, K]``;
- :func:`skipped_peer`: a peer that cannot run here, with the reason;
- :func:`permute_by_expert`: (token, slot) pairs grouped by expert, as ``torch._grouped_mm`` and
  triton_kernels' routing want them.

Both peer modules import from here, so neither imports the other at load time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moekit.errors import InvalidInputError
from moekit.testing import MoEProblem


@dataclass
class Peer:
    """A contender: ``run(problem)`` computes the layer; ``release()`` frees cached workspaces."""

    name: str
    run: Callable[[MoEProblem], torch.Tensor]
    release: Callable[[], None] = lambda: None
    kernel: object = None  # the ModularKernel, when there is one (for its trace)
    skipped: str = ""  # why this peer cannot run here ("" when it can)


def skipped_peer(name: str, why: str) -> Peer:
    """A peer that cannot run here: ``skipped`` says why, and ``run`` raises that."""
    def run(x: MoEProblem) -> torch.Tensor:
        raise InvalidInputError(f"peer {name} is skipped: {why}")

    return Peer(name, run, skipped=why)


@dataclass
class ExpertPermutation:
    """(token, slot) pairs sorted by expert.

    - ``order`` ``[M*topk]``: sorted position -> flat pair index ``m * topk + j``;
    - ``token`` ``[M*topk]``: sorted position -> token m;
    - ``offsets`` int32 ``[E]``: end (exclusive) of each expert's rows, as grouped_mm wants.
    """

    order: torch.Tensor
    token: torch.Tensor
    offsets: torch.Tensor


def permute_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertPermutation:
    """Group the pairs by expert id with a stable argsort; ids must lie in ``[0, E)``."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order].to(torch.int32)
    bounds = torch.arange(num_experts, device=flat.device, dtype=torch.int32)
    offsets = torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32)
    return ExpertPermutation(order, order // topk_ids.shape[1], offsets)
