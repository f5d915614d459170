import pytest
import torch

from moekit.chunking import chunk_ranges, slice_rows, slice_scales, validate_chunk_size
from moekit.errors import ChunkSizeError


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
    assert [r.index for r in chunk_ranges(M, C)] == list(range(len(expected)))


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


def test_slice_rows_with_factor():
    t = torch.arange(12).view(6, 2)  # M=3 tokens x factor 2
    r = chunk_ranges(3, 2)[1]
    assert slice_rows(t, r, 3).tolist() == [[8, 9], [10, 11]]
