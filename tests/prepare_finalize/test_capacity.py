"""All2AllPrepareFinalize(mode="capacity"): fixed blocks, no host sync, on gloo ranks (CPU).

The stage alone with identity experts (exact results), the whole modular kernel against the
one-process reference at world 1 to 4 (uneven M with zeros, E not divisible by the world,
topk 1/2/8, token and row chunks, Triton and TritonOrDeepGemm), the errors that travel as flags,
and a check that after the first call the stage reads nothing back from the tensors it moves.
Spawning ranks costs more than most cases do, so tests whose cases can share a process group share
one launch (the ``launched`` fixture of conftest.py): the stage and the whole kernel once per world,
the three two-rank checks once.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from shared_launch import in_step

from moekit.distributed import launch
from moekit.ep import EPConfig, run_cases
from moekit.errors import CapacityError, InvalidIdsError, InvalidInputError
from moekit.prepare_finalize.all2all import All2AllPrepareFinalize
from moekit.routing import contiguous_expert_map, uniform_router
from moekit.testing import expect_raises
from moekit.types import ExpertPlacement, QuantScheme

pytestmark = pytest.mark.distributed
TIMEOUT = 240


def _inputs(rank, world, Ms, E, topk, seed):
    M, (s, e) = sum(Ms), (sum(Ms[:rank]), sum(Ms[: rank + 1]))
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, 16, generator=g)
    weights, ids = uniform_router(M, E, topk, seed=seed, device="cpu")
    if M:
        ids[::3, -1] = -1
    emap = contiguous_expert_map(E, world, rank)
    placement = ExpertPlacement(E, int((emap >= 0).sum()), emap)
    want = (weights[s:e] * (ids[s:e] >= 0)).sum(1, keepdim=True) * hidden[s:e]
    return hidden[s:e], weights[s:e], ids[s:e], placement, want


def _run(pf, hidden, weights, ids, placement):
    """prepare -> identity experts (every slot returns its row) -> finalize."""
    prep = pf.prepare(hidden, weights, ids, quant=QuantScheme.NONE, placement=placement)
    R, topk = prep.topk_ids.shape
    identity = prep.a1q.float().view(R, 1, 16).expand(R, topk, 16).contiguous()
    return pf.finalize(identity, prep, output=torch.empty(hidden.shape[0], 16))


def _stage(rank, world, Ms, E, topk, *, pf=None, seed=0):
    hidden, weights, ids, placement, want = _inputs(rank, world, Ms, E, topk, seed)
    pf = pf or All2AllPrepareFinalize(mode="capacity", max_tokens_per_rank=max(max(Ms), 1), timeout_s=60)
    return _run(pf, hidden, weights, ids, placement), want, pf


def stage_cases(rank: int, world: int) -> list[str]:
    problems = []
    for Ms, E, topk in (((5, 0, 9, 3)[:world], 8, 2), ((0, 4, 0, 1)[:world], 8, 1), ((6, 6, 6, 6)[:world], 9, 4)):
        if not sum(Ms):
            continue
        out, want, pf = _stage(rank, world, Ms, E, topk, seed=E + topk)
        if not torch.allclose(out, want, atol=1e-5, rtol=1e-5):
            problems.append(f"rank {rank} Ms={Ms} E={E} topk={topk}: {float((out - want).abs().max())}")
        again, _, _ = _stage(rank, world, Ms, E, topk, pf=pf, seed=E + topk)
        if not torch.equal(again, out):
            problems.append(f"rank {rank} Ms={Ms}: a second run gave other bits")
    return problems


def both_levels(rank: int, world: int, kernel_cases: list) -> tuple:
    """Rank function: the stage's cases, then the whole kernel's, in one process group."""
    return (in_step(rank, "stage cases", stage_cases, world),
            in_step(rank, "kernel cases", run_cases, world, kernel_cases))  # fmt: skip


def _levels(launched, world: int) -> list[tuple]:
    """Per rank, (the stage's problems, the kernel cases' results), from one launch per world (both
    tests are `interpreter` tests: they run, or skip, together)."""
    return launched((__name__, "levels", world), lambda: launch(both_levels, world, backend="gloo",
                    args=(_mk_cases(world),), timeout_s=3 * TIMEOUT))  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_stage_dispatch_and_combine(world, launched):
    results = [stage for stage, _ in _levels(launched, world)]
    assert results == [[]] * world, "\n".join(p for r in results for p in r)


def _mk_cases(world):
    Ms = {1: (7,), 2: (9, 0), 3: (7, 0, 5), 4: (5, 0, 9, 3)}[world]
    fp8 = dict(K=128, N=256, experts="triton_or_deep_gemm", quant=QuantScheme.FP8_BLOCK)
    return [
        EPConfig(Ms, E=8, topk=2, K=64, N=64, dispatch="capacity", empty_every=3),
        EPConfig(Ms, E=10, topk=1, K=64, N=64, dispatch="capacity", chunk_size=4),
        EPConfig(Ms, E=8, topk=8, K=64, N=64, dispatch="capacity", chunk_size=128, chunk_by="rows"),
        EPConfig(Ms, E=8, topk=4, dispatch="capacity", chunk_size=4, **fp8),
    ]


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_modular_kernel_matches_reference_on_every_rank(world, launched):
    cases = _mk_cases(world)
    per_rank = [kernel for _, kernel in _levels(launched, world)]
    for rank, results in enumerate(per_rank):
        for case, r in zip(cases, results, strict=True):
            assert r.error is None and r.close, f"rank {rank} {case}: {r.error or r.max_abs_err}"
            assert r.output.shape == (case.Ms[rank], case.K)
            if r.counts.numel():  # the chunks' counts add up to what the dispatch delivered
                assert r.counts.sum(0).tolist() == r.tokens_meta


def errors(rank: int, world: int) -> list[str]:
    got = []
    placement = ExpertPlacement(4, 2, contiguous_expert_map(4, world, rank))
    hidden, weights = torch.randn(6, 8), torch.rand(6, 2)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]] * 2)
    sync = All2AllPrepareFinalize(mode="capacity", max_tokens_per_rank=4, timeout_s=60)
    try:  # rank 1 passes 6 tokens for blocks of 4: every rank raises, before any output
        sync.prepare(hidden[: 6 if rank else 3], weights[: 6 if rank else 3], ids[: 6 if rank else 3],
                     quant=QuantScheme.NONE, placement=placement)  # fmt: skip
    except CapacityError as e:
        got.append(f"sync: CapacityError {'rank(s) [1]' in str(e)}")
    try:  # M = C + 1 on rank 1: the first count past the capacity
        sync.prepare(hidden[: 5 if rank else 3], weights[: 5 if rank else 3], ids[: 5 if rank else 3],
                     quant=QuantScheme.NONE, placement=placement)  # fmt: skip
    except CapacityError as e:
        got.append(f"C + 1: CapacityError {'rank(s) [1]' in str(e)}")
    try:  # an id beyond E on rank 0 only
        bad = ids[:3] + 4 * (rank == 0)
        sync.prepare(hidden[:3], weights[:3], bad, quant=QuantScheme.NONE, placement=placement)
    except InvalidIdsError as e:
        got.append(f"ids: InvalidIdsError {'rank(s) [0]' in str(e)}")
    try:  # id == E exactly (E = 4), on rank 0 only
        bad = torch.where((ids[:3] == 3) & (rank == 0), 4, ids[:3])
        sync.prepare(hidden[:3], weights[:3], bad, quant=QuantScheme.NONE, placement=placement)
    except InvalidIdsError as e:
        got.append(f"id == E: InvalidIdsError {'rank(s) [0]' in str(e)}")
    prep = sync.prepare(hidden[:3], weights[:3], ids[:3], quant=QuantScheme.NONE, placement=placement)
    got.append(f"then ok: {prep.a1q.shape[0] == 4 * world}")
    sync.finalize(torch.zeros(4 * world, 2, 8), prep, output=torch.empty(3, 8))
    deferred = All2AllPrepareFinalize(mode="capacity", max_tokens_per_rank=4, check="deferred", timeout_s=60)
    out = torch.full((6, 8), 7.0)
    m = 6 if rank else 3
    prep = deferred.prepare(hidden[:m], weights[:m], ids[:m], quant=QuantScheme.NONE, placement=placement)
    try:
        deferred.finalize(torch.zeros(4 * world, 2, 8), prep, output=out[:m])
        got.append("finalize: ok")
    except CapacityError:
        got.append(f"finalize: CapacityError, output untouched {bool((out == 7).all())}")
    try:
        deferred.raise_if_failed()
    except CapacityError:
        got.append("raise_if_failed: CapacityError")
    return got


def two_rank_checks(rank: int, world: int) -> dict[str, list[str]]:
    """Rank function: :func:`errors`, :func:`reads_nothing_back` and :func:`stages_built_differently`
    in turn, in one process group (each builds its own stages)."""
    return {part.__name__: in_step(rank, part.__name__, part, world)
            for part in (errors, reads_nothing_back, stages_built_differently)}  # fmt: skip


def _two_rank_checks(launched, name: str) -> list[list[str]]:
    """Per rank, what the check ``name`` returned; one launch serves the three tests."""
    runs = launched((__name__, "two-rank checks"), lambda: launch(two_rank_checks, 2, backend="gloo",
                    timeout_s=TIMEOUT))  # fmt: skip
    return [by_name[name] for by_name in runs]


@pytest.mark.interpreter
def test_errors_travel_as_flags_and_every_rank_raises(launched):
    r0, r1 = _two_rank_checks(launched, "errors")
    common = ["sync: CapacityError True", "C + 1: CapacityError True", "ids: InvalidIdsError True",
              "id == E: InvalidIdsError True", "then ok: True"]  # fmt: skip
    assert r0 == [*common, "finalize: ok", "raise_if_failed: CapacityError"]
    assert r1 == [*common, "finalize: CapacityError, output untouched True", "raise_if_failed: CapacityError"]


def reads_nothing_back(rank: int, world: int) -> list[str]:
    """After a first call (the agreement), prepare and finalize never copy a tensor to the host."""
    Ms, E, topk = (4, 3), 8, 2
    pf = All2AllPrepareFinalize(mode="capacity", max_tokens_per_rank=4, check="deferred", timeout_s=60)
    _stage(rank, world, Ms, E, topk, pf=pf, seed=1)  # warm up: agree once (the check mode is agreed on too)
    reads = []
    originals = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu", "__bool__", "__int__")}

    def spy(name):
        def read(self, *a, **k):
            reads.append(name)
            return originals[name](self, *a, **k)

        return read

    hidden, weights, ids, placement, want = _inputs(rank, world, Ms, E, topk, seed=1)
    try:
        for n in originals:
            setattr(torch.Tensor, n, spy(n))
        out = _run(pf, hidden, weights, ids, placement)
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)
    pf.raise_if_failed()
    return [f"reads: {sorted(set(reads))}", f"close: {torch.allclose(out, want, atol=1e-5)}"]


@pytest.mark.interpreter
def test_after_the_first_call_nothing_is_read_back(launched):
    results = _two_rank_checks(launched, "reads_nothing_back")
    assert results == [["reads: []", "close: True"]] * 2, results


def stages_built_differently(rank: int, world: int) -> list[str]:
    """Rank 1's stage differs from rank 0's in mode, capacity or check: both raise, and stay in step."""
    placement = ExpertPlacement(4, 2, contiguous_expert_map(4, world, rank))
    hidden, weights, ids = torch.randn(3, 8), torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 0]])
    capacity = dict(mode="capacity", max_tokens_per_rank=4, timeout_s=30)
    got = []
    for what, other in (("mode", dict(timeout_s=30)), ("capacity", {**capacity, "max_tokens_per_rank": 8}),
                        ("check", {**capacity, "check": "deferred"})):  # fmt: skip
        pf = All2AllPrepareFinalize(**(other if rank else capacity))
        try:
            pf.prepare(hidden, weights, ids, quant=QuantScheme.NONE, placement=placement)
            got.append(f"{what}: no error")
        except InvalidInputError as e:
            got.append(f"{what}: {'rank(s) [1]' in str(e)} {str(e).split(':')[0]}")
    pf = All2AllPrepareFinalize(**capacity)
    got.append(f"then: {pf.prepare(hidden, weights, ids, quant=QuantScheme.NONE, placement=placement).a1q.shape[0]}")
    return got


@pytest.mark.interpreter
def test_stages_built_differently_raise_on_every_rank(launched):
    # Before: exact mode on one rank and capacity on the other was not detected (and the
    # capacity check mode not at all): mismatched collectives, gloo aborting or a hang.
    results = _two_rank_checks(launched, "stages_built_differently")
    assert results == [["mode: True the ranks disagree about the MoE layer's dispatch mode",
                        "capacity: True the ranks disagree about the MoE layer's max_tokens_per_rank",
                        "check: True the ranks disagree about the MoE layer's capacity check", "then: 8"]] * 2, results


def test_bad_constructor_arguments():
    with expect_raises(InvalidInputError, match="max_tokens_per_rank, an int > 0"):
        All2AllPrepareFinalize(mode="capacity")
    with expect_raises(InvalidInputError, match="mode must be one of"):
        All2AllPrepareFinalize(mode="fast")
    with expect_raises(InvalidInputError, match="takes none"):
        All2AllPrepareFinalize(max_tokens_per_rank=8)
    assert "max_tokens_per_rank=8" in repr(All2AllPrepareFinalize(mode="capacity", max_tokens_per_rank=8))


def captured_layer(rank: int, world: int) -> list[str]:
    """prepare -> experts -> finalize in one CUDA graph (NCCL), replayed on new inputs."""
    from moekit.experts import TritonExperts
    from moekit.modular_kernel import ModularKernel
    from moekit.testing import make_problem

    p = make_problem(64 * world, E=8, topk=2, K=128, N=256, dtype=torch.bfloat16, seed=3, device="cuda")
    local = p.shard(rank, world)
    mine = slice(64 * rank, 64 * (rank + 1))
    pf = All2AllPrepareFinalize(mode="capacity", max_tokens_per_rank=64, check="deferred")
    kernel = ModularKernel(pf, TritonExperts(), trace_counts=False)
    hidden, ids, weights = p.hidden[mine].clone(), p.topk_ids[mine].clone(), p.topk_weights[mine].clone()

    def step():
        return kernel(hidden, local.w1, local.w2, weights, ids, expert_map=local.expert_map, global_num_experts=8)

    eager = step()  # the agreement, once
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    fresh = make_problem(64 * world, E=8, topk=2, K=128, N=256, dtype=torch.bfloat16, seed=4, device="cuda")
    other = dataclasses.replace(p, hidden=fresh.hidden, topk_ids=fresh.topk_ids, topk_weights=fresh.topk_weights)
    hidden.copy_(other.hidden[mine]), ids.copy_(other.topk_ids[mine]), weights.copy_(other.topk_weights[mine])
    graph.replay()
    torch.cuda.synchronize()
    pf.raise_if_failed()
    ref = other.reference(rows=mine)
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    return [f"captured: {err < 0.03}", f"eager differs from replay: {not torch.equal(eager, out)}"]


@pytest.mark.gpu
def test_the_whole_layer_is_captured_in_one_cuda_graph():
    results = launch(captured_layer, 1, backend="nccl", timeout_s=TIMEOUT)
    assert results == [["captured: True", "eager differs from replay: True"]], results
