import torch

from moekit.types import WorkspaceShapes
from moekit.workspace import WorkspacePool, shared_pool


def shapes(M, dtype=torch.bfloat16):
    return WorkspaceShapes((M, 4, 64), (M * 4, 32), (M, 4, 16), dtype)


def test_buffers_are_flat_with_the_declared_sizes_and_dtype():
    pool = WorkspacePool("cpu")
    v = pool.take(shapes(3))
    assert v.workspace13.shape == (3 * 4 * 64,) and v.workspace2.shape == (12 * 32,)
    assert v.workspace13.dtype == v.workspace2.dtype == torch.bfloat16
    # the two regions do not overlap
    v.workspace13.fill_(1)
    v.workspace2.fill_(2)
    assert bool((v.workspace13 == 1).all())


def test_grows_once_then_reuses():
    pool = WorkspacePool("cpu")
    pool.take(shapes(8))
    for M in (8, 5, 1, 8):
        pool.take(shapes(M))
    assert pool.grows == 1 and pool.requests == 5
    pool.take(shapes(16))
    assert pool.grows == 2


def test_peak_scales_with_chunk_not_total():
    pool = WorkspacePool("cpu")
    for _ in range(10):  # ten chunks of 4 tokens = 40 tokens in all
        pool.take(shapes(4))
    small = pool.peak_bytes
    pool2 = WorkspacePool("cpu")
    pool2.take(shapes(40))
    assert pool2.peak_bytes > 8 * small


def test_shared_pool_is_per_device():
    assert shared_pool("cpu") is shared_pool(torch.device("cpu"))


def test_workspace2_starts_aligned_for_vector_loads():
    pool = WorkspacePool("cpu")
    v = pool.take(WorkspaceShapes((3, 5), (7,), (1,), torch.bfloat16))  # 30 bytes of workspace13
    assert (v.workspace2.data_ptr() - v.workspace13.data_ptr()) % 256 == 0
