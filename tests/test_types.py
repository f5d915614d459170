import pytest
import torch

from moekit.errors import InvalidInputError, QuantizationError, WorkspaceShapeError
from moekit.quant import quantize_fp8_block
from moekit.types import ExpertTokensMetadata, MoEWeights, ProblemSize, QuantScheme, WorkspaceShapes


def test_problem_size_validates():
    p = ProblemSize(5, 64, 32, 2, 8, 4)
    assert p.with_M(1).M == 1 and p.with_M(1).N == 64
    for bad in [dict(M=-1), dict(N=63), dict(topk=0), dict(num_local_experts=9), dict(K=2.0)]:
        args = dict(M=5, N=64, K=32, topk=2, global_num_experts=8, num_local_experts=4) | bad
        with pytest.raises(InvalidInputError):
            ProblemSize(**args)


def test_workspace_shapes_validate_and_count_bytes():
    s = WorkspaceShapes([2, 3], (4,), (1, 2), torch.bfloat16)
    assert s.workspace13 == (2, 3) and s.workspace_bytes == (6 + 4) * 2
    with pytest.raises(WorkspaceShapeError):
        WorkspaceShapes((2, -1), (4,), (1,), torch.float32)
    with pytest.raises(InvalidInputError):
        WorkspaceShapes((2,), (4,), (1,), "bf16")


def test_metadata_requires_int32_and_matching_cpu_copy():
    ExpertTokensMetadata(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(InvalidInputError):
        ExpertTokensMetadata(torch.tensor([1, 2]))
    with pytest.raises(InvalidInputError):
        ExpertTokensMetadata(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))


def test_weights_check_against_scheme():
    w1 = torch.randn(2, 256, 128)
    w2 = torch.randn(2, 128, 128)
    MoEWeights(w1, w2).check(QuantScheme.NONE)
    with pytest.raises(QuantizationError, match="float8"):
        MoEWeights(w1, w2).check(QuantScheme.FP8_BLOCK)
    q1, s1 = quantize_fp8_block(w1)
    q2, s2 = quantize_fp8_block(w2)
    MoEWeights(q1, q2, s1, s2).check(QuantScheme.FP8_BLOCK)
    with pytest.raises(QuantizationError, match="w1_scale"):
        MoEWeights(q1, q2, s1[:, :1], s2).check(QuantScheme.FP8_BLOCK)
    with pytest.raises(QuantizationError, match="FP8_BLOCK"):
        MoEWeights(q1, q2, s1, s2).check(QuantScheme.NONE)
