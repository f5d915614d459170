import pytest
import torch

from moekit.errors import InvalidInputError
from moekit.kernels.reduce import weighted_topk_sum
from moekit.testing import assert_close


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, topk, K", [(1, 1, 8), (7, 3, 100), (33, 8, 256), (5, 2, 1500)])
def test_matches_torch(dtype, M, topk, K):
    x = torch.randn(M, topk, K).to(dtype)
    w = torch.rand(M, topk)
    out = torch.full((M, K), float("nan"), dtype=dtype)
    weighted_topk_sum(x, w, out)
    assert_close(out, (x.float() * w[..., None]).sum(1), dtype=dtype)


def test_empty_and_bad_shapes():
    out = torch.empty(0, 4)
    assert weighted_topk_sum(torch.empty(0, 2, 4), torch.empty(0, 2), out) is out
    with pytest.raises(InvalidInputError, match="fused_out"):
        weighted_topk_sum(torch.randn(3, 2, 5), torch.rand(3, 2), torch.empty(3, 4))
    with pytest.raises(InvalidInputError, match="topk_weights"):
        weighted_topk_sum(torch.randn(3, 2, 4), torch.rand(2, 2), torch.empty(3, 4))


@pytest.mark.gpu
def test_gpu_large():
    x = torch.randn(4096, 8, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, 8, device="cuda")
    out = torch.empty(4096, 2048, device="cuda", dtype=torch.bfloat16)
    weighted_topk_sum(x, w, out)
    assert_close(out, (x.float() * w[..., None]).sum(1), dtype=torch.bfloat16)
