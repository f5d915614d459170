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


@pytest.mark.parametrize("N, K", [(256, 128), (140, 130), (512, 384)])
def test_expert_bytes_count_what_the_tensors_hold(N, K):
    # Issue 25's test holes: the fp8 scales counted 2 bytes each instead of 4 and no test noticed.
    from moekit.types import expert_bytes

    w1, w2 = torch.randn(3, N, K), torch.randn(3, K, N // 2)
    (q1, s1), (q2, s2) = quantize_fp8_block(w1), quantize_fp8_block(w2)
    assert s1.dtype == s2.dtype == torch.float32  # 4 bytes per 128 x 128 block
    per_expert = q1[0].nbytes + q2[0].nbytes + s1[0].nbytes + s2[0].nbytes
    assert MoEWeights(q1, q2, s1, s2).expert_bytes == expert_bytes(N, K, q1.dtype, scaled=True) == per_expert
    assert expert_bytes(N, K, q1.dtype, scaled=True) - expert_bytes(N, K, q1.dtype, scaled=False) == 4 * (
        s1[0].numel() + s2[0].numel())  # fmt: skip
    bf16 = MoEWeights(w1.bfloat16(), w2.bfloat16())
    assert bf16.expert_bytes == w1[0].bfloat16().nbytes + w2[0].bfloat16().nbytes
    assert MoEWeights(w1[:0], w2[:0]).expert_bytes == 0
