"""Property: for any small problem, chunked == unchunked == reference (TritonExperts)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moekit
from moekit.experts import TritonExperts
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.reference import moe_reference
from moekit.testing import assert_close


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.integers(1, 24),
    C=st.integers(1, 24),
    E=st.integers(1, 6),
    topk=st.integers(1, 3),
    K=st.sampled_from([8, 16, 24]),
    half_N=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.interpreter
def test_chunked_equals_unchunked(M, C, E, topk, K, half_N, seed):
    topk = min(topk, E)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w1 = torch.randn(E, 2 * half_N, K, generator=g) / K**0.5
    w2 = torch.randn(E, K, half_N, generator=g) / half_N**0.5
    tw, ti = moekit.routing.uniform_router(M, E, topk, seed=seed, device="cpu")
    chunked = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=C)(x, w1, w2, tw, ti)
    whole = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts())(x, w1, w2, tw, ti)
    assert_close(chunked, whole, dtype=torch.float32)
    assert_close(chunked, moe_reference(x, w1, w2, tw, ti), dtype=torch.float32)
