"""The triton_kernels peer: detection, its routing from ids, its weight layout and fused activation on
the CPU (checked against moekit's reference through matmul_ogs' documented semantics), the whole
peer against the reference on a GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from benchmarks.harness import peers, tk_peer
from moekit.device import get_device
from moekit.errors import InvalidInputError
from moekit.testing import assert_close, make_problem


def _problem(M=11, E=5, topk=2, K=64, N=96, seed=0, device="cpu"):
    return make_problem(M, E=E, topk=topk, K=K, N=N, dtype=torch.float32, seed=seed, device=device)


def test_route_from_ids_sorts_pairs_by_expert_and_inverts():
    p = _problem(M=13, E=6, topk=3)
    r = tk_peer.route_from_ids(p.topk_ids, p.topk_weights, 6)
    flat = p.topk_ids.flatten().long()
    assert r.combine.dtype == r.dispatch.dtype == r.counts.dtype == torch.int32
    assert torch.equal(r.combine.long(), torch.argsort(flat, stable=True))  # stable: pairs of one expert in order
    assert torch.equal(r.dispatch.long()[r.combine.long()], torch.arange(flat.numel()))
    assert r.counts.tolist() == torch.bincount(flat, minlength=6).tolist()
    assert torch.equal(r.gammas, p.topk_weights.flatten()[r.combine.long()])


def test_tk_weights_interleave_gate_and_up_by_column():
    p = _problem(E=3, K=8, N=10)
    w = tk_peer.to_tk_weights(p.w1, p.w2)
    assert w.w13.shape == (3, 8, 10) and w.w13.is_contiguous()
    assert w.w2t.shape == (3, 5, 8) and w.w2t.is_contiguous()
    assert torch.equal(w.w13[:, :, 0::2], p.w1[:, :5].transpose(1, 2))  # gates on even columns
    assert torch.equal(w.w13[:, :, 1::2], p.w1[:, 5:].transpose(1, 2))
    assert torch.equal(w.w2t, p.w2.transpose(1, 2))


def test_the_weight_copies_follow_the_weights_not_their_address():
    p = _problem(E=3, K=8, N=10)
    cache = tk_peer.WeightCache()
    first = cache.get(p.w1, p.w2)
    assert cache.get(p.w1, p.w2) is first
    p.w1.mul_(2.0)  # same tensor, same address, new values: what a freed-and-reused address also looks like
    again = cache.get(p.w1, p.w2)
    assert again is not first and torch.equal(again.w13[:, :, 0::2], p.w1[:, :5].transpose(1, 2))
    other = p.w2.clone()
    assert cache.get(p.w1, other) is not again
    cache.clear()
    assert cache.last is None


@triton.jit
def _apply_activation(X, Y, BM: tl.constexpr, BN: tl.constexpr):
    rows, cols = tl.arange(0, BM), tl.arange(0, BN)
    y = tk_peer.silu_mul_pairs(tl.load(X + rows[:, None] * BN + cols[None, :]))
    half = tl.arange(0, BN // 2)
    tl.store(Y + rows[:, None] * (BN // 2) + half[None, :], y)


def _activation(tile: torch.Tensor) -> torch.Tensor:
    out = torch.empty(tile.shape[0], tile.shape[1] // 2, dtype=torch.float32, device=tile.device)
    _apply_activation[(1,)](tile, out, BM=tile.shape[0], BN=tile.shape[1])
    return out


def test_fused_activation_reads_gates_on_even_columns():
    g = torch.Generator().manual_seed(1)
    tile = (torch.randn(16, 32, generator=g) * 3).to(get_device())
    got = _activation(tile).cpu()
    gate, up = tile.cpu()[:, 0::2], tile.cpu()[:, 1::2]
    assert_close(got, torch.nn.functional.silu(gate) * up, dtype=torch.float32)
    assert not torch.allclose(got, torch.nn.functional.silu(up) * gate, atol=1e-3)  # the swapped pairing differs


def _emulate(p, w: tk_peer.TkWeights, r: tk_peer.TkRouting) -> torch.Tensor:
    """matmul_ogs' documented semantics in torch: GEMM1 reads ``x[combine // topk]`` per expert's sorted
    rows and reduces column pairs; GEMM2 scales each row by gammas and sums into token ``combine // topk``."""
    topk = p.topk_ids.shape[1]
    out = torch.zeros(p.hidden.shape, dtype=torch.float32)
    start = 0
    for e, n in enumerate(r.counts.tolist()):
        rows = r.combine[start:start + n].long()
        h = p.hidden[rows // topk].float() @ w.w13[e].float()
        a = torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]
        out.index_add_(0, rows // topk, r.gammas[start:start + n, None] * (a @ w.w2t[e].float()))
        start += n
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_routing_and_layout_give_the_reference_through_matmul_ogs_semantics(seed):
    p = _problem(M=17, E=7, topk=3, K=32, N=48, seed=seed)
    out = _emulate(p, tk_peer.to_tk_weights(p.w1, p.w2), tk_peer.route_from_ids(p.topk_ids, p.topk_weights, 7))
    assert_close(out, p.reference(), dtype=torch.float32)


def test_an_unlocatable_package_skips_the_peer_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(tk_peer, "search_folders", lambda: [str(tmp_path)])
    monkeypatch.setattr(tk_peer.importlib, "import_module", _no_module)
    peer = peers.make_peer("triton_kernels", "bf16")
    assert peer.skipped.startswith("triton_kernels not importable")
    assert str(tmp_path) in peer.skipped and "no triton_kernels package" in peer.skipped
    with pytest.raises(InvalidInputError, match="skipped"):
        peer.run(_problem())


def _no_module(name):
    raise ModuleNotFoundError(f"No module named {name!r}")


def test_fp8_is_skipped_with_the_reason():
    assert "128x128" in peers.make_peer("triton_kernels", "fp8").skipped


def test_the_vendored_checkout_is_found_and_its_api_accepted():
    found = tk_peer.locate()
    if found.module is None:
        pytest.skip(found.reason)
    layer = tk_peer.TritonKernelsLayer(found.module)  # FnSpecs, FusedActivation, the ragged metadata: as expected
    assert layer.activation.specs.reduction_n == 2
    with pytest.raises(InvalidInputError, match="bf16"):
        layer(_problem())


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 100, 700])
def test_the_peer_gives_the_reference_on_a_gpu(M):
    peer = peers.make_peer("triton_kernels", "bf16")
    if peer.skipped:
        pytest.skip(peer.skipped)
    p = make_problem(M, E=16, topk=4, K=512, N=768, dtype=torch.bfloat16, seed=M, device="cuda")
    assert_close(peer.run(p), p.reference(), dtype=torch.bfloat16)
    first = peer.run.weights.last
    peer.run(p)
    assert peer.run.weights.last is first  # the copies are kept for the same weights
    peer.release()
    assert peer.run.weights.last is None
