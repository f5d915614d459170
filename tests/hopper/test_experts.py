"""The wing's HopperTritonExperts against the book's TritonExperts: the same layer, within the dtype's
tolerance, for every path the wing adds (pair blocks at decode, the one-launch aligns, the fused
activation, fp8, expert maps, token and row chunks), under the interpreter and on the GPU."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.api import experts_class
from moekit.experts import TritonExperts
from moekit.hopper.experts import HopperTritonExperts
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.quant import quantize_fp8_block
from moekit.testing import assert_close
from moekit.types import QuantScheme

FP8 = QuantScheme.FP8_BLOCK
FP8_DTYPE = torch.float8_e4m3fn


def _layer(device, M, E, topk, K, N, *, mapped=False):
    x = torch.randn(M, K, device=device)
    w1 = torch.randn(E, N, K, device=device) / K**0.5
    w2 = torch.randn(E, K, N // 2, device=device) / N**0.5
    weights, ids = moekit.routing.route(torch.randn(M, 2 * E if mapped else E, device=device), topk)
    kw = {}
    if mapped:  # rank 1 of 2: global experts E..2E-1 live here
        emap = torch.full((2 * E,), -1, dtype=torch.int32, device=device)
        emap[E:] = torch.arange(E, dtype=torch.int32, device=device)
        kw = dict(expert_map=emap, global_num_experts=2 * E)
    return x, w1, w2, weights, ids, kw


def _both(wing, book, args, *, chunk_size=None, chunk_by="tokens", **kw):
    outs = []
    for experts in (wing, book):
        kernel = moekit.ModularKernel(NoEPPrepareFinalize(), experts, chunk_size=chunk_size, chunk_by=chunk_by)
        outs.append(kernel(*args, **kw))
    return outs


# M=1 and 8 take the pair blocks (<= 16 pairs), 40 the one-program align, 300 the one-launch align,
# 700 (at topk 2, 1400 pairs) the three-launch align.
@pytest.mark.parametrize("M", [1, 8, 40, 300, 700])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mapped", [False, True])
def test_the_wing_computes_what_the_book_computes(device, M, fused, mapped):
    dtype = torch.bfloat16
    x, w1, w2, weights, ids, kw = _layer(device, M, 8, 2, 128, 128, mapped=mapped)
    args = (x.to(dtype), w1.to(dtype), w2.to(dtype), weights, ids)
    wing, book = _both(HopperTritonExperts(fuse_activation=fused), TritonExperts(), args, **kw)
    assert_close(wing, book, dtype=dtype)


@pytest.mark.parametrize("chunk_by, chunk_size", [("tokens", 48), ("rows", 128)])
@pytest.mark.parametrize("fused", [False, True])
def test_chunks_too(device, chunk_by, chunk_size, fused):
    x, w1, w2, weights, ids, _ = _layer(device, 150, 8, 2, 128, 128)
    wing, book = _both(HopperTritonExperts(fuse_activation=fused), TritonExperts(), (x, w1, w2, weights, ids),
                       chunk_size=chunk_size, chunk_by=chunk_by)  # fmt: skip
    assert_close(wing, book, dtype=torch.float32)


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_block(device, fused):
    x, w1, w2, weights, ids, _ = _layer(device, 33, 4, 2, 256, 512)
    (q1, s1), (q2, s2) = quantize_fp8_block(w1), quantize_fp8_block(w2)
    args = (x.bfloat16(), q1, q2, weights, ids)
    wing, book = _both(HopperTritonExperts(quant=FP8, fuse_activation=fused), TritonExperts(quant=FP8), args,
                       chunk_size=16, w1_scale=s1, w2_scale=s2)  # fmt: skip
    assert_close(wing, book, dtype=FP8_DTYPE)  # the activation is requantized to fp8 on both sides


def test_the_short_name_picks_the_wing_on_hopper_only():
    want = HopperTritonExperts if moekit.device.is_hopper() else TritonExperts
    assert experts_class("triton") is want and experts_class("hopper") is HopperTritonExperts
    assert issubclass(HopperTritonExperts, TritonExperts)


@pytest.mark.gpu
def test_bit_identical_where_the_order_of_summation_is_the_same(device):
    """On the GPU both classes launch one program per tile with the same tiles when the wing is
    handed the book's tiles: then every output element is summed in the same order."""
    x, w1, w2, weights, ids, _ = _layer(device, 256, 8, 2, 256, 256)
    book = TritonExperts()

    class SameTiles(HopperTritonExperts):
        def tile_configs(self, problem, dtype):
            from moekit.hopper.configs import KernelConfig

            t = book.tile_configs(problem, dtype)[0]
            cfg = KernelConfig(t.BLOCK_M, t.BLOCK_N, t.BLOCK_K, t.GROUP_M, t.num_warps, t.num_stages)
            return cfg, cfg

    args = (x.bfloat16(), w1.bfloat16(), w2.bfloat16(), weights, ids)
    wing, ref = _both(SameTiles(), book, args)
    assert torch.equal(wing, ref)


def test_the_wing_relaunches_the_books_count_and_activation(device, monkeypatch):
    """Each chunk's count and activation are the book's kernels, relaunched by the wing (run_lean)
    and not launched a second time by the book's own launchers."""
    import moekit.hopper.experts as wing
    import moekit.kernels.activation as activation
    import moekit.kernels.count as count

    relaunched, plain = [], []
    real = wing.run_lean
    monkeypatch.setattr(wing, "run_lean", lambda launch, **kw: relaunched.append(launch.kernel) or real(launch, **kw))
    for module, name in ((count, "launch_count"), (activation, "launch_silu_and_mul")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, **k: plain.append(_f) or _f(*a, **k))
    x, w1, w2, weights, ids, _ = _layer(device, 40, 8, 2, 128, 128)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), HopperTritonExperts(), chunk_size=20)
    out = kernel(x, w1, w2, weights, ids)
    kinds = [getattr(k, "fn", k).__name__ for k in relaunched]
    assert kinds.count("_count_histogram_kernel") == 2 and kinds.count("_silu_and_mul_kernel") == 2, kinds
    assert plain == [] and all(r.counts is not None for r in kernel.last_trace.chunks)
    assert_close(out, moekit.reference.moe_reference(x, w1, w2, weights, ids), dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or moekit.device.interpreting(), reason="needs a CUDA GPU")
def test_inference_tensors_and_recycled_addresses_launch_lean_and_right():
    # Under the suite's verifying() (tests/conftest.py) each lean launch is checked against Triton's
    # binder: inference tensors (no version counter) and new tensors at freed addresses, in turn.
    from moekit.testing import make_problem

    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), HopperTritonExperts(), chunk_size=8)
    for step in range(6):
        with torch.inference_mode(step % 2 == 0):
            dtype = (torch.bfloat16, torch.float16, torch.float32)[step % 3]
            p = make_problem(5 + 7 * step, E=8, topk=2, K=128, N=256, dtype=dtype, seed=step, device="cuda")
            p = p.shard(step % 2, 2)
            p.check(kernel(*p.inputs(), **p.options()))
        del p  # the next step's tensors may take these addresses
