"""gather_positions / scatter_positions: a chunk of sorted rows moved by position and back."""

from __future__ import annotations

import torch

from moekit.kernels.align import moe_align_block_size
from moekit.kernels.permute import ALIGN_M
from moekit.kernels.positions import gather_positions, scatter_positions
from moekit.quant import FP8_GROUP, quantize_fp8_per_token_group
from moekit.routing import contiguous_expert_map


def make(M, K, topk, E_global, device, *, low=-1):
    q, s = quantize_fp8_per_token_group(torch.randn(M, K, device=device))
    ids = torch.randint(low, E_global, (M, topk), device=device)
    return q, s, ids


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
