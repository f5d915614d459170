"""moekit.prepare_finalize.agreement: what the ranks of an all-to-all agree on before tokens move.

Every rank function runs all its cases in one launch (spawning ranks is slow) and returns plain
values; the errors are caught on each rank, so the test sees what every rank raised.
"""

from __future__ import annotations

import pytest
import torch

from moekit.distributed import launch
from moekit.errors import InvalidIdsError, InvalidInputError, MoekitError, QuantizationError
from moekit.prepare_finalize.agreement import Agreement, Dispatch, Placement
from moekit.routing import contiguous_expert_map
from moekit.types import ExpertPlacement, QuantScheme

pytestmark = pytest.mark.distributed
TIMEOUT = 120
NONE, FP8_BLOCK = QuantScheme.NONE, QuantScheme.FP8_BLOCK


def described(p: Placement) -> dict:
    return {"owner": p.owner.tolist(), "local": p.local.tolist(), "sizes": p.sizes,
            "position": p.position.tolist(), "by_position": p.by_position.tolist()}  # fmt: skip


def one_rank(rank: int, world: int) -> dict:
    a = Agreement(None)
    p = a.check(torch.randn(3, 16), 2, NONE, ExpertPlacement(4, 4, None))
    return {"type": type(p).__name__, **described(p), "cached": a.check(torch.randn(5, 16), 2, NONE,
            ExpertPlacement(4, 4, None)) is p}  # fmt: skip


def test_one_rank_without_a_map_owns_every_expert():
    (got,) = launch(one_rank, 1, backend="gloo", timeout_s=TIMEOUT)
    assert got == {"type": "Placement", "owner": [0] * 4, "local": [0, 1, 2, 3], "sizes": (4,),
                   "position": [0, 1, 2, 3], "by_position": [0, 1, 2, 3], "cached": True}  # fmt: skip


def placements(rank: int, world: int) -> dict:
    a, hidden, out = Agreement(None), torch.randn(3, 8), {}
    contiguous = ExpertPlacement(8, 4, contiguous_expert_map(8, 2, rank))
    p = a.check(hidden, 2, NONE, contiguous)
    out["contiguous"] = described(p)
    out["cached"] = a.check(torch.randn(7, 8), 2, NONE, contiguous) is p  # new tokens, same layer
    # Rank r owns the experts g with g % 2 == r, as local id g // 2.
    emap = torch.tensor([g // 2 if g % 2 == rank else -1 for g in range(8)], dtype=torch.int32)
    out["interleaved"] = described(a.check(hidden, 2, NONE, ExpertPlacement(8, 4, emap)))
    # Uneven blocks: rank 0 owns experts 0-4, rank 1 owns 5-7.
    uneven = torch.tensor([g if rank == 0 else -1 for g in range(5)] + [g if rank else -1 for g in range(3)])
    out["uneven"] = described(a.check(hidden, 2, FP8_BLOCK, ExpertPlacement(8, 5 if rank == 0 else 3, uneven)))
    return out


def test_the_agreed_placement_groups_experts_by_owner_then_local_id():
    results = launch(placements, 2, backend="gloo", timeout_s=TIMEOUT)
    assert results[0] == results[1], results
    got = results[0]
    assert got["contiguous"] == {"owner": [0] * 4 + [1] * 4, "local": [0, 1, 2, 3] * 2, "sizes": (4, 4),
                                 "position": list(range(8)), "by_position": list(range(8))}  # fmt: skip
    assert got["cached"]
    assert got["interleaved"] == {"owner": [0, 1] * 4, "local": [0, 0, 1, 1, 2, 2, 3, 3], "sizes": (4, 4),
                                  "position": [0, 4, 1, 5, 2, 6, 3, 7], "by_position": [0, 2, 4, 6, 1, 3, 5, 7]}
    assert got["uneven"]["sizes"] == (5, 3) and got["uneven"]["owner"] == [0] * 5 + [1] * 3
    assert got["uneven"]["local"] == [0, 1, 2, 3, 4, 0, 1, 2]


def disagreements(rank: int, world: int) -> dict:
    a, out = Agreement(None), {}
    placement = ExpertPlacement(8, 4, contiguous_expert_map(8, 2, rank))
    cases = {  # rank 1 differs in one thing each time
        "dtype": dict(hidden=torch.randn(3, 8).to(torch.float16 if rank else torch.bfloat16)),
        "K": dict(hidden=torch.randn(3, 64 if rank else 32)),
        "E": dict(placement=ExpertPlacement(12, 4, contiguous_expert_map(12, 3, rank)) if rank else placement),
        "topk": dict(topk=3 if rank else 2),
        "quant": dict(quant=FP8_BLOCK if rank else NONE),
        "two owners": dict(placement=ExpertPlacement(8, 4, contiguous_expert_map(8, 2, 0))),
        "local ids": dict(placement=ExpertPlacement(8, 4, contiguous_expert_map(8, 2, rank) // (1 + rank))),
        "bad entries": dict(placement=ExpertPlacement(8, 4, contiguous_expert_map(8, 2, rank) * (1 + rank))),
        "no map": dict(placement=ExpertPlacement(8, 4, None)),
    }
    dispatches = {  # stages built differently on rank 1
        "mode": Dispatch("capacity", 4) if rank else Dispatch(),
        "capacity": Dispatch("capacity", 8 if rank else 4),
        "check": Dispatch("capacity", 4, "deferred" if rank else "sync"),
    }
    cases |= {what: dict(dispatch=d) for what, d in dispatches.items()}
    cases["no map on rank 1"] = dict(placement=ExpertPlacement(8, 4, None) if rank else placement)
    for what, change in cases.items():
        kw = {"hidden": torch.randn(3, 8), "topk": 2, "quant": NONE, "placement": placement} | change
        a.dispatch = kw.get("dispatch", Dispatch())
        try:
            a.check(kw["hidden"], kw["topk"], kw["quant"], kw["placement"])
            out[what] = "no error"
        except InvalidInputError as e:
            out[what] = str(e)
    a.dispatch = Dispatch()
    out["then"] = described(a.check(torch.randn(3, 8), 2, NONE, placement))["sizes"]  # still in step
    return out


def test_ranks_that_disagree_all_raise_a_named_error():
    results = launch(disagreements, 2, backend="gloo", timeout_s=TIMEOUT)
    for rank, got in enumerate(results):
        assert got["dtype"].startswith("the ranks disagree about the MoE layer's hidden dtype: rank(s) [1] have "
                                       "float16 where the others have bfloat16"), got["dtype"]  # fmt: skip
        assert f"(seen from rank {rank}: {{0: 32, 1: 64}})" in got["K"], got["K"]
        assert "global_num_experts: rank(s) [1] have 12 where the others have 8" in got["E"], got["E"]
        assert "topk: rank(s) [1] have 3 where the others have 2" in got["topk"], got["topk"]
        assert "quant scheme: rank(s) [1]" in got["quant"], got["quant"]
        assert "experts [0, 1, 2, 3, 4, 5, 6, 7] have [2, 2, 2, 2, 0, 0, 0, 0] owners" in got["two owners"]
        assert "rank 1's map gives local ids [0, 0, 1, 1] for its 4 experts" in got["local ids"], got["local ids"]
        # Entries out of [-1, E_local) (-2 four times, 4 and 6) are counted on the device, named in the header round.
        assert f"rank(s) [1] passed {{1: 6}} other entries (seen from rank {rank})" in got["bad entries"]
        assert f"rank(s) [0, 1] of 2 got no expert_map (seen from rank {rank})" in got["no map"], got["no map"]
        # Before: the rank without a map raised alone, and the other waited in the map gather.
        assert "rank(s) [1] of 2 got no expert_map" in got["no map on rank 1"], got["no map on rank 1"]
        # Before: the dispatch was not in the header (exact on one rank, capacity on another).
        assert "dispatch mode: rank(s) [1] have capacity where the others have exact" in got["mode"], got["mode"]
        assert "max_tokens_per_rank: rank(s) [1] have 8 where the others have 4" in got["capacity"], got
        assert "capacity check: rank(s) [1] have deferred where the others have sync" in got["check"], got
        assert got["then"] == (4, 4)


def refusals(rank: int, world: int) -> list[str]:
    """Rank 1 (then ranks 0 and 2) refuse; the others' check raises the refusing rank's error class."""
    a, got = Agreement(None, timeout_s=10), []
    placement = ExpertPlacement(6, 2, contiguous_expert_map(6, world, rank))
    for refusing, error in (({1}, InvalidIdsError("bad ids")), ({0, 2}, QuantizationError("bad scales"))):
        try:
            if rank in refusing:
                a.refuse(error, "cpu")
                got.append("refused")
            else:
                a.check(torch.randn(2, 8), 2, NONE, placement)
                got.append("no error")
        except MoekitError as e:
            got.append(f"{type(e).__name__}: {str(e).split(';')[0]}")
    got.append(f"then: {a.check(torch.randn(2, 8), 2, NONE, placement).sizes}")
    return got


def test_a_refusing_rank_makes_the_others_raise_its_error_class():
    r0, r1, r2 = launch(refusals, 3, backend="gloo", timeout_s=TIMEOUT)
    ids = "InvalidIdsError: rank(s) [1] rejected their inputs before the dispatch ({1: 'InvalidIdsError'})"
    quant = ("QuantizationError: rank(s) [0, 2] rejected their inputs before the dispatch "
             "({0: 'QuantizationError', 2: 'QuantizationError'})")  # fmt: skip
    then = "then: (2, 2, 2)"
    assert (r0, r1, r2) == ([ids, "refused", then], ["refused", quant, then], [ids, "refused", then]), (r0, r1, r2)
