"""Routers: distinct experts per row, seeded, and the distributions they promise."""

from __future__ import annotations

import pytest
import torch

from moekit.errors import InvalidInputError
from moekit.routing import (
    Routing,
    contiguous_expert_map,
    expert_blocks,
    hot_expert_router,
    route,
    skewed_router,
    uniform_router,
)

ROUTERS = [
    lambda **kw: uniform_router(64, 16, 4, **kw),
    lambda **kw: skewed_router(64, 16, 4, skew=1.5, **kw),
    lambda **kw: hot_expert_router(64, 16, 4, hot=3, fraction=0.5, **kw),
]


def assert_valid(r: Routing, M: int, E: int, topk: int) -> None:
    assert r.topk_ids.shape == (M, topk) and r.topk_weights.shape == (M, topk)
    assert r.topk_ids.dtype == torch.int32 and r.topk_weights.dtype == torch.float32
    assert r.topk_ids.is_contiguous() and r.topk_weights.is_contiguous()
    assert bool(((r.topk_ids >= 0) & (r.topk_ids < E)).all())
    sorted_ids = r.topk_ids.sort(dim=1).values
    assert bool((sorted_ids[:, 1:] != sorted_ids[:, :-1]).all()), "an expert repeats within a row"


@pytest.mark.parametrize("make", ROUTERS, ids=["uniform", "skewed", "hot"])
def test_rows_hold_distinct_experts_and_weights_sum_to_one(make):
    r = make(seed=1)
    assert_valid(r, 64, 16, 4)
    torch.testing.assert_close(r.topk_weights.sum(dim=1), torch.ones(64, device=r.topk_weights.device))
    assert bool((r.topk_weights > 0).all())


@pytest.mark.parametrize("make", ROUTERS, ids=["uniform", "skewed", "hot"])
def test_seeds_are_reproducible(make):
    a, b, c = make(seed=7), make(seed=7), make(seed=8)
    assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_weights, b.topk_weights)
    assert not torch.equal(a.topk_ids, c.topk_ids)


def test_seed_does_not_depend_on_global_rng():
    torch.manual_seed(1)
    a = uniform_router(32, 8, 2, seed=3)
    torch.manual_seed(2)
    assert torch.equal(a.topk_ids, uniform_router(32, 8, 2, seed=3).topk_ids)


def share_of_busiest(ids: torch.Tensor, E: int) -> float:
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    return float(counts.max()) / float(counts.sum())


def test_skew_changes_the_distribution():
    M, E, topk = 2048, 32, 2
    uniform = share_of_busiest(skewed_router(M, E, topk, skew=0.0).topk_ids, E)
    skewed = share_of_busiest(skewed_router(M, E, topk, skew=2.0).topk_ids, E)
    assert uniform < 0.05 < 0.2 < skewed  # uniform ~ 1/32; Zipf(2) puts ~ 1/3 on the top expert
    assert torch.equal(skewed_router(M, E, topk, skew=0.0).topk_ids, uniform_router(M, E, topk).topk_ids)


def test_popular_experts_are_a_seeded_permutation():
    busiest = {
        int(torch.bincount(skewed_router(512, 16, 1, skew=3.0, seed=s).topk_ids.flatten().long()).argmax())
        for s in range(8)
    }
    assert len(busiest) > 1, "the most popular expert should move with the seed"


@pytest.mark.parametrize("hot", [0, 5, 15])
def test_hot_expert_appears(hot):
    r = hot_expert_router(200, 16, 3, hot=hot, fraction=1.0)
    assert_valid(r, 200, 16, 3)
    assert bool((r.topk_ids == hot).any(dim=1).all())


def test_hot_fraction():
    r = hot_expert_router(4000, 32, 2, hot=9, fraction=0.5, seed=2)
    share = float((r.topk_ids == 9).any(dim=1).float().mean())
    # half the rows are forced to it; the other half pick it with probability 2/32
    assert 0.45 < share < 0.6


def test_route_softmax_topk():
    logits = torch.randn(10, 12)
    weights, ids = route(logits, 3)
    assert_valid(Routing(weights, ids), 10, 12, 3)
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(10))
    probs = torch.softmax(logits, dim=-1)
    expected_ids = probs.topk(3, dim=-1).indices
    assert torch.equal(ids.long(), expected_ids)
    raw = route(logits, 3, renormalize=False)
    torch.testing.assert_close(raw.topk_weights, probs.gather(1, expected_ids))
    assert bool((raw.topk_weights.sum(dim=1) < 1).all())


def test_route_renormalize_matches_raw_ratio():
    logits = torch.randn(4, 6, dtype=torch.bfloat16)
    renorm, raw = route(logits, 2), route(logits, 2, renormalize=False)
    torch.testing.assert_close(renorm.topk_weights, raw.topk_weights / raw.topk_weights.sum(1, keepdim=True))


def test_empty_batch():
    r = uniform_router(0, 8, 2)
    assert r.topk_ids.shape == (0, 2) and r.topk_ids.dtype == torch.int32
    assert route(torch.zeros(0, 8), 2).topk_ids.shape == (0, 2)


@pytest.mark.parametrize(
    "call",
    [
        lambda: uniform_router(4, 4, 5),
        lambda: uniform_router(4, 0, 1),
        lambda: uniform_router(4, 4, 0),
        lambda: uniform_router(-1, 4, 1),
        lambda: skewed_router(4, 3, 4),
        lambda: hot_expert_router(4, 8, 2, hot=8),
        lambda: hot_expert_router(4, 8, 2, hot=-1),
        lambda: route(torch.randn(4, 3), 4),
        lambda: route(torch.randn(12), 2),
        lambda: route(torch.randint(0, 3, (4, 8)), 2),
        lambda: contiguous_expert_map(3, 4, 0),
        lambda: contiguous_expert_map(8, 0, 0),
        lambda: contiguous_expert_map(8, 2.0, 0),
        lambda: contiguous_expert_map(8, 2, 1.0),
        lambda: route(torch.randn(4, 3), 1.5),
        lambda: route(torch.randn(4, 3), "2"),
        lambda: route(torch.randn(4, 3), True),
        lambda: uniform_router(2.5, 4, 1),
        lambda: uniform_router(4, 4.0, 1),
        lambda: contiguous_expert_map(8, 2, 2),
        lambda: contiguous_expert_map(8, 2, -1),
    ],
)
def test_errors(call):
    with pytest.raises(InvalidInputError):
        call()


@pytest.mark.parametrize("E, ep, sizes", [(8, 3, [3, 3, 2]), (10, 4, [3, 3, 2, 2]), (5, 5, [1] * 5)])
def test_uneven_placement_follows_vllm_rule(E, ep, sizes):
    # The first E % ep ranks own one more expert; every expert is owned by exactly one rank.
    assert expert_blocks(E, ep) == sizes
    maps = [contiguous_expert_map(E, ep, r) for r in range(ep)]
    assert [int((m >= 0).sum()) for m in maps] == sizes
    assert torch.equal(torch.stack(maps).ge(0).sum(0), torch.ones(E, dtype=torch.long))
    assert torch.equal(torch.cat([m[m >= 0] for m in maps]), torch.cat([torch.arange(n) for n in sizes]).int())


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_contiguous_expert_map(ep):
    E = 8
    E_local = E // ep
    maps = [contiguous_expert_map(E, ep, r) for r in range(ep)]
    for r, emap in enumerate(maps):
        assert emap.dtype == torch.int32 and emap.shape == (E,)
        assert emap[r * E_local : (r + 1) * E_local].tolist() == list(range(E_local))
        assert int((emap >= 0).sum()) == E_local
    # every global expert lives on exactly one rank
    assert torch.equal(torch.stack(maps).ge(0).sum(0), torch.ones(E, dtype=torch.long))


def test_routing_unpacks():
    weights, ids = uniform_router(3, 4, 2)
    assert weights.shape == ids.shape == (3, 2)
