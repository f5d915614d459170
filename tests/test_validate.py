"""moekit.validate: each check at the public boundary, and the named error it raises."""

from __future__ import annotations

import pytest
import torch

from moekit.errors import ChunkSizeError, InvalidIdsError, InvalidInputError
from moekit.quant import FP8
from moekit.routing import contiguous_expert_map
from moekit.testing import expect_raises, make_problem
from moekit.types import ExpertPlacement, QuantScheme
from moekit.validate import (
    check_expert_map,
    check_float,
    check_id_range,
    check_ids,
    check_moe_inputs,
    check_placement,
    check_positive_int,
)

CPU = torch.device("cpu")


def ids(M: int = 6, topk: int = 2, E: int = 8, dtype=torch.int32) -> torch.Tensor:
    return torch.randint(0, E, (M, topk)).to(dtype)


# ---------------------------------------------------------------------------------------------
# check_ids


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_signed_ids_pass(dtype):
    check_ids(ids(dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_ids_are_named(dtype):
    with expect_raises(InvalidIdsError, match=f"signed integer tensor .*got unsigned {dtype}"):
        check_ids(ids(dtype=torch.int64).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_non_integer_ids_are_named(dtype):
    with expect_raises(InvalidIdsError, match=f"got non-integer {dtype}"):
        check_ids(ids().to(dtype))


def test_non_contiguous_ids_are_named():
    with expect_raises(InvalidIdsError, match=r"must be contiguous \(got strides \(1, 2\) for shape \(2, 4\)\)"):
        check_ids(ids(4, 2).t())
    check_ids(ids(4, 2).t().contiguous())


def test_ids_rank():
    with expect_raises(InvalidIdsError, match=r"topk_ids must be 2-D \[M, topk\], got shape \(12,\)"):
        check_ids(ids().flatten())
    with expect_raises(InvalidIdsError, match=r"expert_map must be 1-D \[global_num_experts\], got shape \(2, 4\)"):
        check_ids(ids(2, 4), name="expert_map", rank=1)
    check_ids(ids().view(2, 3, 2), rank=None)  # any rank


def test_ids_must_be_a_tensor():
    with expect_raises(InvalidIdsError, match="topk_ids must be a torch.Tensor, got list"):
        check_ids([[0, 1]])


# ---------------------------------------------------------------------------------------------
# check_expert_map


def test_expert_map_is_checked_as_ids_on_the_ids_device():
    check_expert_map(None, device=CPU)
    check_expert_map(contiguous_expert_map(8, 2, 1), device=CPU)
    with expect_raises(InvalidIdsError, match="expert_map is on meta, topk_ids on cpu"):
        check_expert_map(torch.empty(8, dtype=torch.int32, device="meta"), device=CPU)
    with expect_raises(InvalidIdsError, match="expert_map must be 1-D"):
        check_expert_map(contiguous_expert_map(8, 2, 1).view(2, 4), device=CPU)
    with expect_raises(InvalidIdsError, match="expert_map must be a signed integer tensor"):
        check_expert_map(contiguous_expert_map(8, 2, 1).float(), device=CPU)


# ---------------------------------------------------------------------------------------------
# check_id_range


def test_ids_in_range_and_empty_slots_pass():
    t = ids(E=8)
    t[0, 1] = -1
    t[1, 0] = 7
    check_id_range(t, 8)
    check_id_range(torch.full((3, 2), -1, dtype=torch.int32), 8)
    check_id_range(torch.empty(0, 2, dtype=torch.int32), 8)


@pytest.mark.parametrize("bad, low, high", [(-2, -2, 7), (8, 0, 8), (100, 0, 100)])
def test_ids_out_of_range_raise_on_the_cpu(bad, low, high):
    t = ids(E=8)
    t[:, 0] = torch.arange(t.shape[0]) % 8
    t[2, 1] = bad
    with expect_raises(InvalidIdsError, match=rf"\[0, global_num_experts=8\), got values in \[{low}, {high}\]"):
        check_id_range(t, 8)


def test_ids_off_the_cpu_are_not_synced_for():
    check_id_range(torch.full((3, 2), 99, dtype=torch.int32, device="meta"), 8)  # no host sync: no check


# ---------------------------------------------------------------------------------------------
# check_moe_inputs and check_float


def inputs(**kw):
    p = make_problem(6, E=4, topk=2, K=64, N=64, dtype=torch.float32, device="cpu")
    args = dict(hidden=p.hidden, w1=p.w1, w2=p.w2, topk_weights=p.topk_weights, topk_ids=p.topk_ids)
    return {**args, **kw}


def test_a_consistent_call_passes():
    check_moe_inputs(**inputs())
    p = make_problem(6, E=4, K=128, N=256, quant=QuantScheme.FP8_BLOCK)
    check_moe_inputs(p.hidden, p.w1, p.w2, p.topk_weights, p.topk_ids)  # fp8 weights, bf16 activations


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden=torch.randn(6, 64, 1)), r"hidden must be 2-D, got torch.float32 \(6, 64, 1\)"),
        (dict(w1=torch.randn(4, 64, 32)), r"w1 must be \[E, N, K=64\]"),
        (dict(w1=torch.randn(4, 63, 64)), "even N > 0"),
        (dict(w1=torch.randn(0, 64, 64), w2=torch.randn(0, 64, 32)), "at least one expert"),
        (dict(w2=torch.randn(4, 64, 64)), r"w2 must be \[E, K, N/2\] = \(4, 64, 32\), got \(4, 64, 64\)"),
        (dict(w2=torch.randn(3, 64, 32)), r"w2 must be \[E, K, N/2\] = \(4, 64, 32\)"),
        (dict(topk_weights=torch.rand(6, 3)), r"both be \[M=6, topk > 0\], got \(6, 2\) and \(6, 3\)"),
        (dict(topk_ids=torch.randint(0, 4, (5, 2), dtype=torch.int32), topk_weights=torch.rand(5, 2)), "M=6"),
        (dict(topk_ids=torch.zeros(6, 0, dtype=torch.int32), topk_weights=torch.rand(6, 0)), "topk > 0"),
    ],
)
def test_shape_mismatches_are_named(change, message):
    with expect_raises(InvalidInputError, match=message):
        check_moe_inputs(**inputs(**change))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden=torch.randn(6, 64).to(torch.bfloat16)), r"unquantized weights must have hidden's dtype"),
        (dict(w2=torch.randn(4, 64, 32).to(torch.float16)), "w1 and w2 must share a dtype"),
        (dict(hidden=torch.randn(6, 64).to(FP8)), "hidden must be a float tensor"),
        (dict(hidden=torch.randint(0, 9, (6, 64))), "hidden must be a float tensor, got torch.int64"),
        (dict(topk_weights=torch.randint(1, 9, (6, 2))), "topk_weights must be a float tensor"),
        (dict(topk_ids=torch.rand(6, 2)), "non-integer"),
    ],
)
def test_dtype_mismatches_are_named(change, message):
    with expect_raises((InvalidInputError, InvalidIdsError), match=message):
        check_moe_inputs(**inputs(**change))


def test_a_tensor_on_another_device_is_named():
    with expect_raises(InvalidInputError, match="all tensors must be on one device, got hidden on cpu, .*w2 on meta"):
        check_moe_inputs(**inputs(w2=torch.empty(4, 64, 32, device="meta")))


def test_inputs_that_would_need_a_gradient_are_named():
    with expect_raises(InvalidInputError, match="inference-only.*torch.no_grad"):
        check_moe_inputs(**inputs(hidden=torch.randn(6, 64, requires_grad=True)))
    with torch.no_grad():
        check_moe_inputs(**inputs(hidden=torch.randn(6, 64, requires_grad=True)))


def test_check_float():
    check_float(torch.randn(2, 3), "x", dims=2)
    check_float(torch.randn(2, 3).to(FP8), "w", dims=2, allow_fp8=True)
    with expect_raises(InvalidInputError, match="x must be a torch.Tensor, got ndarray"):
        check_float(torch.randn(2, 3).numpy(), "x", dims=2)
    with expect_raises(InvalidInputError, match=r"x must be 3-D, got torch.float32 \(2, 3\) on cpu"):
        check_float(torch.randn(2, 3), "x", dims=3)
    with expect_raises(InvalidInputError, match="w must be a float tensor"):
        check_float(torch.randn(2, 3).to(FP8), "w", dims=2)


# ---------------------------------------------------------------------------------------------
# check_placement


def test_global_experts_default_to_the_map_else_the_local_ones():
    w1 = torch.randn(4, 64, 64)
    assert check_placement(w1, None, None, CPU) == ExpertPlacement(4, 4, None)
    emap = contiguous_expert_map(8, 2, 1)
    placement = check_placement(w1, emap, None, CPU)
    assert (placement.global_num_experts, placement.num_local_experts) == (8, 4) and placement.expert_map is emap
    assert check_placement(w1, None, 16, CPU).global_num_experts == 16  # a map is not needed to say E_global


def test_placement_mismatches_are_named():
    w1, emap = torch.randn(4, 64, 64), contiguous_expert_map(8, 2, 1)
    with expect_raises(InvalidInputError, match="expert_map has 8 entries but global_num_experts=6"):
        check_placement(w1, emap, 6, CPU)
    with expect_raises(InvalidInputError, match=r"global_num_experts=2 < local experts 4 \(w1 holds 4\)"):
        check_placement(w1, None, 2, CPU)
    for bad in (0, -8, True, 8.0):
        with expect_raises(InvalidInputError, match=f"global_num_experts must be a positive int, got {bad!r}"):
            check_placement(w1, None, bad, CPU)
    with expect_raises(InvalidIdsError, match="expert_map is on meta"):
        check_placement(w1, torch.empty(8, dtype=torch.int32, device="meta"), None, CPU)


# ---------------------------------------------------------------------------------------------
# check_positive_int


def test_check_positive_int():
    assert check_positive_int(3, "n") == 3
    assert check_positive_int(0, "n", allow_zero=True) == 0
    for bad in (True, False, 1.0, 2.5, -1, 0, None, "4"):
        with expect_raises(InvalidInputError, match=f"n must be a positive int, got {bad!r}"):
            check_positive_int(bad, "n")
    with expect_raises(InvalidInputError, match="a non-negative int, got -1"):
        check_positive_int(-1, "n", allow_zero=True)
    with expect_raises(ChunkSizeError, match="chunk_size must be a positive int"):
        check_positive_int(0, "chunk_size", error=ChunkSizeError)


def _bool_options():
    """Every bool option of a public constructor or function outside the kernels: what a string flag
    must not switch on (issue 25, item 14)."""
    import moekit.ep
    import moekit.quant
    import moekit.workbook
    from moekit.experts import DeepGemmExperts, TritonOrDeepGemmExperts
    from moekit.prepare_finalize import NoEPPrepareFinalize
    from moekit.viz.chunks import plot_counts_heatmap

    x = torch.randn(2, 128)
    return {
        "return_counts": lambda v: NoEPPrepareFinalize(return_counts=v),
        "flat_output": lambda v: DeepGemmExperts(backend="triton", flat_output=v),
        "TritonOrDeepGemm flat_output": lambda v: TritonOrDeepGemmExperts(quant=QuantScheme.NONE, flat_output=v),
        "column_major": lambda v: moekit.quant.quantize_fp8_per_token_group(x, column_major=v),
        "strict": lambda v: moekit.workbook.check("chunk_plan", strict=v),
        "annotate": lambda v: plot_counts_heatmap(torch.ones(2, 2), annotate=v),
        "gather": lambda v: moekit.ep.run_rank(0, 1, moekit.ep.EPConfig(Ms=(2,)), gather=v),
    }


@pytest.mark.parametrize("option", ["return_counts", "flat_output", "TritonOrDeepGemm flat_output", "column_major",
                                    "strict", "annotate", "gather"])  # fmt: skip
@pytest.mark.parametrize("value", ["no", 1, None])
def test_bool_options_refuse_anything_but_a_bool(option, value):
    if option == "annotate" and value is None:
        pytest.skip("annotate=None means: when the heatmap is small")
    name = option.split()[-1]
    with expect_raises(InvalidInputError, match=rf"{name} must be True or False, got {value!r}"):
        _bool_options()[option](value)


def test_an_absurd_expert_count_is_named():
    from moekit.validate import MAX_EXPERTS, check_num_experts

    assert check_num_experts(MAX_EXPERTS, "E") == MAX_EXPERTS
    for bad in (2**40, MAX_EXPERTS + 1):
        with expect_raises(InvalidInputError, match=rf"num_local_experts must be at most {MAX_EXPERTS} .*got {bad}"):
            check_num_experts(bad, "num_local_experts")
    with expect_raises(InvalidInputError, match="positive int"):
        check_num_experts("8", "num_local_experts")
    p = make_problem(4, E=4, K=32, N=64, dtype=torch.float32)
    with expect_raises(InvalidInputError, match=r"global_num_experts must be at most"):  # no map: the fast path
        check_placement(p.w1, None, 2**40, p.w1.device)
    emap = torch.full((8,), -1, device=p.w1.device)
    with expect_raises(InvalidInputError, match=r"global_num_experts must be at most"):
        check_placement(p.w1, emap, 2**40, p.w1.device)


@pytest.mark.parametrize("bad", [-2, -(2**31), 4, 2**32 + 1])
def test_map_values_other_than_minus_one_or_a_local_id_are_named(bad):
    from moekit.validate import check_map_values

    emap = torch.tensor([-1, 0, 3, 1, -1, 2], dtype=torch.int64)
    check_map_values(emap, 4)  # -1 and local ids in [0, 4): fine
    emap[4] = bad
    with expect_raises(InvalidIdsError, match=rf"got \[{bad}\] at global ids \[4\]"):
        check_map_values(emap, 4)
