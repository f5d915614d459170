"""moekit.experts.base: ``carve`` and what every experts class inherits from ``Experts``.

The concrete classes are moekit's own (TritonExperts, DeepGemmExperts); nothing here runs a GEMM.
"""

from __future__ import annotations

import pytest
import torch

from moekit.errors import InvalidInputError, QuantizationError, WorkspaceShapeError
from moekit.experts import DeepGemmExperts, Experts, TritonExperts
from moekit.experts.base import carve
from moekit.quant import FP8
from moekit.testing import expect_raises, make_problem
from moekit.types import MoEWeights, ProblemSize, QuantScheme


def sizes_of(p) -> ProblemSize:
    E, N, K = p.w1.shape
    return ProblemSize(p.M, N, K, p.topk_ids.shape[1], E, E)


def weights_of(p) -> MoEWeights:
    return MoEWeights(p.w1, p.w2, p.w1_scale, p.w2_scale)


# ---------------------------------------------------------------------------------------------
# carve


def test_carve_is_a_prefix_view():
    buffer = torch.randn(100)
    view = carve(buffer, (3, 4))
    assert view.shape == (3, 4) and view.is_contiguous()
    assert torch.equal(view, buffer[:12].view(3, 4))
    view.fill_(7.0)  # a view, not a copy: the buffer sees the write, and only its first 12 elements
    assert bool((buffer[:12] == 7.0).all()) and not bool((buffer[12:] == 7.0).any())


def test_carve_reinterprets_the_bytes():
    buffer = torch.randn(64, dtype=torch.bfloat16)
    raw = carve(buffer, (40,), dtype=torch.uint8)
    assert raw.dtype == torch.uint8 and torch.equal(raw, buffer.view(torch.uint8)[:40])
    fp8 = carve(buffer, (8, 16), dtype=FP8)
    assert fp8.dtype == FP8 and torch.equal(fp8.view(torch.uint8), buffer.view(torch.uint8)[:128].view(8, 16))
    assert carve(buffer, (32,), dtype=torch.float32).numel() == 32  # 64 bf16 = 128 bytes = 32 floats
    with expect_raises(WorkspaceShapeError, match="32 torch.float32 elements, 33 needed"):
        carve(buffer, (33,), dtype=torch.float32)


def test_carve_names_the_sizes_when_too_small():
    with expect_raises(WorkspaceShapeError, match=r"holds 10 torch.float32 elements, 12 needed for \(3, 4\)"):
        carve(torch.randn(10), (3, 4))
    with expect_raises(WorkspaceShapeError, match="holds 0"):
        carve(torch.randn(0), (1,), dtype=FP8)
    assert carve(torch.randn(0), (0, 5), dtype=FP8).shape == (0, 5)


def test_carve_fits_any_larger_buffer_whatever_its_declared_shape():
    # Why a smaller Triton chunk ran in DeepGEMM's larger buffers before PR #20392.
    buffer = torch.randn(5, 7, 3)  # 105 elements
    view = carve(buffer, (4, 20))
    assert torch.equal(view, buffer.reshape(-1)[:80].view(4, 20))
    assert view.data_ptr() == buffer.data_ptr()
    assert carve(buffer, (105,)).shape == (105,)
    with expect_raises(WorkspaceShapeError, match="105 torch.float32 elements, 106 needed"):
        carve(buffer, (2, 53))


# ---------------------------------------------------------------------------------------------
# Experts


def test_a2_scale_on_unquantized_experts_is_refused():
    p = make_problem(6, E=4, K=64, N=64, dtype=torch.float32)
    experts = TritonExperts()
    experts.check(sizes_of(p), weights_of(p))  # no a2_scale: fine
    with expect_raises(QuantizationError, match="unquantized"):
        experts.check(sizes_of(p), weights_of(p), a2_scale=torch.rand(1) + 0.5)


def test_a2_scale_on_fp8_experts_is_one_or_one_per_token():
    M = 5
    p = make_problem(M, E=4, K=128, N=256, quant=QuantScheme.FP8_BLOCK)
    experts, sizes, weights = TritonExperts(quant=QuantScheme.FP8_BLOCK), sizes_of(p), weights_of(p)
    dev = p.w1.device
    experts.check(sizes, weights, a2_scale=torch.rand(1, device=dev) + 0.5)
    experts.check(sizes, weights, a2_scale=torch.rand(M, device=dev) + 0.5)
    experts.check(sizes, weights, a2_scale=torch.rand(M, 1, device=dev) + 0.5)
    for shape in ((2,), (M + 1,), (1, M), (M, 2)):  # a [1, M] scale would be sliced along the wrong axis
        with expect_raises(QuantizationError, match=rf"per tensor\) or one per token, \[M={M}\] or \[M, 1\], got "
                                                    rf"\({', '.join(map(str, shape))},?\)"):  # fmt: skip
            experts.check(sizes, weights, a2_scale=torch.rand(*shape, device=dev) + 0.5)
    with expect_raises(QuantizationError, match="float tensor, got Tensor"):
        experts.check(sizes, weights, a2_scale=torch.randint(1, 4, (1,), device=dev))
    with expect_raises(QuantizationError, match="float tensor, got float"):
        experts.check(sizes, weights, a2_scale=0.5)


def test_weights_are_checked_against_quant():
    fp8 = make_problem(4, E=4, K=128, N=256, quant=QuantScheme.FP8_BLOCK)
    bf16 = make_problem(4, E=4, K=128, N=256)
    with expect_raises(QuantizationError, match="quant=QuantScheme.NONE"):
        TritonExperts().check(sizes_of(fp8), weights_of(fp8))
    with expect_raises(QuantizationError, match="float8_e4m3fn"):
        TritonExperts(quant=QuantScheme.FP8_BLOCK).check(sizes_of(bf16), weights_of(bf16))
    with expect_raises(QuantizationError, match="w1_scale and w2_scale"):
        DeepGemmExperts().check(sizes_of(fp8), MoEWeights(fp8.w1, fp8.w2))


def test_compute_dtype_is_bf16_behind_fp8():
    for experts in (TritonExperts(quant=QuantScheme.FP8_BLOCK), DeepGemmExperts()):
        assert experts.compute_dtype(FP8) == torch.bfloat16
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert TritonExperts().compute_dtype(dtype) == dtype


def test_why_is_empty_unless_a_class_falls_back():
    p = make_problem(4, E=4, K=128, N=256, quant=QuantScheme.FP8_BLOCK)
    assert TritonExperts().why(sizes_of(p)) == ""
    assert TritonExperts().backend_for(sizes_of(p)) == "triton"
    assert "backend='triton'" in DeepGemmExperts(backend="triton").why(sizes_of(p))  # an override says why


def test_quant_must_be_a_scheme_and_names_show_in_repr():
    with expect_raises(InvalidInputError, match="moekit.QuantScheme"):
        TritonExperts(quant="fp8_block")
    experts = TritonExperts(quant=QuantScheme.FP8_BLOCK)
    assert isinstance(experts, Experts) and experts.name == "TritonExperts" and experts.quant is QuantScheme.FP8_BLOCK
    assert "fp8_block" in repr(experts)
    with pytest.raises(TypeError):
        Experts()  # abstract: workspace_shapes and apply


@pytest.mark.parametrize("name", ["w1_scale", "w2_scale", "a2_scale"])
def test_scales_must_be_tensors_on_the_weights_device(name):
    # Issue 25, item 15: a list raised AttributeError ('list' object has no attribute 'shape'), a scale
    # on another device (meta here; another GPU there) a raw error from deep inside.
    p = make_problem(5, E=4, K=128, N=256, quant=QuantScheme.FP8_BLOCK)
    given = {"w1_scale": p.w1_scale, "w2_scale": p.w2_scale, "a2_scale": torch.rand(1, device=p.w1.device) + 0.5}
    for experts in (TritonExperts(quant=QuantScheme.FP8_BLOCK), DeepGemmExperts(backend="triton")):
        as_list = {**given, name: given[name].tolist()}
        with expect_raises(QuantizationError, match=f"{name} must be a float tensor, got list"):
            experts.check(sizes_of(p), MoEWeights(p.w1, p.w2, as_list["w1_scale"], as_list["w2_scale"]),
                          a2_scale=as_list["a2_scale"])  # fmt: skip
        elsewhere = {**given, name: given[name].to("meta")}
        where = rf"{name} must be on the weights' device \({p.w1.device}\), got meta"
        with expect_raises(InvalidInputError, match=where):
            experts.check(sizes_of(p), MoEWeights(p.w1, p.w2, elsewhere["w1_scale"], elsewhere["w2_scale"]),
                          a2_scale=elsewhere["a2_scale"])  # fmt: skip
