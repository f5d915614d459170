"""moekit.hopper.align: every path (one program, one launch, the book's three launches by the lean
launcher) writes exactly the book's layout (moekit.kernels.align, checked against a plain sort in
tests/kernels/test_align.py)."""

from __future__ import annotations

import pytest
import torch

from moekit.hopper import align as wing
from moekit.kernels import align as book
from moekit.routing import contiguous_expert_map

TILE = book.TILE


@pytest.fixture(params=["as dispatched", "one launch", "three launches"])
def path(request, monkeypatch):
    """Every input goes the path its size picks, and each multi-program path forced for every size."""
    limits = {"one launch": (0, 1 << 30), "three launches": (0, 0)}.get(request.param)
    if limits:
        monkeypatch.setattr(wing, "SMALL_MAX", limits[0])
        monkeypatch.setattr(wing, "MEDIUM_MAX", limits[1])
    return request.param


def assert_same_layout(ids, block_m, E, expert_map=None, **kw):
    want = book.launch_align(ids, block_m, E, expert_map, **kw)
    got = wing.launch_align(ids, block_m, E, expert_map, **kw)
    assert type(got) is book.AlignedBlocks and got.shape is want.shape
    post = want.num_tokens_post_padded.item()
    assert got.num_tokens_post_padded.item() == post
    assert torch.equal(got.sorted_token_ids[:post], want.sorted_token_ids[:post])
    assert torch.equal(got.expert_ids[: post // block_m], want.expert_ids[: post // block_m])
    # Past the used rows both hold padding (numel) and -1 too: the whole views agree.
    assert torch.equal(got.sorted_token_ids, want.sorted_token_ids) and torch.equal(got.expert_ids, want.expert_ids)
    return got


@pytest.mark.parametrize("numel", [1, 37, TILE, TILE + 1, wing.MEDIUM_MAX, wing.MEDIUM_MAX + 1])
@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_same_layout_as_the_book(path, device, numel, block_m):
    E = 16
    ids = torch.randint(-1, E, (numel,), dtype=torch.int32, device=device)
    assert_same_layout(ids, block_m, E)


@pytest.mark.parametrize("numel", [5, TILE + 1, wing.MEDIUM_MAX + 1])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_same_layout_with_a_map_and_kept_empty_slots(path, device, numel, dtype):
    E, num_local = 12, 4
    ids = torch.randint(-1, E + 2, (numel,), dtype=dtype, device=device)  # ids >= E too
    emap = contiguous_expert_map(E, 3, 1, device=device).to(dtype)
    for keep_empty in (False, True):
        assert_same_layout(ids, 8, E, emap, num_local_experts=num_local, keep_empty=keep_empty)
    assert_same_layout(ids, 8, E, num_local_experts=num_local, keep_empty=True)  # no map: ids >= num_local remote


def test_a_chunks_slice_and_empty_input(path, device):
    ids = torch.randint(-1, 8, (3 * TILE + 1,), dtype=torch.int64, device=device)
    assert_same_layout(ids[1:], 16, 8, keep_empty=True)  # any alignment
    out = assert_same_layout(ids[:0], 16, 8)
    assert out.num_tokens_post_padded.tolist() == [0]


def test_limits_pick_the_launches():
    """The dispatch itself: one program up to TILE pairs, one launch up to MEDIUM_MAX, three past it."""
    path = wing._path_of
    small = path(TILE, 8, 8, 16, TILE, wing.MEDIUM_MAX)
    assert small.programs == 1 and small.consts["ONE_PROGRAM"] and small.consts["TILE"] == TILE
    assert path(5, 8, 8, 16, TILE, wing.MEDIUM_MAX).consts["TILE"] == 16  # the one program's tile: numel's power of two
    mid = path(TILE + 1, 8, 8, 16, TILE, wing.MEDIUM_MAX)
    assert mid.programs == mid.book.num_tiles == 2 and not mid.consts["ONE_PROGRAM"]
    moved = path(TILE, 8, 8, 16, 0, wing.MEDIUM_MAX)  # the limits move the paths
    assert moved.programs == 1 and not moved.consts["ONE_PROGRAM"]
    big = path(wing.MEDIUM_MAX + 1, 8, 8, 16, TILE, wing.MEDIUM_MAX)
    assert big.programs == 0 and big.book is book.align_shape(wing.MEDIUM_MAX + 1, 8, 8, 16)  # the book's three
    assert small.spec != mid.spec != big.spec


def test_launchers():
    """PDL on the one-launch kernel only: the book's kernels take no PDL constexpr."""
    assert wing._ONE_LAUNCH.pdl
    assert not (wing._COUNT.pdl or wing._SCAN.pdl or wing._SCATTER.pdl)
    assert wing._COUNT.fn is book.align_count_kernel and wing._SCATTER.fn is book.align_scatter_kernel


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16, 127, 129, 4096, 20000])
@pytest.mark.parametrize("mapped", [False, True])
def test_realistic_sizes_on_gpu(device, M, mapped):
    """Each size twice: the second launch of a key takes the lean path (cross-checked by the
    conftest's verifying())."""
    E, topk = 128, 8
    ids = torch.rand(M, E, device=device).topk(topk, dim=1).indices
    ids[::5, -1] = -1
    emap = (torch.arange(E, device=device, dtype=torch.int32) - 32) if mapped else None  # 32 remote experts
    for block_m in (16, 64, 128):
        for _ in range(2):
            assert_same_layout(ids, block_m, E, emap, num_local_experts=96 if mapped else None, keep_empty=mapped)
