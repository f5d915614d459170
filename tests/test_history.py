"""moekit.history: every replay fails as upstream's code did, for upstream's reason, and every fix
(moekit's default) holds. Small sizes: the interpreter is slow, and fp8 blocks need K = 128, N = 256."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moekit
from moekit import history
from moekit.errors import ChunkSizeError, InvalidInputError, MoekitError, QuantizationError
from moekit.experts import DeepGemmExperts, TritonExperts
from moekit.prepare_finalize import All2AllPrepareFinalize, NoEPPrepareFinalize
from moekit.routing import contiguous_expert_map
from moekit.testing import assert_close, expect_raises, make_problem
from moekit.types import WorkspaceShapes
from moekit.workspace import WorkspacePool

FP8 = moekit.QuantScheme.FP8_BLOCK


def one_rank(E: int, device) -> dict:
    return dict(expert_map=contiguous_expert_map(E, 1, 0, device=device), global_num_experts=E)


class UnchunkedTritonExperts(TritonExperts):
    supports_chunking = False


# --- #26523 / #26528: M = 0 and cdiv(0, 0) -------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("C", [1, 16, history.UPSTREAM_CHUNK_SIZE])
def test_a_rank_with_no_tokens_divides_by_zero_before_26528_and_not_after(C, device):
    p = make_problem(0, E=4, topk=2, K=64, N=128, dtype=torch.float32, seed=C)
    replay = moekit.ModularKernel(All2AllPrepareFinalize(timeout_s=60), TritonExperts(), chunk_size=C)
    replay.planner = history.TokenPlannerBefore26528(C)
    fixed = moekit.ModularKernel(All2AllPrepareFinalize(timeout_s=60), TritonExperts(), chunk_size=C)
    with history.one_rank_group():
        with expect_raises(ZeroDivisionError, match="integer division or modulo by zero") as zero:
            replay(*p.inputs(), **one_rank(4, device))
        out = fixed(*p.inputs(), **one_rank(4, device))
    assert not isinstance(zero.error, MoekitError), "Python's own error, not one of moekit's"
    assert replay.planner.num_chunks is None
    assert out.shape == (0, 64) and len(fixed.last_trace) == 0
    assert_close(out, p.reference(), dtype=torch.float32)


@pytest.mark.interpreter
def test_experts_that_do_not_chunk_got_no_chunk_at_m_zero(device):
    # upstream's max(M, 1) for them: cdiv(0, 1) = 0, no error.
    p = make_problem(0, E=4, topk=1, K=64, N=128, dtype=torch.float32, seed=1)
    kernel = moekit.ModularKernel(All2AllPrepareFinalize(timeout_s=60), UnchunkedTritonExperts(), chunk_size=8)
    kernel.planner = history.TokenPlannerBefore26528(8)
    with history.one_rank_group():
        out = kernel(*p.inputs(), **one_rank(4, device))
    assert kernel.planner.num_chunks == 0 and out.shape == (0, 64)


@pytest.mark.parametrize("M, C", [(1, 1), (5, 2), (16, 16), (17, 16), (9, 64)])
def test_the_chunk_count_before_26528_agrees_with_the_plan_when_m_is_positive(M, C):
    p = make_problem(M, E=4, topk=2, K=64, N=128, dtype=torch.float32, seed=M)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=C)
    kernel.planner = history.TokenPlannerBefore26528(C)
    p.check(kernel(*p.inputs()))
    assert kernel.planner.num_chunks == len(kernel.last_trace) == len(moekit.chunk_ranges(M, C))


# --- #24812 -> #28728: the (e, e) slice of a2_scale ---------------------------------------------


def test_the_slicer_before_28728_empties_per_token_scales_and_keeps_per_tensor_ones():
    per_token, per_tensor = torch.rand(10) + 0.5, torch.rand(1) + 0.5
    for s, e in [(0, 4), (4, 8), (8, 10)]:
        assert history.TokenPlannerBefore28728.slice_a2(per_token, s, e).numel() == 0
        assert moekit.plan.TokenPlanner.slice_a2(per_token, s, e).tolist() == per_token[s:e].tolist()
        assert history.TokenPlannerBefore28728.slice_a2(per_tensor, s, e) is per_tensor
    assert history.TokenPlannerBefore28728.slice_a2(None, 0, 4) is None


def fp8_layer(M, *, E=4, topk=2, seed=0):
    p = make_problem(M, E=E, topk=topk, K=128, N=256, quant=FP8, seed=seed)
    a2 = (torch.rand(M, generator=torch.Generator().manual_seed(seed)) + 1.0).to(p.hidden.device) * 0.02
    return p, a2


def test_empty_a2_scales_are_refused_by_the_guard_and_the_fix_matches_the_reference():
    p, a2 = fp8_layer(7, seed=3)
    replay = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=FP8), chunk_size=3)
    replay.planner = history.TokenPlannerBefore28728(3)
    with expect_raises(QuantizationError, match="handed 0 a2 scales for 3 tokens") as refused:
        replay(*p.inputs(), **p.options(), a2_scale=a2)
    assert "#28728" in refused.message and "moekit's guard" in refused.message
    assert len(replay.last_trace) == 0, "refused before any chunk's experts ran"
    fixed = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=FP8), chunk_size=3)
    assert_close(fixed(*p.inputs(), **p.options(), a2_scale=a2), p.reference(), dtype=torch.float8_e4m3fn)


def test_one_chunk_or_a_per_tensor_scale_never_meets_the_misprint():
    p, a2 = fp8_layer(5, seed=4)
    fixed = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=FP8), chunk_size=2)
    for chunk_size, scale in [(8, a2), (2, a2[:1])]:  # one chunk: the whole scale; per tensor: passes whole
        replay = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=FP8), chunk_size=chunk_size)
        replay.planner = history.TokenPlannerBefore28728(chunk_size)
        out = replay(*p.inputs(), **p.options(), a2_scale=scale)
        assert_close(out, fixed(*p.inputs(), **p.options(), a2_scale=scale), dtype=torch.bfloat16)


# --- #27426 / #27532 / #30899: the counted reservation and the locked workspace ------------------


def shapes(rows13: int, rows2: int, width: int = 64) -> WorkspaceShapes:
    return WorkspaceShapes((rows13, width), (rows2, width), (1, 1, width), torch.bfloat16)


def test_pool_bytes_is_what_a_workspace_pool_allocates():
    for s in (shapes(3, 5), shapes(128, 131, 256), shapes(1, 0)):
        pool = WorkspacePool("cpu")
        pool.take(s)
        assert pool.peak_bytes == history.pool_bytes(s)


def test_a_locked_pool_hands_out_what_it_holds_and_refuses_to_grow():
    pool = history.LockablePool("cpu")
    big, small, bigger = shapes(64, 64), shapes(8, 8), shapes(65, 64)
    pool.take(big)
    pool.take(bigger)  # unlocked: it grows
    pool.lock_workspace()
    held = pool.capacity_bytes
    pool.take(small)
    pool.take(bigger)
    with expect_raises(history.WorkspaceLockedError, match=f"locked at {held} bytes") as refused:
        pool.take(shapes(200, 200))
    assert str(history.pool_bytes(shapes(200, 200))) in refused.message
    assert pool.capacity_bytes == held and pool.grows == 2


def rank_kernel(C, *, with_counts):
    pool = history.LockablePool(moekit.device.get_device())
    kernel = moekit.ModularKernel(All2AllPrepareFinalize(timeout_s=60), DeepGemmExperts(), chunk_size=C, pool=pool)
    kernel.workspaces = history.ProfileRunReservation(pool, C, with_counts=with_counts)
    return kernel, pool


@pytest.mark.interpreter
def test_a_reservation_sized_from_the_profile_runs_counts_overflows_once_locked(device):
    E, topk, C = 8, 2, 8
    dummy = make_problem(C, E=E, topk=topk, K=128, N=256, quant=FP8, seed=11)
    dummy.topk_ids[:] = torch.arange(topk, dtype=dummy.topk_ids.dtype, device=device)  # alike dummy tokens
    served = make_problem(12, E=E, topk=topk, K=128, N=256, quant=FP8, seed=12)

    def opts(p):
        return dict(w1_scale=p.w1_scale, w2_scale=p.w2_scale, **one_rank(E, device))

    fixed, fixed_pool = rank_kernel(C, with_counts=False)
    replay, replay_pool = rank_kernel(C, with_counts=True)
    with history.one_rank_group():
        for kernel, pool in ((fixed, fixed_pool), (replay, replay_pool)):
            dummy.check(kernel(*dummy.inputs(), **opts(dummy)))  # the profile run
            pool.lock_workspace()
        served.check(fixed(*served.inputs(), **opts(served)))
        needs = [history.pool_bytes(c.shapes) for c in fixed.last_trace]
        assert max(needs) > replay_pool.capacity_bytes, "the seeded served batch is routed more widely"
        with expect_raises(history.WorkspaceLockedError, match="a locked workspace does not grow"):
            replay(*served.inputs(), **opts(served))
    first = next(i for i, need in enumerate(needs) if need > replay_pool.capacity_bytes)
    assert len(replay.last_trace) == first and all(c.completed for c in replay.last_trace)
    # counted: topk experts of C rows each, padded to 128; worst case: C rows over min(E, C) experts
    assert replay.workspaces.reserved.workspace13[0] == topk * 128
    assert fixed.workspaces.reserved.workspace13[0] == -(-(C + 127 * min(E, C)) // 128) * 128
    received = moekit.ProblemSize(M=C, N=256, K=128, topk=1, global_num_experts=E, num_local_experts=E)
    assert fixed.workspaces.reserved == DeepGemmExperts().workspace_shapes(received, act_dtype=torch.float8_e4m3fn)


def test_the_reservation_policy_reserves_once_and_hands_each_chunk_its_own_shapes():
    p = make_problem(20, E=4, topk=2, K=64, N=128, dtype=torch.float32, seed=5)
    pool = history.LockablePool(p.hidden.device)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=8, pool=pool)
    kernel.workspaces = history.ProfileRunReservation(pool, 8, with_counts=True)
    p.check(kernel(*p.inputs()))
    reserved = kernel.workspaces.reserved
    p.check(kernel(*p.inputs()))
    assert kernel.workspaces.reserved is reserved and reserved.workspace13 == (8, 2, 128)
    assert [c.shapes for c in kernel.last_trace] == [c.needed for c in kernel.last_trace]
    assert kernel.workspace_policy == "per_chunk"


# --- #29935: the kill switch, read and ignored --------------------------------------------------


@pytest.mark.parametrize("M, C", [(9, 4), (4, 4), (3, 8)])
def test_the_switch_before_29935_is_read_and_ignored_and_chunk_size_none_is_honoured(M, C):
    p = make_problem(M, E=4, topk=2, K=64, N=128, dtype=torch.float32, seed=M + C)
    replay = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=C)
    replay.planner = history.TokenPlannerBefore29935(C, enable_chunking=False)
    p.check(replay(*p.inputs()))
    assert replay.planner.enable_chunking(replay.experts) is False
    assert [(c.start, c.end) for c in replay.last_trace] == [(c.start, c.end) for c in moekit.chunk_ranges(M, C)]
    off = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts())
    p.check(off(*p.inputs()))
    assert len(off.last_trace) == 1 and replay.last_trace.weight_bytes >= off.last_trace.weight_bytes
    on = history.TokenPlannerBefore29935(C)
    assert on.enable_chunking(replay.experts) and not on.enable_chunking(UnchunkedTritonExperts())


# --- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [history.TokenPlannerBefore26528, history.TokenPlannerBefore29935])
@pytest.mark.parametrize("bad", [None, 0, -3, 2.0, True])
def test_upstream_planners_need_a_chunk_size(cls, bad):
    with expect_raises(ChunkSizeError, match="VLLM_FUSED_MOE_CHUNK_SIZE"):
        cls(bad)
    assert cls().chunk_size == 32768


def test_the_switch_is_a_bool_and_one_rank_group_is_not_nested():
    with expect_raises(InvalidInputError, match="enable_chunking"):
        history.TokenPlannerBefore29935(8, enable_chunking="0")
    with history.one_rank_group():
        assert dist.get_world_size() == 1
        with expect_raises(InvalidInputError, match="already initialized"):
            with history.one_rank_group():
                pass
    assert not dist.is_initialized()
