"""The oracle checked against the most literal reading of the spec (Python loops)."""

from __future__ import annotations

import pytest
import torch

from moekit.reference import (
    count_reference,
    local_expert_ids,
    moe_reference,
    silu_and_mul,
)
from moekit.routing import contiguous_expert_map
from moekit.testing import assert_close


def layer(M: int, K: int, I: int, E: int, topk: int, E_ids: int | None = None):
    """Random weights [E, 2I, K] / [E, K, I] and routing over ``E_ids`` global ids, with -1 slots."""
    E_ids = E_ids or E
    hidden = torch.randn(M, K)
    w1 = torch.randn(E, 2 * I, K) / K**0.5
    w2 = torch.randn(E, K, I) / I**0.5
    weights = torch.rand(M, topk) + 0.1
    ids = torch.rand(M, E_ids).argsort(dim=1)[:, :topk].to(torch.int32)
    ids[torch.rand(M, topk) < 0.2] = -1
    return hidden, w1, w2, weights, ids.contiguous()


def moe_reference_loop(hidden, w1, w2, topk_weights, topk_ids, *, expert_map=None) -> torch.Tensor:
    """moe_reference written as one Python loop over (token, slot) pairs: the most literal reading."""
    M, K = hidden.shape
    E_local = w1.shape[0]
    out = torch.zeros(M, K, dtype=torch.float32)
    for m in range(M):
        for j in range(topk_ids.shape[1]):
            g = int(topk_ids[m, j])
            if g < 0:
                continue
            if expert_map is None:
                e = g if g < E_local else -1
            else:
                e = int(expert_map[g]) if g < expert_map.numel() else -1
            if e < 0:
                continue
            h = w1[e].float() @ hidden[m].float()
            a = silu_and_mul(h)
            out[m] += float(topk_weights[m, j]) * (w2[e].float() @ a)
    return out


def test_silu_and_mul():
    x = torch.randn(3, 8)
    expected = x[:, :4] * torch.sigmoid(x[:, :4]) * x[:, 4:]
    torch.testing.assert_close(silu_and_mul(x), expected)


@pytest.mark.parametrize("M,K,I,E,topk", [(1, 8, 4, 2, 1), (7, 16, 12, 4, 2), (13, 24, 8, 6, 3)])
def test_moe_reference_matches_loop(M, K, I, E, topk):
    args = layer(M, K, I, E, topk)
    assert_close(moe_reference(*args), moe_reference_loop(*args), dtype=torch.float32)


@pytest.mark.parametrize("ep,rank", [(2, 0), (2, 1), (4, 3)])
def test_moe_reference_matches_loop_with_expert_map(ep, rank):
    E_global = 8
    hidden, w1, w2, weights, ids = layer(9, 16, 8, E_global, 3)
    emap = contiguous_expert_map(E_global, ep, rank)
    E_local = E_global // ep
    w1, w2 = w1[rank * E_local : (rank + 1) * E_local], w2[rank * E_local : (rank + 1) * E_local]
    out = moe_reference(hidden, w1, w2, weights, ids, expert_map=emap, global_num_experts=E_global)
    loop = moe_reference_loop(hidden, w1, w2, weights, ids, expert_map=emap)
    assert_close(out, loop, dtype=torch.float32)


def test_ranks_sum_to_the_unsplit_layer():
    E_global, ep = 8, 4
    hidden, w1, w2, weights, ids = layer(11, 16, 8, E_global, 2)
    full = moe_reference(hidden, w1, w2, weights, ids)
    E_local = E_global // ep
    parts = [
        moe_reference(
            hidden,
            w1[r * E_local : (r + 1) * E_local],
            w2[r * E_local : (r + 1) * E_local],
            weights,
            ids,
            expert_map=contiguous_expert_map(E_global, ep, r),
        )
        for r in range(ep)
    ]
    assert_close(sum(parts), full, dtype=torch.float32)


def test_unweighted_output_and_empty_slots():
    hidden, w1, w2, weights, ids = layer(6, 8, 4, 3, 2)
    ids[0] = -1
    per_slot = moe_reference(hidden, w1, w2, weights, ids, apply_weights=False)
    assert per_slot.shape == (6, 2, 8)
    assert torch.count_nonzero(per_slot[0]) == 0  # a token with only empty slots gets zeros
    weighted = (per_slot * weights.unsqueeze(-1)).sum(dim=1)
    assert_close(moe_reference(hidden, w1, w2, weights, ids), weighted, dtype=torch.float32)


def test_ids_not_local_contribute_nothing():
    # Without a map, ids >= E_local are another rank's experts.
    hidden, w1, w2, weights, ids = layer(5, 8, 4, 2, 2, E_ids=6)
    out = moe_reference(hidden, w1, w2, weights, ids)
    keep = (ids >= 0) & (ids < 2)
    masked = moe_reference(hidden, w1, w2, weights * keep, torch.where(keep, ids, torch.zeros_like(ids)))
    assert_close(out, masked, dtype=torch.float32)


def test_local_expert_ids():
    ids = torch.tensor([[0, 3, -1], [5, 7, 2]])
    assert local_expert_ids(ids, 4).tolist() == [[0, 3, -1], [-1, -1, 2]]
    emap = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)
    assert local_expert_ids(ids, 4, emap).tolist() == [[-1, -1, -1], [1, 3, -1]]
    # Ids beyond the map, and map entries outside [0, E_local), are not local.
    assert local_expert_ids(torch.tensor([8, 100]), 4, emap).tolist() == [-1, -1]
    assert local_expert_ids(torch.tensor([0, 1]), 2, torch.tensor([5, 1])).tolist() == [-1, 1]


def count_loop(ids: torch.Tensor, E_local: int, emap: torch.Tensor | None) -> list[int]:
    counts = [0] * E_local
    limit = E_local if emap is None else emap.numel()
    for g in ids.flatten().tolist():
        if not 0 <= g < limit:
            continue
        e = g if emap is None else int(emap[g])
        if 0 <= e < E_local:
            counts[e] += 1
    return counts


@pytest.mark.parametrize("M,topk,E,ep", [(1, 1, 4, 1), (17, 3, 12, 1), (40, 4, 12, 3), (33, 2, 7, 1), (0, 2, 4, 2)])
def test_count_reference_matches_loop(M, topk, E, ep):
    ids = torch.randint(-1, E + 2, (M, topk))
    maps = [None] if ep == 1 else [contiguous_expert_map(E, ep, r) for r in range(ep)]
    for emap in maps:
        E_local = E // ep
        got = count_reference(ids, E_local, emap)
        assert got.dtype == torch.int32 and got.shape == (E_local,)
        assert got.tolist() == count_loop(ids, E_local, emap)


def test_count_reference_counts_pairs_not_tokens():
    assert count_reference(torch.tensor([[1, 1], [1, 0]]), 2).tolist() == [1, 3]
