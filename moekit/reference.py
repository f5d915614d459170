"""The oracle: a plain fp32 torch MoE that every kernel and experts class is tested against.

It depends on torch alone, loops over experts, and favours obviousness over speed.

Shapes (M tokens, K hidden, N = 2 x intermediate, E experts)::

    hidden        [M, K]
    w1            [E, N, K]      gate rows [:N/2], then up rows [N/2:]
    w2            [E, K, N/2]
    topk_weights  [M, topk]
    topk_ids      [M, topk]      global expert ids; -1 = empty slot

    out[m] = sum_j  topk_weights[m, j] * w2[e] @ (silu(w1[e, :N/2] @ x) * (w1[e, N/2:] @ x)),
             e = local(topk_ids[m, j]); slots whose expert is -1 or not local contribute 0.
"""

from __future__ import annotations

import torch


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def local_expert_ids(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None = None
) -> torch.Tensor:
    """Map global ids to local ids; -1 where the slot is empty or its expert is not local.

    Without a map, ids outside ``[0, num_local_experts)`` are not local. With a map, negative
    ids and ids beyond the map are not local. moekit's kernels behave the same way: they ignore
    such ids, without reading past the map and without a host sync.
    """
    ids = topk_ids.long()
    if expert_map is None:
        ok = (ids >= 0) & (ids < num_local_experts)
        return torch.where(ok, ids, torch.full_like(ids, -1))
    emap = expert_map.long().to(ids.device)
    ok = (ids >= 0) & (ids < emap.numel())
    mapped = emap[ids.clamp(0, max(emap.numel() - 1, 0))] if emap.numel() else torch.full_like(ids, -1)
    mapped = torch.where(ok, mapped, torch.full_like(ids, -1))
    return torch.where((mapped >= 0) & (mapped < num_local_experts), mapped, torch.full_like(ids, -1))


def count_reference(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None = None
) -> torch.Tensor:
    """Tokens per local expert, int32 ``[num_local_experts]``: the spec of the count kernel."""
    local = local_expert_ids(topk_ids.reshape(-1), num_local_experts, expert_map)
    local = local[local >= 0]
    return torch.bincount(local.cpu(), minlength=num_local_experts).to(torch.int32).to(topk_ids.device)


def moe_reference(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
    apply_weights: bool = True,
) -> torch.Tensor:
    """The whole MoE layer in fp32; returns ``[M, K]`` (or ``[M, topk, K]`` unweighted).

    Args:
        hidden: ``[M, K]`` activations (any float dtype; fp8 inputs must be dequantized first).
        w1: ``[E_local, N, K]``. w2: ``[E_local, K, N/2]``.
        topk_weights, topk_ids: ``[M, topk]``; ids are global.
        expert_map: optional int ``[E_global]``, global id -> local id or -1.
        global_num_experts: E_global; informational (checked against the map's length).
        apply_weights: False returns the per-slot outputs ``[M, topk, K]`` before weighting.

    Returns:
        fp32 tensor ``[M, K]`` (or ``[M, topk, K]``).
    """
    M, K = hidden.shape
    E_local = w1.shape[0]
    if expert_map is not None and global_num_experts is not None and expert_map.numel() != global_num_experts:
        from moekit.errors import InvalidInputError

        raise InvalidInputError(
            f"expert_map has {expert_map.numel()} entries, expected global_num_experts={global_num_experts}"
        )
    x = hidden.float()
    local = local_expert_ids(topk_ids, E_local, expert_map)  # [M, topk]
    per_slot = torch.zeros(M, topk_ids.shape[1], K, dtype=torch.float32, device=hidden.device)
    for e in range(E_local):
        rows, slots = torch.nonzero(local == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        h = x[rows] @ w1[e].float().t()  # [r, N]
        per_slot[rows, slots] = silu_and_mul(h) @ w2[e].float().t()  # [r, K]
    if not apply_weights:
        return per_slot
    return (per_slot * topk_weights.float().unsqueeze(-1)).sum(dim=1)
