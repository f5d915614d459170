import importlib

import pytest
import torch

import moekit
import moekit.experts as experts
from moekit.api import BY_NAME, experts_class
from moekit.errors import ChunkSizeError, InvalidIdsError, InvalidInputError
from moekit.experts import Experts
from moekit.quant import (
    FP8,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.reference import moe_reference
from moekit.testing import assert_close


def layer(M=24, E=8, topk=2, K=128, N=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w1 = torch.randn(E, N, K, generator=g) / K**0.5
    w2 = torch.randn(E, K, N // 2, generator=g) / (N // 2) ** 0.5
    tw, ti = moekit.routing.skewed_router(M, E, topk, seed=seed, device="cpu")
    return x, w1, w2, tw, ti


@pytest.mark.interpreter
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_fused_moe_triton_matches_reference(chunk_size):
    x, w1, w2, tw, ti = layer()
    out = moekit.fused_moe(x, w1, w2, tw, ti, chunk_size=chunk_size)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, moe_reference(x, w1, w2, tw, ti), dtype=torch.float32)


@pytest.mark.interpreter
def test_fused_moe_fp8_weights_select_fp8_block():
    x, w1, w2, tw, ti = layer(M=9, E=4)
    q1, s1 = quantize_fp8_block(w1)
    q2, s2 = quantize_fp8_block(w2)
    out = moekit.fused_moe(x, q1, q2, tw, ti, experts="triton", w1_scale=s1, w2_scale=s2)
    xd = dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(x))
    ref = moe_reference(xd, dequantize_fp8_block(q1, s1), dequantize_fp8_block(q2, s2), tw, ti)
    assert_close(out, ref, dtype=FP8)


def test_fused_moe_names_bad_arguments():
    x, w1, w2, tw, ti = layer(M=4)
    with pytest.raises(InvalidInputError, match="experts must be one of"):
        moekit.fused_moe(x, w1, w2, tw, ti, experts="cutlass")
    with pytest.raises(ChunkSizeError):
        moekit.fused_moe(x, w1, w2, tw, ti, chunk_size=0)
    with pytest.raises(ChunkSizeError):
        moekit.fused_moe(x, w1, w2, tw, ti, chunk_size=[8])
    with pytest.raises(InvalidInputError, match="global_num_experts"):
        moekit.fused_moe(x, w1, w2, tw, ti, global_num_experts="8")
    with pytest.raises(InvalidInputError, match="experts must be one of"):
        moekit.fused_moe(x, w1, w2, tw, ti, experts=["triton"])
    with pytest.raises(InvalidInputError, match="replay must be True or False"):
        moekit.fused_moe(x, w1, w2, tw, ti, replay="yes")


@pytest.mark.interpreter
@pytest.mark.parametrize("first, then", [(1, True), (4, 4.0)])
def test_the_kernel_cache_never_lets_a_bad_chunk_size_through(first, then):
    # True == 1 and 4.0 == 4 as dict keys: validating after the cache lookup let them pass.
    x, w1, w2, tw, ti = layer(M=4)
    moekit.fused_moe(x, w1, w2, tw, ti, chunk_size=first)
    with pytest.raises(ChunkSizeError):
        moekit.fused_moe(x, w1, w2, tw, ti, chunk_size=then)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or moekit.device.interpreting(), reason="needs a CUDA GPU")
def test_fused_moe_replays_a_graph_up_to_replay_max_tokens():
    from moekit import api
    from moekit.testing import make_problem
    from moekit.types import QuantScheme

    p = make_problem(6, E=16, topk=4, K=256, N=512, device="cuda")
    graphed = api.KERNELS.get("triton", None, QuantScheme.NONE, p.hidden.device, replay=True)
    plain = api.KERNELS.get("triton", None, QuantScheme.NONE, p.hidden.device)
    graphed.clear()
    modes = []
    for seed, M in enumerate((6, 6, 129)):
        q = make_problem(M, E=16, topk=4, K=256, N=512, seed=seed + 1, device="cuda")
        args = (q.hidden, p.w1, p.w2, q.topk_weights, q.topk_ids)
        out = moekit.fused_moe(*args)
        modes.append(graphed.last_mode)
        assert_close(out, moe_reference(*args), dtype=p.dtype)
        assert torch.equal(moekit.fused_moe(*args, replay=False), plain(*args))
    assert modes == ["captured", "replayed", f"eager: M=129 > max_tokens={api.REPLAY_MAX_TOKENS}"]
    assert graphed.max_tokens == 128 and graphed.kernel is not plain


def test_ids_beyond_the_experts_are_named_on_the_cpu():
    x, w1, w2, tw, ti = layer(M=4, E=4)
    with pytest.raises(InvalidIdsError, match=r"in \[0, global_num_experts=4\)"):
        moekit.fused_moe(x, w1, w2, tw, ti + 10)  # used to return zeros for those slots, silently


@pytest.mark.interpreter
def test_many_chunk_sizes_keep_a_bounded_cache_and_one_pool():
    from moekit import api
    from moekit.workspace import shared_pool

    x, w1, w2, tw, ti = layer(M=3, E=4, K=32, N=64)
    for C in range(1, 31):
        moekit.fused_moe(x, w1, w2, tw, ti, chunk_size=C)
    assert len(api.KERNELS.kernels()) <= api.KERNELS.size == 16
    assert {id(k.pool) for k in api.KERNELS.kernels()} == {id(shared_pool(x.device))}


def test_the_kernel_cache_is_one_thread_safe_object():
    # Issue 25, item 7: module state became a documented object with a lock.
    import threading

    from moekit import api
    from moekit.types import QuantScheme

    assert not hasattr(api, "_KERNELS") and isinstance(api.KERNELS, api.KernelCache)
    cache, got = api.KernelCache(size=3), []
    start = threading.Barrier(8)

    def ask(i):
        start.wait()
        got.append(cache.get("triton", 1 + i % 2, QuantScheme.NONE, torch.device("cpu")))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(k) for k in got}) == 2 and len(cache.kernels()) == 2  # one kernel per key, never two
    for C in (3, 4, 5):
        cache.get("triton", C, QuantScheme.NONE, torch.device("cpu"))
    assert [k.chunk_size for k in cache.kernels()] == [3, 4, 5]  # least recently used went first


@pytest.mark.interpreter
def test_two_threads_share_the_cached_kernel_correctly():
    # Two threads with the same chunk size share one kernel and its pool: they take turns.
    import threading

    problems = [layer(M=20, E=4, K=32, N=64, seed=s) for s in (1, 2)]
    outs = [None, None]

    def work(i):
        for _ in range(3):
            outs[i] = moekit.fused_moe(*problems[i], chunk_size=8)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (x, w1, w2, tw, ti), out in zip(problems, outs, strict=True):
        assert_close(out, moe_reference(x, w1, w2, tw, ti), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# The registry of short names


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_every_short_name_builds_its_class(name):
    cls = experts_class(name)
    wing = name == "triton" and moekit.device.is_hopper()  # "triton" is the wing's class on a Hopper GPU
    assert issubclass(cls, Experts) and cls.__name__ == ("HopperTritonExperts" if wing else BY_NAME[name])
    if wing:
        return
    assert cls is getattr(
        importlib.import_module("moekit.hopper.experts" if name == "hopper" else "moekit.experts"), BY_NAME[name]
    )  # the same class as `from moekit.experts import ...`


def test_the_registry_names_standard_format_classes_only():
    assert set(BY_NAME) == {"triton", "hopper", "deep_gemm", "triton_or_deep_gemm", "grouped_mm"}
    assert set(BY_NAME.values()) - {"HopperTritonExperts"} <= set(experts.__all__)
    assert "NaiveBatchedExperts" not in BY_NAME.values() and "BatchedTritonExperts" not in BY_NAME.values()


def test_unknown_names_are_named_with_the_choices():
    choices = r"\['deep_gemm', 'grouped_mm', 'hopper', 'triton', "
    with pytest.raises(InvalidInputError, match=r"experts must be one of " + choices):
        experts_class("cutlass")
    with pytest.raises(InvalidInputError, match="got 3"):
        experts_class(3)


def test_a_caller_can_offer_a_subset_under_its_own_argument_name():
    from moekit.hopper.experts import HopperTritonExperts

    book_or_wing = HopperTritonExperts if moekit.device.is_hopper() else experts.TritonExperts
    assert experts_class("triton", among=("triton",)) is book_or_wing
    with pytest.raises(InvalidInputError, match=r"^fp8_experts must be one of \['triton'\], got 'grouped_mm'$"):
        experts_class("grouped_mm", among=("triton",), what="fp8_experts")
    with pytest.raises(InvalidInputError, match=r"among must hold names of moekit.api.BY_NAME .*got \['cutlass'\]"):
        experts_class("triton", among=("triton", "cutlass"))
