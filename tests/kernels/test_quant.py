import pytest
import torch

from moekit.errors import QuantizationError
from moekit.kernels.quant import quantize_fp8_group
from moekit.quant import quantize_fp8_per_token_group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, K", [(1, 128), (37, 256), (5, 200), (64, 384)])
def test_matches_the_torch_spec_exactly(dtype, M, K):
    x = (torch.randn(M, K) * torch.logspace(-3, 2, K)).to(dtype)
    q, s = quantize_fp8_group(x)
    q_ref, s_ref = quantize_fp8_per_token_group(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), q_ref.float())  # bit patterns may differ only in the sign of zero


def test_empty_and_bad_input():
    q, s = quantize_fp8_group(torch.randn(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    with pytest.raises(QuantizationError):
        quantize_fp8_group(torch.randn(4, 128).to(torch.float8_e4m3fn))
    with pytest.raises(QuantizationError):
        quantize_fp8_group(torch.randn(4, 2, 128))
