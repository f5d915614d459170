import pytest
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


def test_a_pool_says_which_devices_it_serves():
    # Issue 25, items 7 and 15: a pool is made on the first call's device and was used for every later one.
    from moekit.errors import InvalidInputError
    from moekit.testing import expect_raises

    pool = WorkspacePool("cpu")
    assert pool.serves("cpu") and pool.serves(torch.device("cpu")) and not pool.serves("meta")
    pool.check_device("cpu")
    with expect_raises(InvalidInputError, match=r"the workspace pool lives on cpu, but this call's tensors are on me"):
        pool.check_device(torch.device("meta"))
    before = pool.take(WorkspaceShapes((4,), (4,), (1,), torch.float32))
    with expect_raises(InvalidInputError, match=r"lives on cpu, but this call's tensors are on cuda:3"):
        pool.check_device(torch.device("cuda", 3))  # a forward on GPU 3: refused before any buffer is handed out
    pool.follow()  # a CPU pool follows no stream
    assert pool.take(WorkspaceShapes((4,), (4,), (1,), torch.float32)) is before


def test_shared_pools_are_one_thread_safe_registry():
    import copy
    import pickle
    import threading

    from moekit import workspace

    assert not hasattr(workspace, "_POOLS") and shared_pool("cpu") is workspace.SHARED_POOLS.get("cpu")
    registry, got = workspace.PoolRegistry(), []
    start = threading.Barrier(8)

    def ask():
        start.wait()
        got.append(registry.get("cpu"))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(p) for p in got}) == 1 and len(registry) == 1
    assert registry.get("meta") is not got[0] and len(registry) == 2
    for twin in (copy.deepcopy(registry), pickle.loads(pickle.dumps(registry))):
        assert len(twin) == 0 and twin.get("cpu").device == torch.device("cpu")
    registry.clear()
    assert len(registry) == 0


def _kernel_and_problem(pool=None):
    from moekit import ModularKernel
    from moekit.experts import TritonExperts
    from moekit.prepare_finalize import NoEPPrepareFinalize
    from moekit.testing import make_problem

    p = make_problem(4, E=4, topk=2, K=32, N=64, dtype=torch.float32)
    return ModularKernel(NoEPPrepareFinalize(), TritonExperts(), pool=pool), p


@pytest.mark.interpreter
def test_a_given_pool_on_another_device_is_named_at_the_door():
    from moekit.errors import InvalidInputError

    kernel, p = _kernel_and_problem(WorkspacePool("meta"))
    with pytest.raises(InvalidInputError, match="lives on meta"):
        kernel(*p.inputs())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_kernels_own_pool_follows_the_calls_device():
    from moekit.testing import assert_close, make_problem

    kernel, _ = _kernel_and_problem()
    for index in (0, 1, 0):
        p = make_problem(4, E=4, topk=2, K=32, N=64, dtype=torch.bfloat16, device=f"cuda:{index}")
        with torch.cuda.device(index):
            assert_close(kernel(*p.inputs()), p.reference(), dtype=torch.bfloat16)
        assert kernel.pool.device == torch.device("cuda", index)
