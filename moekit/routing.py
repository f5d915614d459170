"""Routing: softmax top-k, and seeded synthetic routers for experiments.

Every function returns :class:`Routing` (``topk_weights`` fp32 ``[M, topk]``, ``topk_ids``
int32 ``[M, topk]``) with distinct experts in each row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.errors import InvalidInputError
from moekit.validate import check_positive_int


@dataclass
class Routing:
    """The router's decision for M tokens."""

    topk_weights: torch.Tensor  # [M, topk] fp32
    topk_ids: torch.Tensor  # [M, topk] int32

    def __iter__(self):  # allows `weights, ids = route(...)`
        return iter((self.topk_weights, self.topk_ids))


def _check(M: int, E: int, topk: int) -> None:
    check_positive_int(M, "M", allow_zero=True)
    check_positive_int(E, "E")
    check_positive_int(topk, "topk")
    if topk > E:
        raise InvalidInputError(f"topk ({topk}) cannot exceed the number of experts ({E})")


def route(router_logits: torch.Tensor, topk: int, *, renormalize: bool = True) -> Routing:
    """Softmax over experts, then the top-k; optionally renormalize the k weights to sum to 1.

    Args:
        router_logits: ``[M, E]`` float scores.
        topk: experts per token.
        renormalize: divide the selected weights by their sum (Mixtral, Qwen3) or keep the raw
            softmax probabilities (Qwen2-MoE without ``norm_topk_prob``).
    """
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise InvalidInputError(
            f"router_logits must be a float [M, E] tensor, got {router_logits.dtype} {tuple(router_logits.shape)}"
        )
    M, E = router_logits.shape
    _check(M, E, topk)
    if not isinstance(renormalize, bool):
        raise InvalidInputError(f"renormalize must be a bool, got {renormalize!r}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return Routing(weights.contiguous(), ids.to(torch.int32).contiguous())


def _from_scores(scores: torch.Tensor, topk: int, generator: torch.Generator) -> Routing:
    """Sample distinct experts per row, with probability proportional to ``scores`` [E]."""
    M = scores.shape[0]
    if M == 0:
        return Routing(torch.zeros(0, topk), torch.zeros(0, topk, dtype=torch.int32))
    ids = torch.multinomial(scores, topk, replacement=False, generator=generator)  # [M, topk]
    weights = torch.rand(M, topk, generator=generator) + 0.1
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights.float().contiguous(), ids.to(torch.int32).contiguous())


def uniform_router(M: int, E: int, topk: int, *, seed: int = 0, device=None) -> Routing:
    """Each token picks ``topk`` distinct experts uniformly at random."""
    return skewed_router(M, E, topk, skew=0.0, seed=seed, device=device)


def skewed_router(M: int, E: int, topk: int, *, skew: float = 1.2, seed: int = 0, device=None) -> Routing:
    """Zipf-like popularity: expert e is drawn with weight ``1 / (rank(e) + 1) ** skew``.

    The ranking is a seeded permutation, so the popular experts are not always 0, 1, 2...
    ``skew=0`` is uniform.
    """
    _check(M, E, topk)
    g = torch.Generator().manual_seed(seed)
    rank = torch.randperm(E, generator=g).double()
    popularity = 1.0 / (rank + 1.0) ** float(skew)
    return _to(_from_scores(popularity.expand(M, E).contiguous(), topk, g), device)


def hot_expert_router(
    M: int, E: int, topk: int, *, hot: int = 0, fraction: float = 1.0, seed: int = 0, device=None
) -> Routing:
    """A ``fraction`` of the tokens all route to expert ``hot`` (plus topk-1 random others)."""
    _check(M, E, topk)
    if not 0 <= hot < E:
        raise InvalidInputError(f"hot expert must be in [0, {E}), got {hot}")
    g = torch.Generator().manual_seed(seed)
    r = _from_scores(torch.ones(M, E, dtype=torch.float64), topk, g)
    ids = r.topk_ids.long()
    chosen = torch.rand(M, generator=g) < fraction
    ids[chosen & ~(ids == hot).any(dim=1), 0] = hot  # a chosen row that lacks the hot expert takes it in slot 0
    return _to(Routing(r.topk_weights, ids.to(torch.int32).contiguous()), device)


def _to(r: Routing, device) -> Routing:
    if device is None:
        from moekit.device import get_device

        device = get_device()
    return Routing(r.topk_weights.to(device), r.topk_ids.to(device))


def expert_blocks(global_num_experts: int, ep_size: int) -> list[int]:
    """How many experts each of ``ep_size`` ranks owns in a contiguous split (vLLM's rule): the
    first ``E % ep_size`` ranks own one more. ``expert_blocks(8, 3) == [3, 3, 2]``."""
    check_positive_int(global_num_experts, "global_num_experts")
    check_positive_int(ep_size, "ep_size")
    if ep_size > global_num_experts:
        raise InvalidInputError(f"ep_size={ep_size} ranks need at least one expert each, got E={global_num_experts}")
    base, extra = divmod(global_num_experts, ep_size)
    return [base + (r < extra) for r in range(ep_size)]


def contiguous_expert_map(global_num_experts: int, ep_size: int, rank: int, *, device=None) -> torch.Tensor:
    """The expert_map of ``rank`` when E is split into ``ep_size`` contiguous blocks.

    The blocks follow :func:`expert_blocks` (equal when ``ep_size`` divides E). Returns int32
    ``[E_global]``: local id for this rank's experts, -1 elsewhere.

    Raises:
        InvalidInputError: a size that is not a positive int, more ranks than experts, or a rank
            outside ``[0, ep_size)``.
    """
    sizes = expert_blocks(global_num_experts, ep_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ep_size:
        raise InvalidInputError(f"rank must be an int in [0, {ep_size}), got {rank!r}")
    start = sum(sizes[:rank])
    emap = torch.full((global_num_experts,), -1, dtype=torch.int32)
    emap[start : start + sizes[rank]] = torch.arange(sizes[rank], dtype=torch.int32)
    return emap if device is None else emap.to(device)
