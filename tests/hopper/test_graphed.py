"""GraphedKernel: one CUDA graph per input signature, replayed; the plain forward without a GPU."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.errors import InvalidIdsError, InvalidInputError
from moekit.experts import TritonExperts
from moekit.hopper.graphed import GraphedKernel, _copy_in, graph_rows
from moekit.modular_kernel import ModularKernel
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.reference import moe_reference
from moekit.testing import assert_close, expect_raises, make_problem

on_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or moekit.device.interpreting(), reason="needs a CUDA GPU (CUDA graphs)"
)


def _kernel(**kw) -> ModularKernel:
    return ModularKernel(NoEPPrepareFinalize(), TritonExperts(), trace_counts=False, **kw)


def _fresh(p, seed):
    """The same layer (weights, map) with new per-token inputs."""
    q = make_problem(p.M, E=p.w1.shape[0], topk=p.topk_ids.shape[1], K=p.hidden.shape[1], N=p.w1.shape[1],
                     dtype=p.dtype, seed=seed, device=p.hidden.device)  # fmt: skip
    return q.hidden, p.w1, p.w2, q.topk_weights, q.topk_ids


def test_without_a_gpu_it_is_the_plain_forward(device):
    if device.type == "cuda":
        pytest.skip("the fallback is for machines without CUDA graphs")
    p = make_problem(9, device=device)
    graphed = GraphedKernel(_kernel())
    out = graphed(*p.inputs(), **p.options())
    assert graphed.last_mode.startswith("eager: no CUDA device")
    assert graphed.num_graphs == 0
    assert_close(out, p.reference(), dtype=p.dtype)


def test_bad_arguments_are_named(device):
    with expect_raises(InvalidInputError, "wraps a moekit.ModularKernel"):
        GraphedKernel(TritonExperts())
    with expect_raises(InvalidInputError, "max_graphs"):
        GraphedKernel(_kernel(), max_graphs=0)
    with expect_raises(InvalidInputError, "max_tokens"):
        GraphedKernel(_kernel(), max_tokens=0)
    p = make_problem(4, device=device)
    with expect_raises(InvalidInputError, "unknown options"):
        GraphedKernel(_kernel())(*p.inputs(), chunk_size=2)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("chunk_size", [None, 64])
def test_replays_match_the_plain_forward(chunk_size):
    p = make_problem(130, E=16, topk=4, K=256, N=512, device="cuda")
    plain, graphed = _kernel(chunk_size=chunk_size), GraphedKernel(_kernel(chunk_size=chunk_size))
    first = graphed(*p.inputs(), **p.options())
    assert graphed.last_mode == "captured"
    assert torch.equal(first, plain(*p.inputs(), **p.options()))  # the same kernels, the same bits
    for seed in (1, 2):
        args = _fresh(p, seed)
        out = graphed(*args, **p.options())
        assert graphed.last_mode == "replayed"
        assert torch.equal(out, plain(*args, **p.options()))
    assert torch.equal(first, plain(*p.inputs(), **p.options()))  # an earlier result is not overwritten


@pytest.mark.gpu
@on_gpu
def test_a_capture_that_grows_the_workspace_drops_the_graphs_before_it():
    # M=1 is captured, then a larger M grows the shared workspace: the first graph must not be left
    # reading the freed buffer; it is dropped, and recaptured on its next call.
    small = make_problem(1, E=16, topk=4, K=256, N=512, device="cuda")
    big = make_problem(2048, E=16, topk=4, K=256, N=512, device="cuda")
    big_args = (big.hidden, small.w1, small.w2, big.topk_weights, big.topk_ids)
    plain, graphed = _kernel(), GraphedKernel(_kernel(), max_graphs=4)
    graphed(*small.inputs())
    graphed(*big_args)
    assert graphed.num_graphs == 1
    for seed in (7, 8, 9):
        args = _fresh(small, seed)
        assert torch.equal(graphed(*args), plain(*args))
        assert torch.equal(graphed(*big_args), plain(*big_args))
        assert graphed.last_mode == "replayed"
    assert graphed.num_graphs == 2
    graphed.clear()  # every graph and its buffers go; the next call captures afresh
    assert graphed.num_graphs == 0 and torch.equal(graphed(*small.inputs()), plain(*small.inputs()))
    assert graphed.last_mode == "captured"


@pytest.mark.gpu
@on_gpu
def test_past_max_graphs_a_new_signature_runs_plain_and_weights_change_in_place():
    # Pushing a graph out for a new one would recapture on every call of layers that take turns.
    p = make_problem(8, E=16, topk=4, K=256, N=512, device="cuda")
    plain, graphed = _kernel(), GraphedKernel(_kernel(), max_graphs=1)
    graphed(*p.inputs())
    q = make_problem(16, E=16, topk=4, K=256, N=512, device="cuda")
    for _ in range(2):
        out = graphed(q.hidden, p.w1, p.w2, q.topk_weights, q.topk_ids)
        assert graphed.last_mode == "eager: max_graphs=1 graphs kept (clear() drops them)"
        assert torch.equal(out, plain(q.hidden, p.w1, p.w2, q.topk_weights, q.topk_ids))
    assert graphed.num_graphs == 1
    p.w1.mul_(0.5)  # in place: the graph reads the new values at the same address
    args = _fresh(p, 5)
    out = graphed(*args)
    assert graphed.last_mode == "replayed"
    assert torch.equal(out, plain(*args))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_the_settings_and_no_graph(how):
    import copy
    import pickle

    graphed = GraphedKernel(_kernel(chunk_size=4), max_graphs=3, max_tokens=32)
    twin = copy.deepcopy(graphed) if how == "deepcopy" else pickle.loads(pickle.dumps(graphed))
    assert (twin.max_graphs, twin.max_tokens, twin.kernel.chunk_size, twin.num_graphs) == (3, 32, 4, 0)
    assert twin.last_mode == "none" and twin.kernel is not graphed.kernel


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_copy_in_fills_the_graph_rows_and_empties_the_rest(device, ids_dtype):
    # One launch copies M rows of any strides into a graph's contiguous rows; rows past M become empty slots.
    for M, rows, K, topk in ((1, 1, 96, 2), (5, 8, 3000, 8), (7, 16, 64, 3)):  # K past one 2048-wide block
        hidden = torch.randn(K, M, device=device, dtype=torch.bfloat16).t()  # column-major
        weights = torch.rand(M, 2 * topk, device=device)[:, ::2]  # every other column
        ids = torch.randint(0, 9, (M, topk), device=device, dtype=ids_dtype)
        inputs = (torch.randn(rows, K, device=device).bfloat16(), torch.rand(rows, topk, device=device))
        inputs += (torch.randint(0, 9, (rows, topk), device=device, dtype=ids_dtype),)
        before = [t.clone() for t in inputs]
        _copy_in(inputs, hidden, weights, ids)
        assert torch.equal(inputs[0][:M], hidden) and torch.equal(inputs[1][:M], weights)
        assert torch.equal(inputs[2][:M], ids) and (inputs[2][M:] == -1).all()
        assert torch.equal(inputs[0][M:], before[0][M:])  # past M only the ids are read (as empty slots)


def test_graph_rows_round_up_to_a_power_of_two_up_to_max_tokens():
    assert [graph_rows(m, None) for m in (0, 1, 5, 3000)] == [None, 1, 5, 3000]
    assert [graph_rows(m, 16) for m in (0, 1, 2, 3, 5, 8, 9, 16, 17)] == [None, 1, 2, 4, 8, 8, 16, 16, None]
    assert [graph_rows(m, 24) for m in (17, 24, 25)] == [24, 24, None]  # not a power of two: its own rows


@pytest.mark.gpu
@on_gpu
def test_one_graph_serves_every_m_of_its_bucket():
    # M=8 is captured; 5, 7 and 3 tokens replay it with the rows past M empty (id -1), also after a
    # larger M wrote ids there; M=2 is another bucket; 17 is past max_tokens.
    p = make_problem(8, E=16, topk=4, K=256, N=512, device="cuda")
    plain, graphed = _kernel(), GraphedKernel(_kernel(), max_tokens=16)
    modes = []
    for seed, M in enumerate((8, 5, 5, 7, 8, 3, 3, 8, 2, 2, 17)):
        q = make_problem(M, E=16, topk=4, K=256, N=512, seed=100 + seed, device="cuda")
        args = (q.hidden, p.w1, p.w2, q.topk_weights, q.topk_ids)
        out, want = graphed(*args), plain(*args)
        modes.append(graphed.last_mode)
        if M in (8, 2) or not graphed.last_mode == "replayed":
            assert torch.equal(out, want), (M, graphed.last_mode)  # the same tiles: the same bits
        else:
            assert_close(out, want, dtype=p.dtype)
        assert_close(out, moe_reference(*args), dtype=p.dtype)
    checked, replayed = "eager: checked, the next call replays", "replayed"
    assert modes == ["captured", checked, replayed, checked, replayed, "captured", replayed, replayed,
                     "captured", replayed, "eager: M=17 > max_tokens=16"]  # fmt: skip
    assert graphed.num_graphs == 3


@pytest.mark.gpu
@on_gpu
def test_other_strides_share_the_graph_of_their_rows():
    p = make_problem(8, E=16, topk=4, K=256, N=512, device="cuda")
    plain, graphed = _kernel(), GraphedKernel(_kernel(), max_tokens=8)
    graphed(*p.inputs())
    wide = torch.randn(8, 512, device="cuda", dtype=p.dtype)[:, :256]  # rows 512 apart
    wide.copy_(_fresh(p, 1)[0])
    args = (wide, p.w1, p.w2, p.topk_weights, p.topk_ids)
    graphed(*args)
    assert graphed.last_mode == "eager: checked, the next call replays" and graphed.num_graphs == 1
    assert torch.equal(graphed(*args), plain(*args)) and graphed.last_mode == "replayed"


@pytest.mark.gpu
@on_gpu
def test_a_capture_that_fails_falls_back_and_is_not_retried(monkeypatch):
    p = make_problem(8, E=16, topk=4, K=256, N=512, device="cuda")
    real = ModularKernel.forward

    def syncing(self, *args, **kw):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a host sync inside the capture")
        return real(self, *args, **kw)

    monkeypatch.setattr(ModularKernel, "forward", syncing)
    graphed = GraphedKernel(_kernel())
    out = graphed(*p.inputs())
    assert graphed.last_mode.startswith("eager: capture failed (RuntimeError")
    assert graphed.num_graphs == 0
    assert torch.equal(out, real(_kernel(), *p.inputs()))
    graphed(*p.inputs())
    assert graphed.last_mode.startswith("eager: capture failed before")


@pytest.mark.gpu
@on_gpu
def test_a_replay_reads_the_map_and_scale_values_again():
    # The graph reads the map by address; a value written since the capture is checked before the replay.
    p = make_problem(8, E=16, topk=4, K=256, N=512, device="cuda").shard(0, 2)
    plain, graphed = _kernel(), GraphedKernel(_kernel())
    graphed(*p.inputs(), **p.options())
    p.expert_map[p.expert_map >= 0] = p.expert_map[p.expert_map >= 0].flip(0)  # a valid rebalance, in place
    assert torch.equal(graphed(*p.inputs(), **p.options()), plain(*p.inputs(), **p.options()))
    assert graphed.last_mode == "replayed"
    p.expert_map.data[0] = 8  # == E_local, without a version bump
    with expect_raises(InvalidIdsError, r"got \[8\] at global ids \[0\]"):
        graphed(*p.inputs(), **p.options())


@pytest.mark.gpu
@on_gpu
def test_an_owned_placement_replays_without_reading_its_values(monkeypatch):
    import moekit.hopper.graphed as graphed_module

    p = make_problem(8, E=16, topk=4, K=256, N=512, device="cuda").shard(1, 2)
    placement = moekit.owned_placement(p.expert_map, 8)
    plain, graphed = _kernel(), GraphedKernel(_kernel())
    graphed(*p.inputs(), expert_map=placement)
    reads = []
    monkeypatch.setattr(graphed_module, "check_map_values", lambda *a: reads.append(a))
    args = _fresh(p, 3)
    assert torch.equal(graphed(*args, expert_map=placement), plain(*args, expert_map=placement))
    assert graphed.last_mode == "replayed" and reads == []


@pytest.mark.gpu
@on_gpu
def test_an_owned_scale_replays_without_reading_its_values(monkeypatch):
    fp8 = moekit.QuantScheme.FP8_BLOCK
    p = make_problem(8, E=8, topk=2, K=256, N=512, quant=fp8, device="cuda")
    a2 = moekit.owned_scale(torch.full((1,), 0.02, device="cuda"))

    def kernel():
        return ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=fp8), trace_counts=False)

    plain, graphed = kernel(), GraphedKernel(kernel())
    graphed(*p.inputs(), **p.options(), a2_scale=a2)
    reads, isfinite = [], torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: reads.append(t) or isfinite(t))
    want = plain(*p.inputs(), **p.options(), a2_scale=a2)
    assert torch.equal(graphed(*p.inputs(), **p.options(), a2_scale=a2), want)
    assert graphed.last_mode == "replayed" and reads == []
