"""moekit.testing: the tolerance table, expect_raises, make_problem and its oracle, experts_call, wall_ms."""

from __future__ import annotations

import time

import pytest
import torch

import moekit
from moekit.experts import TritonExperts
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.prepare_finalize.base import quantize_activations
from moekit.quant import FP8
from moekit.routing import contiguous_expert_map
from moekit.testing import (
    NORM_TOLERANCE,
    MoEProblem,
    Raised,
    assert_close,
    expect_raises,
    experts_call,
    make_problem,
    tolerance,
    wall_ms,
)
from moekit.types import ExpertPlacement, MoEWeights, ProblemSize, QuantScheme
from moekit.workspace import WorkspacePool

FP8_BLOCK = QuantScheme.FP8_BLOCK

# ---------------------------------------------------------------------------------------------
# assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, FP8])
def test_assert_close_passes_within_the_dtype_tolerance(dtype):
    atol, _ = tolerance(dtype)
    expected = torch.randn(64, 32) * 3
    scale = float(expected.abs().max())
    signs = torch.randint(0, 2, expected.shape) * 2 - 1
    assert_close(expected + signs * 0.1 * atol * scale, expected, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, FP8])
def test_assert_close_fails_beyond_the_dtype_tolerance(dtype):
    atol, rtol = tolerance(dtype)
    expected = torch.randn(64, 32) * 3
    actual = expected.clone()
    actual[5, 7] += 2 * (atol * float(expected.abs().max()) + rtol * float(expected[5, 7].abs()))
    with pytest.raises(AssertionError, match="Mismatched elements: 1 / 2048"):
        assert_close(actual, expected, dtype=dtype)


def test_atol_is_relative_to_the_largest_magnitude_or_to_scale():
    expected = torch.randn(16, 16) * 1e-3  # small outputs are held to the same relative standard
    actual = expected + 2e-3 * float(expected.abs().max())  # within bf16's 2e-2 of the max
    assert_close(actual, expected, dtype=torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_close(actual, expected, dtype=torch.bfloat16, scale=1e-6)
    assert_close(torch.randn(0, 4), torch.randn(0, 4), dtype=torch.float32)  # empty: nothing to compare


def test_fp8_is_also_held_to_a_norm_tolerance():
    expected = torch.randn(256, 64)
    scale = float(expected.abs().max())
    signs = (torch.randint(0, 2, expected.shape) * 2 - 1).float()
    atol, _ = tolerance(FP8)
    # Every element within fp8's elementwise tolerance, but all of them off by nearly that much.
    actual = expected + signs * 0.9 * atol * scale
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=0)
    with pytest.raises(AssertionError, match=r"relative error in norm .* > 0.04 \(torch.float8_e4m3fn\)"):
        assert_close(actual, expected, dtype=FP8)
    assert NORM_TOLERANCE == {FP8: 4e-2}
    assert_close(expected + signs * 0.01 * scale / 4, expected, dtype=FP8)  # small errors pass both


def test_assert_close_compares_on_the_cpu_in_fp32(device):
    expected = torch.randn(8, 8)
    assert_close(expected.to(device, torch.bfloat16), expected, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# expect_raises


def test_expect_raises_returns_the_error():
    with expect_raises(ValueError, match=r"bad \d+") as caught:
        raise ValueError("bad 42")
    assert isinstance(caught, Raised) and isinstance(caught.error, ValueError)
    assert caught.message == "bad 42"
    with expect_raises((KeyError, ValueError)) as caught:
        raise KeyError("k")
    assert isinstance(caught.error, KeyError)


def test_expect_raises_fails_when_nothing_is_raised():
    with pytest.raises(AssertionError, match="expected ValueError to be raised, but the block finished normally"):
        with expect_raises(ValueError):
            pass
    with pytest.raises(AssertionError, match="expected KeyError or IndexError to be raised"):
        with expect_raises((KeyError, IndexError)):
            pass


def test_expect_raises_fails_when_the_message_does_not_match():
    with pytest.raises(AssertionError, match=r"raised ValueError, but 'bug 1' is not in: bug 2") as info:
        with expect_raises(ValueError, match="bug 1"):
            raise ValueError("bug 2")
    assert isinstance(info.value.__cause__, ValueError)


def test_expect_raises_lets_other_errors_through():
    with pytest.raises(TypeError, match="other"):
        with expect_raises(ValueError):
            raise TypeError("other")


# ---------------------------------------------------------------------------------------------
# make_problem


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_make_problem_shapes_and_dtypes(dtype):
    p = make_problem(9, E=4, topk=3, K=64, N=96, dtype=dtype)
    assert isinstance(p, MoEProblem) and p.M == 9 and p.quant is QuantScheme.NONE and p.dtype == dtype
    assert p.hidden.shape == (9, 64) and p.hidden.dtype == dtype
    assert p.w1.shape == (4, 96, 64) and p.w2.shape == (4, 64, 48) and p.w1.dtype == p.w2.dtype == dtype
    assert p.topk_weights.shape == p.topk_ids.shape == (9, 3) and p.topk_weights.dtype == torch.float32
    assert p.topk_ids.dtype == torch.int32 and p.topk_ids.is_contiguous()
    assert p.w1_scale is None and p.w2_scale is None and p.expert_map is None and p.global_num_experts is None
    assert int(p.topk_ids.min()) >= 0 and int(p.topk_ids.max()) < 4
    assert all(len(set(row)) == 3 for row in p.topk_ids.tolist())  # distinct experts per token
    assert p.hidden.device.type == moekit.device.get_device().type


def test_make_problem_fp8_scales():
    p = make_problem(4, E=3, K=256, N=512, quant=FP8_BLOCK)
    assert p.w1.dtype == p.w2.dtype == FP8 and p.hidden.dtype == torch.bfloat16 and p.dtype == FP8
    assert p.w1_scale.shape == (3, 4, 2) and p.w2_scale.shape == (3, 2, 2)
    assert p.w1_scale.dtype == p.w2_scale.dtype == torch.float32 and bool((p.w1_scale > 0).all())
    MoEWeights(p.w1, p.w2, p.w1_scale, p.w2_scale).check(FP8_BLOCK)  # what the experts will ask
    w1, w2 = p.float_weights()
    assert w1.dtype == torch.float32 and w1.shape == (3, 512, 256) and w2.shape == (3, 256, 256)


def test_make_problem_is_seeded():
    a, b, c = make_problem(8, K=64, N=64), make_problem(8, K=64, N=64), make_problem(8, K=64, N=64, seed=1)
    for name in ("hidden", "w1", "w2", "topk_weights", "topk_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert not torch.equal(getattr(a, name), getattr(c, name)), name
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(make_problem(8, K=64, N=64).hidden, a.hidden)


def test_empty_every_puts_minus_one_in_every_nth_tokens_last_slot():
    p = make_problem(10, E=8, topk=3, K=64, N=64, empty_every=3)
    ids = p.topk_ids.cpu()
    assert ids[::3, -1].tolist() == [-1] * 4
    rest = torch.ones_like(ids, dtype=torch.bool)
    rest[::3, -1] = False
    assert bool((ids[rest] >= 0).all())
    assert make_problem(0, K=64, N=64, empty_every=3).topk_ids.shape == (0, 2)


@pytest.mark.parametrize("quant", [QuantScheme.NONE, FP8_BLOCK])
def test_make_problem_never_makes_all_zero_tensors(quant):
    p = make_problem(16, E=4, K=128, N=256, quant=quant)
    for name in ("hidden", "w1", "w2", "topk_weights"):
        t = getattr(p, name).float()
        assert bool((t != 0).any()) and t.abs().mean() > 1e-3, name
    assert bool((p.topk_weights > 0).all())
    torch.testing.assert_close(p.topk_weights.sum(1), torch.ones(16, device=p.topk_weights.device))


# ---------------------------------------------------------------------------------------------
# MoEProblem


def test_inputs_and_options():
    p = make_problem(4, K=64, N=64)
    assert p.inputs() == (p.hidden, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert p.options() == {"expert_map": None, "global_num_experts": None}
    f = make_problem(4, E=2, K=128, N=256, quant=FP8_BLOCK)
    opts = f.options()
    assert set(opts) == {"expert_map", "global_num_experts", "w1_scale", "w2_scale"}
    assert opts["w1_scale"] is f.w1_scale and opts["w2_scale"] is f.w2_scale


def test_reference_rows_and_unweighted():
    p = make_problem(12, E=4, topk=2, K=64, N=64, dtype=torch.float32)
    whole = p.reference()
    assert whole.shape == (12, 64) and whole.dtype == torch.float32
    torch.testing.assert_close(p.reference(rows=slice(3, 8)), whole[3:8])
    per_slot = p.reference(apply_weights=False)
    assert per_slot.shape == (12, 2, 64)
    torch.testing.assert_close((per_slot * p.topk_weights.unsqueeze(-1)).sum(1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quant", [QuantScheme.NONE, FP8_BLOCK], ids=["bf16", "fp8"])
def test_check_accepts_the_kernel_and_rejects_a_wrong_output(quant):
    p = make_problem(8, E=4, K=128, N=256, quant=quant)
    out = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=quant))(*p.inputs(), **p.options())
    p.check(out)
    wrong = out.clone()
    wrong[3] += out.float().abs().max().to(out.dtype)
    with pytest.raises(AssertionError):
        p.check(wrong)


def test_shard_takes_a_contiguous_block_of_experts():
    p = make_problem(6, E=8, K=128, N=256, quant=FP8_BLOCK)
    s = p.shard(1, 4)  # experts 2 and 3
    assert torch.equal(s.expert_map.cpu(), contiguous_expert_map(8, 4, 1))
    assert s.global_num_experts == 8 and s.w1.shape[0] == s.w2.shape[0] == 2
    assert torch.equal(s.w1.view(torch.uint8), p.w1[2:4].view(torch.uint8))
    assert torch.equal(s.w1_scale, p.w1_scale[2:4]) and torch.equal(s.w2_scale, p.w2_scale[2:4])
    assert s.hidden is p.hidden and s.topk_ids is p.topk_ids  # same tokens
    assert s.options()["expert_map"] is s.expert_map and s.options()["global_num_experts"] == 8


@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_summed_through_the_kernel_equal_the_reference(world_size):
    p = make_problem(16, E=8, topk=2, K=64, N=64, empty_every=5)
    total = torch.zeros(16, 64)
    for rank in range(world_size):
        s = p.shard(rank, world_size)
        kernel = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts())
        total += kernel(*s.inputs(), **s.options()).float().cpu()
    assert_close(total, p.reference(), dtype=torch.bfloat16)
    p.check(total)


# ---------------------------------------------------------------------------------------------
# experts_call


@pytest.mark.parametrize("quant", [QuantScheme.NONE, FP8_BLOCK], ids=["bf16", "fp8"])
def test_experts_call_sizes_and_shapes_come_from_the_tensors(quant):
    p = make_problem(7, E=4, topk=2, K=128, N=256, quant=quant)
    experts = TritonExperts(quant=quant)
    weights = MoEWeights(p.w1, p.w2, p.w1_scale, p.w2_scale)
    hidden, scale = p.hidden, None
    if quant is FP8_BLOCK:
        hidden, scale = quantize_activations(p.hidden, quant)
    call = experts_call(experts, hidden, p.topk_ids, weights, hidden_scale=scale)
    assert call.problem == ProblemSize(7, 256, 128, 2, 4, 4)
    assert call.shapes == experts.workspace_shapes(call.problem, act_dtype=hidden.dtype)
    assert tuple(call.output.shape) == call.shapes.output and call.output.dtype == torch.bfloat16
    assert call.placement == ExpertPlacement(4, 4) and call.hidden is hidden and call.hidden_scale is scale
    assert experts.apply(call) == "triton"
    assert_close(call.output, p.reference(apply_weights=False), dtype=p.dtype)


def test_experts_call_fill_placement_and_pool():
    p = make_problem(5, E=8, K=64, N=64)
    s = p.shard(0, 2)
    placement = ExpertPlacement(8, 4, s.expert_map)
    pool = WorkspacePool(p.hidden.device)
    call = experts_call(TritonExperts(), p.hidden, p.topk_ids, MoEWeights(s.w1, s.w2), placement=placement,
                        fill=float("nan"), pool=pool)  # fmt: skip
    assert call.problem == ProblemSize(5, 64, 64, 2, 8, 4) and call.expert_map is s.expert_map
    for t in (call.workspace13, call.workspace2, call.output):
        assert t.numel() and bool(t.isnan().all())
    assert pool.requests == 1 and pool.peak_bytes >= call.shapes.workspace_bytes
    call = experts_call(TritonExperts(), p.hidden, p.topk_ids, MoEWeights(s.w1, s.w2), placement=placement, fill=2.5)
    assert bool((call.output == 2.5).all())


# ---------------------------------------------------------------------------------------------
# wall_ms


def test_wall_ms_warms_up_once_then_takes_the_median():
    calls = []
    ms = wall_ms(lambda: calls.append(time.sleep(0.002)), repeats=5)
    assert len(calls) == 6 and ms >= 2.0
    calls.clear()
    assert wall_ms(lambda: calls.append(1)) > 0 and len(calls) == 4  # default: 3 repeats


def test_tolerance_knows_every_dtype_moekit_computes_in_and_names_the_others():
    from moekit.errors import InvalidInputError
    from moekit.testing import expect_raises, tolerance

    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        atol, rtol = tolerance(dtype)
        assert 0 < atol < 1 and 0 < rtol < 1
    with expect_raises(InvalidInputError, match="got torch.int32"):
        tolerance(torch.int32)
