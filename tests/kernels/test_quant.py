import pytest
import torch

from moekit.errors import QuantizationError
from moekit.kernels.quant import quantize_fp8_group
from moekit.quant import FP8, dequantize_fp8_per_token_group, quantize_fp8_per_token_group


@pytest.mark.interpreter
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
        quantize_fp8_group(torch.randn(4, 128).to(FP8))
    with pytest.raises(QuantizationError):
        quantize_fp8_group(torch.randn(4, 2, 128))


@pytest.mark.interpreter
def test_an_all_zero_group_keeps_the_scale_floor():
    # Without the floor, 0 / 0 would make the whole group NaN.
    x = torch.randn(3, 384)
    x[1, 128:256] = 0
    q, s = quantize_fp8_group(x)
    q_ref, s_ref = quantize_fp8_per_token_group(x)
    assert s[1, 1] == 1e-10 and torch.equal(s, s_ref)
    assert (q[1, 128:256].float() == 0).all() and torch.equal(q.float(), q_ref.float())


@pytest.mark.interpreter
def test_nan_propagates_as_in_the_torch_spec():
    # max and clamp may drop NaN (the group's scale would stay finite and the NaN become -448);
    # the kernel gives what the spec gives: a NaN scale, so the group dequantizes to NaN. (The
    # fp8 code stored for a NaN may differ: the interpreter's fp32 -> fp8 cast maps NaN to 384.)
    x = torch.randn(2, 256)
    x[0, 5] = float("nan")
    q, s = quantize_fp8_group(x)
    q_ref, s_ref = quantize_fp8_per_token_group(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0, equal_nan=True)
    assert s[0, 0].isnan() and not s[0, 1].isnan()
    back, back_ref = dequantize_fp8_per_token_group(q, s), dequantize_fp8_per_token_group(q_ref, s_ref)
    assert back[0, :128].isnan().all() and back_ref[0, :128].isnan().all()
    assert torch.equal(back[:, 128:], back_ref[:, 128:]) and torch.equal(back[1], back_ref[1])


def test_bad_group_is_named():
    for group in (0, -128, 1.5, True):
        with pytest.raises(QuantizationError, match="group"):
            quantize_fp8_group(torch.randn(2, 128), group=group)
