"""BatchedPrepareFinalize: slabs per local expert, E_local counts, capacity, weighted combine."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.errors import CapacityError, InvalidInputError
from moekit.experts.batched import NaiveBatchedExperts
from moekit.prepare_finalize.batched import BatchedPrepareFinalize
from moekit.quant import FP8, quantize_fp8_per_token_group
from moekit.reference import count_reference, local_expert_ids
from moekit.testing import assert_close, expect_raises
from moekit.types import ActivationFormat, ExpertPlacement, QuantScheme

POISON = float("nan")


def _inputs(M, K, E_global, topk, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, K, generator=g)
    ids = torch.stack([torch.randperm(E_global, generator=g)[:topk] for _ in range(M)]).to(torch.int32)
    weights = torch.rand(M, topk, generator=g) + 0.1
    return hidden, weights, ids.reshape(M, topk)


def _slabs_by_loop(hidden, ids, E_local, emap):
    """The spec, literally: for each local expert, the tokens that chose it, in token order."""
    local = local_expert_ids(ids, E_local, emap)
    M, topk = ids.shape
    return [[m for m in range(M) for j in range(topk) if local[m, j] == e] for e in range(E_local)]


MAPS = {
    "none": (5, 5, None),
    "ep": (8, 3, torch.tensor([-1, 2, -1, 0, -1, -1, 1, -1], dtype=torch.int32)),
}


@pytest.mark.parametrize("case", list(MAPS))
def test_prepare_fills_slabs_in_token_order(case):
    E_global, E_local, emap = MAPS[case]
    M, K, T = 11, 16, 11
    hidden, weights, ids = _inputs(M, K, E_global, 3)
    ids[2, 1] = -1  # an empty slot
    pf = BatchedPrepareFinalize(max_tokens=T)
    placement = ExpertPlacement(E_global, E_local, emap)
    p = pf.prepare(hidden, weights, ids, quant=QuantScheme.NONE, placement=placement)
    assert p.a1q.shape == (E_local, T, K) and p.a1q.dtype == hidden.dtype and p.a1q_scale is None
    counts = p.tokens_meta.expert_num_tokens
    assert counts.dtype == torch.int32 and counts.shape == (E_local,)  # E_local, not E_global
    assert p.tokens_meta.expert_num_tokens_cpu is None
    assert torch.equal(counts, count_reference(ids, E_local, emap))
    for e, tokens in enumerate(_slabs_by_loop(hidden, ids, E_local, emap)):
        assert counts[e] == len(tokens)
        assert torch.equal(p.a1q[e, : len(tokens)], hidden[tokens])
        assert (p.a1q[e, len(tokens) :] == 0).all()
    assert p.topk_ids is ids and p.topk_weights is weights


@pytest.mark.interpreter
def test_prepare_quantizes_fp8_per_group():
    M, K, E = 6, 200, 3  # K not a multiple of 128: two groups, the second partial
    hidden, weights, ids = _inputs(M, K, E, 2)
    p = BatchedPrepareFinalize(max_tokens=M).prepare(
        hidden, weights, ids, quant=QuantScheme.FP8_BLOCK, placement=ExpertPlacement(E, E)
    )
    assert p.a1q.dtype == FP8 and p.a1q_scale.shape == (E, M, 2)
    q, s = quantize_fp8_per_token_group(hidden)
    for e, tokens in enumerate(_slabs_by_loop(hidden, ids, E, None)):
        n = len(tokens)
        assert torch.equal(p.a1q[e, :n].view(torch.uint8), q[tokens].view(torch.uint8))
        assert torch.equal(p.a1q_scale[e, :n], s[tokens])


@pytest.mark.interpreter
def test_capacity_error_before_any_write():
    M, K, E = 8, 16, 4
    hidden, weights, ids = _inputs(M, K, E, 2)
    ids[:, 0], ids[:, 1] = 2, 0  # every token picks expert 2 (local 1 under the map) and 0 (remote)
    emap = torch.tensor([-1, -1, 1, 0], dtype=torch.int32)
    before = (hidden.clone(), weights.clone(), ids.clone())
    pf = BatchedPrepareFinalize(max_tokens=5)
    named = r"local expert 1 \(global 2\) received 8 tokens but max_tokens=5"
    with expect_raises(CapacityError, match=named):
        pf.prepare(hidden, weights, ids, quant=QuantScheme.NONE, placement=ExpertPlacement(E, 2, emap))
    kernel = moekit.ModularKernel(pf, NaiveBatchedExperts())
    w1, w2 = torch.randn(2, 8, K), torch.randn(2, K, 4)
    with expect_raises(CapacityError, match="max_tokens=5"):
        kernel(hidden, w1, w2, weights, ids, expert_map=emap)
    for now, then in zip((hidden, weights, ids), before, strict=True):
        assert torch.equal(now, then)


def test_finalize_weights_sums_and_ignores_padding():
    M, K, E = 9, 16, 4
    hidden, weights, ids = _inputs(M, K, 6, 2)  # experts 4 and 5 are not local
    pf = BatchedPrepareFinalize(max_tokens=M)
    p = pf.prepare(hidden, weights, ids, quant=QuantScheme.NONE, placement=ExpertPlacement(6, E))
    fused = torch.randn(E, M, K)
    counts = p.tokens_meta.expert_num_tokens.tolist()
    for e, n in enumerate(counts):
        fused[e, n:] = POISON  # rows past the counts must never be read
    output = torch.full((M, K), 7.0)
    assert pf.finalize(fused, p, output=output) is output
    expected = torch.zeros(M, K)
    row = [0] * E
    for m in range(M):  # the slab row of (m, j) is the number of earlier tokens of that expert
        for j in range(2):
            e = int(ids[m, j])
            if e < E:
                expected[m] += weights[m, j] * fused[e, row[e]]
                row[e] += 1
    assert_close(output, expected, dtype=torch.float32)


def test_finalize_bf16_output_accumulates_in_fp32():
    M, K, E = 4, 8, 2
    hidden, weights, ids = _inputs(M, K, E, 2)
    pf = BatchedPrepareFinalize(max_tokens=M)
    p = pf.prepare(hidden, weights, ids, quant=QuantScheme.NONE, placement=ExpertPlacement(E, E))
    fused = torch.randn(E, M, K).bfloat16()
    out = pf.finalize(fused, p, output=torch.empty(M, K, dtype=torch.bfloat16))
    f = fused.float()
    rows = {e: 0 for e in range(E)}
    expected = torch.zeros(M, K)
    for m in range(M):
        for j in range(2):
            e = int(ids[m, j])
            expected[m] += weights[m, j] * f[e, rows[e]]
            rows[e] += 1
    assert out.dtype == torch.bfloat16
    assert_close(out, expected, dtype=torch.bfloat16)


def test_m_zero():
    pf = BatchedPrepareFinalize(max_tokens=4)
    ids = torch.zeros(0, 2, dtype=torch.int32)
    p = pf.prepare(
        torch.randn(0, 8), torch.zeros(0, 2), ids, quant=QuantScheme.NONE, placement=ExpertPlacement(3, 3)
    )
    assert p.a1q.shape == (3, 0, 8) and p.tokens_meta.expert_num_tokens.tolist() == [0, 0, 0]  # no pairs: no rows
    assert pf.finalize(torch.randn(3, 0, 8), p, output=torch.empty(0, 8)).shape == (0, 8)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, None])
def test_max_tokens_must_be_positive_int(bad):
    with expect_raises(InvalidInputError, match="max_tokens"):
        BatchedPrepareFinalize(max_tokens=bad)


def test_format_and_repr():
    pf = BatchedPrepareFinalize(max_tokens=3)
    assert pf.activation_format is ActivationFormat.BATCHED
    assert repr(pf) == "BatchedPrepareFinalize(max_tokens=3)"


@pytest.mark.interpreter  # the last part runs the layer on CPU tensors
def test_slabs_are_no_taller_than_the_pairs_that_came_and_max_tokens_is_exact():
    """max_tokens bounds what one expert may receive; slabs hold min(max_tokens, M * topk) rows, so
    max_tokens=2**40 allocates nothing more (it tried 420 TB); exactly max_tokens tokens pass, one
    more raises CapacityError before anything is written."""
    M, K, E = 6, 16, 3
    hidden, weights, ids = _inputs(M, K, E, 2)
    placement = ExpertPlacement(E, E, None)
    huge = BatchedPrepareFinalize(max_tokens=2**40).prepare(hidden, weights, ids, quant=QuantScheme.NONE,
                                                             placement=placement)  # fmt: skip
    assert huge.a1q.shape == (E, M * 2, K)
    ids[:, 0] = 1  # expert 1: every token once
    ids[:, 1] = torch.where(ids[:, 1] == 1, 0, ids[:, 1])
    exact = BatchedPrepareFinalize(max_tokens=M).prepare(hidden, weights, ids, quant=QuantScheme.NONE,
                                                         placement=placement)  # fmt: skip
    assert int(exact.tokens_meta.expert_num_tokens[1]) == M
    with expect_raises(CapacityError, match=f"received {M} tokens but max_tokens={M - 1}"):
        BatchedPrepareFinalize(max_tokens=M - 1).prepare(hidden, weights, ids, quant=QuantScheme.NONE,
                                                         placement=placement)  # fmt: skip
    out = moekit.ModularKernel(BatchedPrepareFinalize(max_tokens=2**40), NaiveBatchedExperts())
    w1, w2 = torch.randn(E, 8, K), torch.randn(E, K, 4)
    ref = moekit.reference.moe_reference(hidden, w1, w2, weights, ids)
    assert_close(out(hidden, w1, w2, weights, ids), ref, dtype=torch.float32)
