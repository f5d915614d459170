"""moekit.workbook.cases: seeded draws over an exercise's whole space, edges included."""

from __future__ import annotations

import torch

from moekit.reference import count_reference
from moekit.workbook.cases import HOT, ID_DTYPES, MAPS, Routing, Sampler, fresh_seed


def test_a_seed_replays_its_draws():
    def draws(seed):
        s = Sampler(seed)
        return [(str(rt), s.batch(rt).ids.tolist()) for rt in s.routings(3, {"M": 0}, {"E": 1})]

    seed = fresh_seed()
    assert draws(seed) == draws(seed) and draws(seed) != draws(seed + 1)


def test_every_ids_dtype_and_map_is_drawn_and_the_last_draw_repeats():
    rts = Sampler(fresh_seed()).routings(4, {"M": 0}, {"M": 1, "E": 1})
    assert {rt.dtype for rt in rts[2:]} == set(ID_DTYPES) and {rt.map for rt in rts[2:]} == set(MAPS)
    assert rts[0].M == 0 and (rts[1].M, rts[1].E) == (1, 1) and rts[-1] == rts[-2]


def test_maps_give_each_rank_its_local_ids():
    s = Sampler(fresh_seed())
    for kind in MAPS[1:]:
        maps = [s.expert_map(Routing(1, 1, 10, torch.int16, kind, 3, rank)) for rank in range(3)]
        owned = torch.stack([m >= 0 for m in maps]).sum(0)  # a random map is one rank's own draw
        assert kind == "random" or owned.tolist() == [1] * 10, kind
        for rank, m in enumerate(maps):
            n = Routing(1, 1, 10, torch.int16, kind, 3, rank).num_local
            assert sorted(m[m >= 0].tolist()) == list(range(n)), kind
    strided = s.expert_map(Routing(1, 1, 7, torch.int32, "strided", 2, 1))
    assert strided.tolist() == [-1, 0, -1, 1, -1, 2, -1]


def test_a_batch_holds_the_edges():
    s = Sampler(fresh_seed())
    rt = s.routing(0, hot=HOT, E=5, map="strided")
    b = s.batch(rt, block=16)
    assert b.ids.shape == (rt.M, rt.topk) and b.ids.dtype == torch.int16
    assert int(count_reference(b.ids, b.num_local, b.expert_map).max()) >= HOT > 32767
    assert (b.ids == -1).any() and (b.ids >= rt.E).any()
