"""The book's align (moekit.kernels.align: count, scan, scatter) against a plain-Python stable sort,
exact, entry by entry. The wing's fast paths are checked against it in tests/hopper/test_align.py."""

from __future__ import annotations

import pytest
import torch

from moekit.errors import InvalidIdsError, InvalidInputError
from moekit.kernels.align import (
    TILE,
    align_shape,
    launch_align,
    launch_chunk_counts,
    max_padded_size,
    moe_align_block_size,
)
from moekit.reference import count_reference
from moekit.routing import contiguous_expert_map
from moekit.testing import expect_raises


def align_spec(topk_ids, block_m, E, expert_map=None, *, num_local=None, keep_empty=False):
    """The docstring's algorithm, literally: (sorted_token_ids, expert_ids, post) as lists."""
    num_local = E if num_local is None else num_local
    ids = topk_ids.reshape(-1).tolist()
    emap = expert_map.tolist() if expert_map is not None else None
    numel = len(ids)
    buckets = [[] for _ in range(E + 1)]
    for i, g in enumerate(ids):
        if not 0 <= g < E:
            if keep_empty:
                buckets[E].append(i)
            continue
        local = emap[g] if emap is not None else g
        buckets[g if 0 <= local < num_local else E].append(i)
    sorted_ids, experts = [], []
    for b, pairs in enumerate(buckets):
        pad = -len(pairs) % block_m
        sorted_ids += pairs + [numel] * pad
        local = -1 if b == E else (emap[b] if emap is not None else b)
        experts += [local] * ((len(pairs) + pad) // block_m)
    return sorted_ids, experts, len(sorted_ids)


def align_spec_torch(topk_ids, block_m, E, expert_map=None, *, num_local=None, keep_empty=False):
    """The same spec, vectorized (a stable sort), for sizes where Python lists are too slow."""
    num_local = E if num_local is None else num_local
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    local = flat if expert_map is None else expert_map.long()[flat.clamp(0, E - 1)]
    bucket = torch.where(valid & (local >= 0) & (local < num_local), flat, E)
    idx = torch.arange(flat.numel(), device=flat.device)
    if not keep_empty:
        bucket, idx = bucket[valid], idx[valid]
    bucket, order = torch.sort(bucket, stable=True)
    counts = torch.bincount(bucket, minlength=E + 1)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts  # of each bucket in the sorted pairs
    rows = starts[bucket] + torch.arange(bucket.numel(), device=flat.device) - first[bucket]
    sorted_ids = torch.full((int(padded.sum()),), flat.numel(), dtype=torch.long, device=flat.device)
    sorted_ids[rows] = idx[order]
    locals_ = (
        torch.arange(E + 1, device=flat.device)
        if expert_map is None
        else torch.cat([expert_map.long(), torch.tensor([-1], device=flat.device)])
    )
    locals_[E] = -1
    experts = torch.repeat_interleave(locals_, padded // block_m)
    return sorted_ids.tolist(), experts.tolist(), int(padded.sum())


def check_against_spec(out, topk_ids, block_m, E, expert_map=None, *, spec=None, **kw):
    want_sorted, want_experts, post = (spec or align_spec)(topk_ids, block_m, E, expert_map, **kw)
    numel = topk_ids.numel()
    assert out.num_tokens_post_padded.tolist() == [post]
    assert out.sorted_token_ids.dtype == torch.int32 and out.expert_ids.dtype == torch.int32
    assert out.sorted_token_ids.numel() == max_padded_size(numel, E + 1, block_m)
    assert out.sorted_token_ids.numel() >= post
    got_sorted = out.sorted_token_ids.tolist()
    assert got_sorted[:post] == want_sorted
    assert all(v == numel for v in got_sorted[post:])  # everything past the blocks is padding
    got_experts = out.expert_ids.tolist()
    assert got_experts[: post // block_m] == want_experts
    assert all(v == -1 for v in got_experts[post // block_m :])


@pytest.mark.parametrize("numel_shape", [(1, 1), (3, 2), (16, 8), (17, 8), (100, 3)])
@pytest.mark.parametrize("block_m", [1, 4, 16, 64])
@pytest.mark.parametrize("E", [1, 7, 16])
def test_matches_spec(device, numel_shape, block_m, E):
    topk_ids = torch.randint(-1, E, numel_shape, device=device, dtype=torch.int32)
    out = moe_align_block_size(topk_ids, block_m, E)
    check_against_spec(out, topk_ids, block_m, E)


def test_docstring_example(device):
    topk_ids = torch.tensor([[2, 0], [2, 3], [-1, 2]], device=device, dtype=torch.int32)
    out = moe_align_block_size(topk_ids, 4, 4)
    assert out.sorted_token_ids[:12].tolist() == [1, 6, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6]
    assert out.expert_ids[:3].tolist() == [0, 2, 3] and out.num_tokens_post_padded.item() == 12
    emap = torch.tensor([-1, -1, 0, 1], device=device, dtype=torch.int32)
    out = moe_align_block_size(topk_ids, 4, 4, emap, num_local_experts=2)
    assert out.sorted_token_ids[:12].tolist() == [0, 2, 5, 6, 3, 6, 6, 6, 1, 6, 6, 6]
    assert out.expert_ids[:3].tolist() == [0, 1, -1]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("world, rank", [(2, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("M", [5, 70])
def test_expert_map_gives_minus_one_blocks(device, dtype, world, rank, M):
    E, topk = 16, 4
    E_local = E // world
    emap = torch.full((E,), -1, dtype=dtype, device=device)
    emap[rank * E_local : (rank + 1) * E_local] = torch.arange(E_local, dtype=dtype, device=device)
    topk_ids = torch.randint(-1, E, (M, topk), device=device, dtype=dtype)
    out = moe_align_block_size(topk_ids, 8, E, emap, num_local_experts=E_local)
    check_against_spec(out, topk_ids, 8, E, emap, num_local=E_local)
    post = out.num_tokens_post_padded.item()
    experts = out.expert_ids[: post // 8]
    assert ((experts >= -1) & (experts < E_local)).all()
    # Every non-empty pair is placed once: locals in their expert's blocks, the rest in -1 blocks.
    placed = out.sorted_token_ids[:post]
    placed = placed[placed < topk_ids.numel()]
    assert sorted(placed.tolist()) == [i for i, g in enumerate(topk_ids.reshape(-1).tolist()) if g >= 0]


@pytest.mark.parametrize("numel_shape", [(5, 2), (60, 4)])
def test_keep_empty_places_every_pair(device, numel_shape):
    E = 6
    topk_ids = torch.randint(-1, E + 2, numel_shape, device=device, dtype=torch.int64)  # ids >= E too
    out = moe_align_block_size(topk_ids, 4, E, num_local_experts=4, keep_empty=True)
    check_against_spec(out, topk_ids, 4, E, num_local=4, keep_empty=True)
    post = out.num_tokens_post_padded.item()
    placed = out.sorted_token_ids[:post]
    assert sorted(placed[placed < topk_ids.numel()].tolist()) == list(range(topk_ids.numel()))


def test_stable_order_across_many_tiles(device):
    # Three tiles of ids, almost all to expert 1: its run must list pairs in increasing order.
    topk_ids = torch.ones(3 * TILE + 5, 1, device=device, dtype=torch.int32)
    topk_ids[::7] = 0
    out = moe_align_block_size(topk_ids, 16, 2)
    check_against_spec(out, topk_ids, 16, 2)
    runs = [out.sorted_token_ids.clone() for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs)


@pytest.mark.parametrize("block_m", [16, 64])
def test_torch_spec_agrees_with_list_spec(device, block_m):
    E = 12
    topk_ids = torch.randint(-1, E + 1, (150, 3), device=device)
    emap = torch.randperm(E, device=device) % 5 - 1  # some remote experts
    for kw in (dict(), dict(expert_map=emap, num_local=4, keep_empty=True)):
        m = kw.pop("expert_map", None)
        assert align_spec_torch(topk_ids, block_m, E, m, **kw) == align_spec(topk_ids, block_m, E, m, **kw)


def test_many_tiles_fewer_than_buckets(device):
    # 3 tiles own 17 buckets' padding between them (each program pads buckets t, t + 3, ...).
    E = 16
    topk_ids = torch.randint(-1, E, (2 * TILE + 9, 1), device=device, dtype=torch.int32)
    emap = torch.randperm(E, device=device, dtype=torch.int32) % 11 - 1
    out = moe_align_block_size(topk_ids, 8, E, emap, num_local_experts=10, keep_empty=True)
    check_against_spec(out, topk_ids, 8, E, emap, num_local=10, keep_empty=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "M, block_m", [(1, 16), (16, 16), (127, 16), (129, 64), (4096, 64), (16384, 128), (20000, 128)]
)
@pytest.mark.parametrize("mapped", [False, True])
def test_realistic_sizes_on_gpu(device, M, block_m, mapped):
    E, topk = 128, 8
    topk_ids = torch.rand(M, E, device=device).topk(topk, dim=1).indices
    topk_ids[::5, -1] = -1  # some empty slots
    emap = (torch.arange(E, device=device, dtype=torch.int32) - 32) if mapped else None  # 32 remote experts
    kw = dict(num_local=96, keep_empty=True) if mapped else {}
    out = moe_align_block_size(topk_ids, block_m, E, emap, num_local_experts=kw.get("num_local"), keep_empty=mapped)
    check_against_spec(out, topk_ids, block_m, E, emap, spec=align_spec_torch, **kw)


def test_empty_input(device):
    out = moe_align_block_size(torch.empty(0, 2, dtype=torch.int32, device=device), 16, 8)
    assert out.num_tokens_post_padded.tolist() == [0]
    assert out.sorted_token_ids.numel() == 0 and out.expert_ids.numel() == 0
    out = launch_align(torch.empty(0, dtype=torch.int64, device=device), 4, 8, keep_empty=True)
    assert out.num_tokens_post_padded.tolist() == [0] and out.max_padded == 0
    assert launch_chunk_counts(out, 128, 8).shape == (0, 8)


def test_errors(device):
    ids = torch.zeros(2, 2, dtype=torch.int32, device=device)
    with expect_raises(InvalidInputError, match="power of two"):
        moe_align_block_size(ids, 12, 4)
    with expect_raises(InvalidInputError, match="num_experts"):
        moe_align_block_size(ids, 16, 0)
    with expect_raises(InvalidInputError, match="expert_map must have"):
        moe_align_block_size(ids, 16, 4, torch.zeros(3, dtype=torch.int32, device=device))
    with expect_raises(InvalidIdsError, match="signed"):
        moe_align_block_size(ids.to(torch.uint8), 16, 4)


@pytest.mark.parametrize("R", [128, 256, 384])
@pytest.mark.parametrize("with_map", [False, True])
def test_chunk_counts_are_each_chunks_own_rows_per_local_expert(R, with_map, device):
    """One launch counts every chunk of R sorted rows; each row equals counting that chunk's pairs."""
    E, num_local = 8, 4 if with_map else 8
    ids = torch.randint(-1, E, (300, 2), dtype=torch.int32, device=device)
    emap = contiguous_expert_map(E, 2, 1, device=device) if with_map else None
    blocks = moe_align_block_size(ids, 128, E, emap, num_local_experts=num_local, keep_empty=True)
    got = launch_chunk_counts(blocks, R, num_local).cpu()
    padded = torch.cat([ids.reshape(-1), ids.new_full((1,), -1)])
    for c in range(got.shape[0]):
        rows = padded[blocks.sorted_token_ids[c * R : (c + 1) * R].long()]
        assert torch.equal(got[c], count_reference(rows, num_local, emap).cpu().to(torch.int32)), c
    assert torch.equal(got.sum(0), count_reference(ids, num_local, emap).cpu().to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("numel", [1, TILE, TILE + 1, 3000])
@pytest.mark.parametrize("mapped", [False, True])
def test_launch_align_unchecked(device, dtype, numel, mapped):
    """launch_align is moe_align_block_size without the checks: the same layout, from one tile to thousands
    of pairs (ids past E too), with a map whose remote experts and kept empty slots share bucket E."""
    E, num_local = 16, 5 if mapped else 16
    ids = torch.randint(-1, E + 2, (numel,), dtype=dtype, device=device)
    emap = (torch.randperm(E, device=device, dtype=dtype) % 7 - 2) if mapped else None
    blocks = launch_align(ids, 16, E, emap, num_local_experts=num_local, keep_empty=mapped)
    check_against_spec(blocks, ids, 16, E, emap, num_local=num_local, keep_empty=mapped, spec=align_spec_torch)
    again = moe_align_block_size(ids, 16, E, emap, num_local_experts=num_local, keep_empty=mapped)
    for name in ("sorted_token_ids", "expert_ids", "num_tokens_post_padded"):  # the gaps between them are unset
        assert torch.equal(getattr(again, name), getattr(blocks, name)), name


def test_thousands_of_pairs_against_the_list_spec(device):
    E = 24
    ids = torch.randint(-1, E, (700, 4), dtype=torch.int64, device=device)
    emap = contiguous_expert_map(E, 3, 2, device=device)
    out = moe_align_block_size(ids, 32, E, emap, num_local_experts=E // 3, keep_empty=True)
    check_against_spec(out, ids, 32, E, emap, num_local=E // 3, keep_empty=True)


def test_shape_of_the_buffer():
    """One AlignShape per size; the pieces of the buffer follow each other on 32-entry boundaries."""
    sh = align_shape(TILE * 3 + 1, 8, 6, 16)
    assert sh is align_shape(TILE * 3 + 1, 8, 6, 16)
    assert sh.num_tiles == 4 and sh.max_padded == max_padded_size(TILE * 3 + 1, 9, 16)
    assert sh.max_blocks * 16 == sh.max_padded and sh.num_bins > sh.E + 1
    assert 0 < sh.expert_off < sh.post_off < sh.counts_off < sh.totals_off < sh.size
    assert all(off % 32 == 0 for off in (sh.expert_off, sh.post_off, sh.counts_off, sh.totals_off, sh.size))
    assert sh.totals_off - sh.counts_off >= (sh.E + 1) * sh.num_tiles and sh.owned * sh.num_tiles >= sh.E + 1


@pytest.mark.parametrize("keep_empty", [False, True])
def test_an_id_equal_to_E_never_reads_the_map(device, keep_empty):
    """transformers marks an empty slot with id == E: the align treats it as empty (dropped, or kept in
    the remote bucket) and never reads ``expert_map[E]``, one entry past the map's end."""
    E = 6
    ids = torch.full((5, 2), E, dtype=torch.int32, device=device)
    ids[0, 0] = 1
    emap = torch.arange(E, dtype=torch.int32, device=device)
    blocks = moe_align_block_size(ids, 16, E, emap, keep_empty=keep_empty)
    check_against_spec(blocks, ids, 16, E, emap, keep_empty=keep_empty)
    used = int(blocks.num_tokens_post_padded)
    local_blocks = [int(e) for e in blocks.expert_ids[: used // 16] if int(e) >= 0]
    assert local_blocks == [1]  # only pair 0 lands on a local expert


def test_the_documented_maximum_of_experts_aligns_and_one_more_is_named(device):
    from moekit.validate import MAX_EXPERTS

    topk_ids = torch.randint(-1, MAX_EXPERTS, (96, 4), device=device, dtype=torch.int32)
    topk_ids[0, 0] = MAX_EXPERTS - 1
    emap = contiguous_expert_map(MAX_EXPERTS, 2, 1, device=device)
    out = moe_align_block_size(topk_ids, 16, MAX_EXPERTS, emap, num_local_experts=MAX_EXPERTS // 2)
    check_against_spec(out, topk_ids, 16, MAX_EXPERTS, emap, num_local=MAX_EXPERTS // 2)
    with expect_raises(InvalidInputError, match=f"global_num_experts must be at most {MAX_EXPERTS}"):
        moe_align_block_size(topk_ids, 16, MAX_EXPERTS + 1)
