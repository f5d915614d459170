"""permute_to_contiguous / unpermute_from_contiguous against the layout's definition, and
gather_positions / scatter_positions: a chunk of sorted rows moved by position and back."""

from __future__ import annotations

import pytest
import torch

from moekit.errors import InvalidInputError
from moekit.kernels.align import moe_align_block_size
from moekit.kernels.permute import (
    ALIGN_M,
    MISMATCH,
    OVERFLOW,
    gather_positions,
    permute_to_contiguous,
    scatter_positions,
    unpermute_from_contiguous,
)
from moekit.quant import FP8_GROUP, quantize_fp8_per_token_group
from moekit.reference import count_reference, local_expert_ids
from moekit.routing import contiguous_expert_map


def _round_up(x, m):
    return (x + m - 1) // m * m


def make(M, K, topk, E_global, device, *, low=-1):
    q, s = quantize_fp8_per_token_group(torch.randn(M, K, device=device))
    ids = torch.randint(low, E_global, (M, topk), device=device)
    return q, s, ids


def check_layout(L, q, s, ids, E, emap, counts, flags=0):
    M, topk = ids.shape
    local = local_expert_ids(ids, E, emap).reshape(-1).cpu()
    inv = L.inv_perm.cpu().long()
    # Empty and non-local slots have no row; every local pair has its own row.
    assert torch.equal(inv < 0, local < 0)
    rows = inv[local >= 0]
    assert rows.unique().numel() == rows.numel()
    # Each pair's row holds its token's fp8 bytes and scales, inside its expert's segment.
    start = L.expert_start.cpu().long()
    assert torch.equal(start[1:] - start[:-1], (counts.cpu().long() + ALIGN_M - 1) // ALIGN_M * ALIGN_M)
    tok = torch.arange(M * topk) // topk
    ok = local >= 0
    assert torch.equal(L.a.cpu()[inv[ok]].view(torch.uint8), q.cpu()[tok[ok]].view(torch.uint8))
    assert torch.equal(L.a_scale.cpu()[inv[ok]], s.cpu()[tok[ok]])
    e_of = local[ok]
    assert bool(((inv[ok] >= start[e_of]) & (inv[ok] < start[e_of] + counts.cpu().long()[e_of])).all())
    # m_indices: constant per 128-row block, a valid expert everywhere (never -1), equal to
    # the segment's expert on every row of that segment, the last expert on unused blocks.
    mi = L.m_indices.cpu().long()
    assert bool(((mi >= 0) & (mi < E)).all())
    blocks = mi.view(-1, ALIGN_M)
    assert bool((blocks == blocks[:, :1]).all())
    for e in range(E):
        assert bool((mi[start[e] : start[e + 1]] == e).all())
    assert bool((mi[start[E] :] == E - 1).all())
    # block_rows: rows with data at the start of each block.
    filled = torch.zeros(L.num_rows, dtype=torch.bool)
    filled[inv[ok]] = True
    assert torch.equal(L.block_rows.cpu().long(), filled.view(-1, ALIGN_M).sum(1))
    assert int(L.flags) == flags


@pytest.mark.parametrize("M,topk,E,K", [(1, 1, 1, 128), (37, 3, 5, 256), (64, 8, 8, 128), (19, 2, 7, 123)])
@pytest.mark.parametrize("ep", [1, 2])
def test_round_trip(M, topk, E, K, ep, device):
    E_global = E * ep
    q, s, ids = make(M, K, topk, E_global + 1, device)  # +1: an id past every expert is ignored
    emap = contiguous_expert_map(E_global, ep, ep - 1, device=device) if ep > 1 else None
    if emap is not None:
        ids = ids.clamp(max=E_global - 1)
    counts = count_reference(ids, E, emap)
    num_rows = _round_up(M * topk + (ALIGN_M - 1) * E, ALIGN_M) + ALIGN_M  # + an unused block
    L = permute_to_contiguous(q, s, ids, counts, num_rows=num_rows, expert_map=emap)
    check_layout(L, q, s, ids, E, emap, counts)

    rows = torch.randn(num_rows, K + 3, device=device).to(torch.bfloat16)  # wider rows: a view
    out = torch.full((M, topk, K), float("nan"), dtype=torch.bfloat16, device=device)
    unpermute_from_contiguous(rows, L.inv_perm, out=out)
    local = local_expert_ids(ids, E, emap)
    want = torch.where((local >= 0).unsqueeze(-1), rows[L.inv_perm.clamp(min=0).long()].view(M, topk, -1)[..., :K], 0.0)
    assert torch.equal(out, want)  # zeros, not NaN, for empty and non-local slots


def test_scale_layout_is_column_major_and_tma_aligned(device):
    q, s, ids = make(9, 384, 2, 3, device, low=0)
    L = permute_to_contiguous(q, s, ids, count_reference(ids, 3), num_rows=3 * ALIGN_M)
    assert L.a_scale.shape == (3 * ALIGN_M, 3)
    assert L.a_scale.stride(0) == 1 and L.a_scale.stride(1) % 4 == 0


def test_larger_counts_only_add_padding(device):
    q, s, ids = make(20, 128, 2, 4, device)
    counts = count_reference(ids, 4) + torch.tensor([0, 130, 1, 0], dtype=torch.int32, device=device)
    L = permute_to_contiguous(q, s, ids, counts, num_rows=_round_up(40 + 4 * 127 + 130, ALIGN_M))
    check_layout(L, q, s, ids, 4, None, counts, flags=MISMATCH)  # flagged, yet a valid layout


def test_undercounts_set_overflow_and_stay_in_bounds(device):
    q, s, ids = make(30, 128, 2, 2, device, low=0)
    true = count_reference(ids, 2)
    stale = torch.tensor([1, 0], dtype=torch.int32, device=device)  # far fewer than routed
    L = permute_to_contiguous(q, s, ids, stale, num_rows=2 * ALIGN_M)
    assert int(L.flags) == OVERFLOW | MISMATCH
    placed = int((L.inv_perm >= 0).sum())
    assert placed == min(int(true[0]), ALIGN_M)  # expert 0's one padded block, expert 1 none
    assert int(L.inv_perm.max()) < ALIGN_M


def test_sum_past_num_rows_sets_overflow(device):
    q, s, ids = make(4, 128, 2, 2, device, low=0)
    counts = torch.tensor([200, 200], dtype=torch.int32, device=device)
    L = permute_to_contiguous(q, s, ids, counts, num_rows=ALIGN_M)
    assert int(L.flags) & OVERFLOW
    assert bool((L.m_indices >= 0).all())


def test_empty_tokens(device):
    q, s, ids = make(0, 128, 2, 3, device)
    L = permute_to_contiguous(q, s, ids, torch.zeros(3, dtype=torch.int32, device=device), num_rows=ALIGN_M)
    assert L.inv_perm.numel() == 0 and int(L.block_rows[0]) == 0
    assert bool((L.m_indices == 2).all())
    out = torch.empty(0, 2, 128, dtype=torch.bfloat16, device=device)
    assert unpermute_from_contiguous(L.a.float(), L.inv_perm, out=out).shape == (0, 2, 128)


def test_bad_inputs(device):
    q, s, ids = make(4, 128, 2, 2, device)
    counts = count_reference(ids, 2)
    with pytest.raises(InvalidInputError, match="multiple of 128"):
        permute_to_contiguous(q, s, ids, counts, num_rows=100)
    with pytest.raises(InvalidInputError, match="float8"):
        permute_to_contiguous(q.float(), s, ids, counts, num_rows=ALIGN_M)
    with pytest.raises(InvalidInputError, match="a1q_scale"):
        permute_to_contiguous(q, s[:, :0], ids, counts, num_rows=ALIGN_M)
    with pytest.raises(InvalidInputError, match="inv_perm"):
        unpermute_from_contiguous(q.float(), counts, out=torch.empty(4, 2, 128, device=device))


def test_gather_then_scatter_positions_moves_each_pair_once(device):
    """gather_positions copies each sorted row's token (zeros for padding); scatter_positions writes
    each pair's row back, zeros for blocks of expert -1, and leaves padding and other rows alone."""
    M, K, topk, E = 37, 256, 3, 6
    q, s, ids = make(M, K, topk, E, device)
    emap = contiguous_expert_map(E, 2, 0, device=device)
    blocks = moe_align_block_size(ids, ALIGN_M, E, emap, num_local_experts=3, keep_empty=True)
    sorted_ids = blocks.sorted_token_ids
    R = sorted_ids.numel()
    a = torch.empty(R, K, dtype=q.dtype, device=device)
    a_scale = torch.full((K // FP8_GROUP, R), -1.0, device=device).t()  # column-major, as deep_gemm's
    gather_positions(q, s, sorted_ids, numel=M * topk, topk=topk, out=a, out_scale=a_scale)
    pair = sorted_ids.long().cpu()
    live = pair < M * topk
    tok = torch.where(live, pair // topk, 0)
    assert torch.equal(a.cpu()[live].view(torch.uint8), q.cpu()[tok[live]].view(torch.uint8))
    assert torch.equal(a_scale.cpu()[live], s.cpu()[tok[live]])
    assert (a.cpu()[~live].float() == 0).all() and (a_scale.cpu()[~live] == 0).all()
    rows = torch.randn(R, K + 8, device=device)  # wider than K: only the first K columns move
    out = torch.full((M, topk, K), 5.0, device=device)
    scatter_positions(rows, sorted_ids, blocks.expert_ids, numel=M * topk, expert_block=ALIGN_M, out=out)
    local = blocks.expert_ids.cpu().repeat_interleave(ALIGN_M)[:R] >= 0
    flat = out.cpu().view(-1, K)
    want = torch.where(local[live][:, None], rows.cpu()[live][:, :K], torch.zeros(1))
    assert torch.equal(flat[pair[live]], want)
    untouched = torch.ones(M * topk, dtype=torch.bool)
    untouched[pair[live]] = False
    assert (flat[untouched] == 5.0).all()
