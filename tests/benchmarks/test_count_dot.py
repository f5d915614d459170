"""The one-hot product count (benchmarks/variants/count_dot.py) is exact, like moekit's histogram."""

import pytest
import torch

import moekit
from benchmarks.variants.count_dot import count_dot
from moekit.reference import count_reference
from moekit.routing import contiguous_expert_map


@pytest.mark.parametrize("fp16", [False, True], ids=["int8", "fp16"])
@pytest.mark.parametrize("M, topk, E, ep, k, split", [(300, 4, 64, 1, 64, 1), (300, 4, 64, 8, 32, 4),
                                                      (40, 8, 300, 1, 64, 2)])
def test_count_dot_matches_the_reference(M, topk, E, ep, k, split, fp16):
    device = moekit.device.get_device()
    ids = torch.rand(M, E, device=device).topk(topk, dim=1).indices.int()
    ids[::7, 0] = -1  # empty slots are never counted
    emap = contiguous_expert_map(E, ep, ep - 1, device=device) if ep > 1 else None
    got = count_dot(ids, E // ep, emap, k=k, split=split, programs_per_sm=2, num_warps=split, sms=2, fp16=fp16)
    assert torch.equal(got.cpu(), count_reference(ids, E // ep, emap).cpu())
