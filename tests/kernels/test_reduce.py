import pytest
import torch

from moekit.errors import InvalidInputError
from moekit.kernels import reduce
from moekit.kernels.reduce import MIN_PROGRAMS, _reduce_shape, weighted_topk_sum
from moekit.testing import assert_close


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, topk, K", [(1, 1, 8), (7, 3, 100), (33, 8, 256), (5, 2, 1500)])
@pytest.mark.parametrize("narrowed", [False, True], ids=["interpreter tiles", "gpu tiles"])
def test_matches_torch(dtype, M, topk, K, narrowed, monkeypatch):
    if narrowed:  # the tiles a GPU launch takes (the interpreter keeps the widest: see _min_programs)
        monkeypatch.setattr(reduce, "_min_programs", lambda: MIN_PROGRAMS)
    # (33, 8, 256) narrows the tile's rows, (5, 2, 1500) its columns too (see _reduce_shape)
    x = torch.randn(M, topk, K).to(dtype)
    w = torch.rand(M, topk)
    out = torch.full((M, K), float("nan"), dtype=dtype)
    weighted_topk_sum(x, w, out)
    assert_close(out, (x.float() * w[..., None]).sum(1), dtype=dtype)


@pytest.mark.parametrize("M, K", [(1, 2048), (8, 2048), (128, 2048), (130, 7168), (4096, 2048), (16384, 7168)])
def test_launch_shape_fills_the_gpu_when_it_can(M, K):
    """Small M gets narrower tiles until MIN_PROGRAMS programs (or 1 x 256 tiles); large M keeps
    16 x 1024-element tiles; every element is covered once and each thread keeps <= 32 elements."""
    grid, c = _reduce_shape(M, K, MIN_PROGRAMS)
    bm, bk, warps = c["BLOCK_M"], c["BLOCK_K"], c["num_warps"]
    assert grid == (-(-M // bm), -(-K // bk)) and bm * bk <= 4096
    assert grid[0] * grid[1] >= MIN_PROGRAMS or (bm == 1 and bk <= max(256, K))
    assert bm * bk // (32 * warps) in (8, 16, 32) or bm * bk < 256
    if M * K >= 4096 * MIN_PROGRAMS:
        assert bm * bk == 4096


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
