"""moekit.plan: the chunk records and the token ranges (the planners run in test_modular_kernel and test_row_plan)."""

import dataclasses

import pytest
import torch

from moekit.errors import ChunkSizeError
from moekit.plan import Chunk, RowChunk, SlabChunk, TokenChunk, chunk_ranges, slice_scales, validate_chunk_size


def spans(M, C):
    return [(r.start, r.end) for r in chunk_ranges(M, C)]


@pytest.mark.parametrize(
    "M, C, expected",
    [
        (0, 4, []),
        (3, 4, [(0, 3)]),
        (4, 4, [(0, 4)]),
        (5, 4, [(0, 4), (4, 5)]),
        (8, 4, [(0, 4), (4, 8)]),
        (17, 4, [(0, 4), (4, 8), (8, 12), (12, 16), (16, 17)]),
        (3, 1, [(0, 1), (1, 2), (2, 3)]),
        (130, 128, [(0, 128), (128, 130)]),
        (130, 64, [(0, 64), (64, 128), (128, 130)]),
        (7, None, [(0, 7)]),
    ],
)
def test_chunk_ranges(M, C, expected):
    assert spans(M, C) == expected
    chunks = chunk_ranges(M, C)
    assert [r.index for r in chunks] == list(range(len(expected)))
    assert all(type(c) is TokenChunk and c.size == c.end - c.start for c in chunks)
    assert chunk_ranges(M, C) is chunks  # a pure function, remembered: nobody can change a plan


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True, None])
def test_a_bad_token_count_is_named(bad):
    with pytest.raises(ChunkSizeError, match="M must be an int >= 0"):
        chunk_ranges(bad, 4)


def test_chunks_are_values_of_one_family():
    for kind in (TokenChunk, RowChunk, SlabChunk):
        chunk = kind(0, 0, 8)
        assert isinstance(chunk, Chunk) and chunk.size == 8
        with pytest.raises(dataclasses.FrozenInstanceError):
            chunk.end = 9
    assert TokenChunk(1, 4, 8) == TokenChunk(1, 4, 8) != RowChunk(1, 4, 8)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8", True])
def test_invalid_chunk_size(bad):
    with pytest.raises(ChunkSizeError, match="chunk_size"):
        validate_chunk_size(bad)


def test_slice_scales_per_tensor_passes_whole_per_token_sliced():
    per_tensor = torch.tensor([0.5])
    assert slice_scales(per_tensor, 2, 4) is per_tensor
    per_token = torch.arange(10.0).view(10, 1)
    assert slice_scales(per_token, 2, 4).flatten().tolist() == [2.0, 3.0]
    assert slice_scales(None, 0, 1) is None
    # The #28728 typo sliced (e, e): an empty scale. Ours never is for a non-empty chunk.
    assert slice_scales(per_token, 8, 10).shape[0] == 2
