"""count_expert_num_tokens vs moekit.reference.count_reference: exact equality, both methods."""

from __future__ import annotations

import threading

import pytest
import torch

import moekit
from moekit.errors import InvalidIdsError, InvalidInputError
from moekit.kernels import count as count_mod
from moekit.kernels.count import count_expert_num_tokens
from moekit.reference import count_reference
from moekit.routing import contiguous_expert_map
from moekit.testing import expect_raises

NUM_TOKENS = [1, 4, 8, 11, 19, 127, 128, 405, 1024, 3333, 7317]  # upstream's grid
TOPK = [2, 6, 8]
EP = [1, 2, 4]
E = 64
# The scan method runs E_local programs that each read every id: slow in the interpreter, so it
# gets a subsample of the grid that still covers every topk and every EP size.
SCAN_CASES = [(1, 2, 1), (4, 6, 2), (8, 8, 4), (11, 2, 1), (19, 6, 2), (127, 8, 4), (128, 2, 1),
              (405, 6, 2), (1024, 2, 4), (3333, 2, 2)]  # fmt: skip


def distinct_ids(M: int, E: int, topk: int, device, dtype=torch.int64) -> torch.Tensor:
    """Each row names ``topk`` distinct experts, as a router would (upstream's test inputs)."""
    return torch.rand(M, E).argsort(dim=1)[:, :topk].to(dtype).contiguous().to(device)


def maps(E: int, ep: int, device):
    if ep == 1:
        return [None]
    return [contiguous_expert_map(E, ep, r, device=device) for r in range(ep)]


def check(ids, num_local, emap=None, *, method):
    out = count_expert_num_tokens(ids, num_local, emap, method=method)
    expected = count_reference(ids, num_local, emap)
    assert out.dtype == torch.int32 and out.shape == (num_local,)
    assert out.device == ids.device
    assert torch.equal(out.cpu(), expected.cpu()), f"{method}: {out.tolist()} != {expected.tolist()}"
    return out


@pytest.mark.parametrize("ep", EP)
@pytest.mark.parametrize("topk", TOPK)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_histogram_upstream_grid(num_tokens, topk, ep, device):
    ids = distinct_ids(num_tokens, E, topk, device)
    for emap in maps(E, ep, device):
        check(ids, E // ep, emap, method="histogram")
        if emap is not None:  # upstream's second check: the no-map path on host-premapped ids
            check(emap.long()[ids].to(ids.dtype), E // ep, method="histogram")


@pytest.mark.parametrize("num_tokens,topk,ep", SCAN_CASES)
def test_scan_upstream_subsample(num_tokens, topk, ep, device):
    ids = distinct_ids(num_tokens, E, topk, device)
    for emap in maps(E, ep, device):
        check(ids, E // ep, emap, method="scan")


@pytest.mark.parametrize("method", ["histogram", "scan"])
class TestEdgeCases:
    def test_worked_example(self, method, device):
        ids = torch.tensor([[0, 3], [3, -1], [5, 1]], device=device)
        emap = torch.tensor([-1, -1, -1, 0, 1, 2], device=device)
        assert count_expert_num_tokens(ids, 3, emap, method=method).tolist() == [2, 0, 1]
        assert count_expert_num_tokens(ids, 3, method=method).tolist() == [1, 1, 0]

    def test_minus_one_with_map(self, method, device):
        # -1 must never index expert_map[-1] (which here would be local expert 7 of rank 1).
        ids = torch.full((37, 4), -1, dtype=torch.int64, device=device)
        ids[::3, 1] = 9
        emap = contiguous_expert_map(16, 2, 1, device=device)
        out = check(ids, 8, emap, method=method)
        assert out[1] == 13 and out.sum() == 13

    def test_empty_returns_zeros(self, method, device):
        for shape in [(0, 8), (0,), (5, 0)]:
            ids = torch.empty(shape, dtype=torch.int32, device=device)
            out = count_expert_num_tokens(ids, 6, method=method)
            assert out.dtype == torch.int32 and out.tolist() == [0] * 6

    def test_ids_beyond_the_map_are_ignored(self, method, device):
        emap = contiguous_expert_map(8, 2, 0, device=device)  # global 0..3 -> local 0..3
        ids = torch.tensor([[0, 8], [1, 1000], [2, 2**40]], device=device)
        assert check(ids, 4, emap, method=method).tolist() == [1, 1, 1, 0]

    def test_ids_beyond_num_local_without_map_are_ignored(self, method, device):
        # int64 2**32 + 1 would wrap to 1 if the kernel cast to int32 before comparing.
        ids = torch.tensor([[0, 5], [1, 2**32 + 1], [6, -7]], device=device)
        assert check(ids, 4, method=method).tolist() == [1, 1, 0, 0]

    def test_map_entries_outside_local_range_are_ignored(self, method, device):
        emap = torch.tensor([0, 5, -3, 1], dtype=torch.int32, device=device)
        ids = torch.tensor([0, 1, 2, 3, 3], device=device)
        assert check(ids, 2, emap, method=method).tolist() == [1, 2]

    @pytest.mark.parametrize("E_,ep", [(7, 1), (60, 1), (60, 2), (60, 4), (32, 32), (1, 1)])
    def test_non_power_of_two_and_single_local_expert(self, method, E_, ep, device):
        ids = torch.randint(-1, E_, (19, 3), device=device)
        for emap in maps(E_, ep, device):
            check(ids, E_ // ep, emap, method=method)

    @pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
    @pytest.mark.parametrize("map_dtype", [torch.int32, torch.int64])
    def test_id_and_map_dtypes(self, method, ids_dtype, map_dtype, device):
        ids = torch.randint(-1, 24, (33, 6), dtype=ids_dtype, device=device)
        emap = contiguous_expert_map(24, 3, 2, device=device).to(map_dtype)
        check(ids, 8, emap, method=method)
        check(ids, 24, method=method)

    def test_duplicates_in_a_row_count_per_slot(self, method, device):
        ids = torch.tensor([[2, 2, 2], [2, 0, 0]], device=device)
        assert check(ids, 3, method=method).tolist() == [2, 0, 4]

    @pytest.mark.parametrize("numel", [1, 2, 3, 1023, 1024, 1025])
    def test_numel(self, method, numel, device):
        ids = torch.randint(-1, 32, (numel,), device=device)
        for emap in maps(32, 2, device):
            check(ids, 16, emap, method=method)

    def test_one_dimensional_ids(self, method, device):
        ids = torch.randint(0, 5, (50,), device=device)
        check(ids, 5, method=method)

    @pytest.mark.parametrize(
        "bad",
        [
            lambda d: torch.zeros(4, 2, dtype=torch.uint8, device=d),
            lambda d: torch.zeros(4, 2, dtype=torch.float32, device=d),
            lambda d: torch.zeros(4, 4, dtype=torch.int32, device=d)[:, ::2],
            lambda d: torch.zeros(2, 2, 2, dtype=torch.int32, device=d),
            lambda d: torch.zeros((), dtype=torch.int32, device=d),
            lambda d: [[0, 1]],
        ],
        ids=["unsigned", "float", "non-contiguous", "3-D", "0-D", "list"],
    )
    def test_bad_ids_raise(self, method, bad, device):
        with pytest.raises(InvalidIdsError):
            count_expert_num_tokens(bad(device), 4, method=method)

    def test_bad_maps_raise(self, method, device):
        ids = torch.zeros(3, 2, dtype=torch.int32, device=device)
        for emap in [
            torch.zeros(8, dtype=torch.uint8, device=device),
            torch.zeros(8, dtype=torch.float32, device=device),
            torch.zeros(2, 4, dtype=torch.int32, device=device),
            torch.zeros(16, dtype=torch.int32, device=device)[::2],
            torch.zeros(8, dtype=torch.int32, device="meta"),
        ]:
            with pytest.raises(InvalidIdsError):
                count_expert_num_tokens(ids, 4, emap, method=method)

    @pytest.mark.parametrize("num_local", [0, -1, 2.0, True, None])
    def test_bad_num_local_raises(self, method, num_local, device):
        ids = torch.zeros(3, 2, dtype=torch.int32, device=device)
        with pytest.raises(InvalidInputError, match="num_local_experts"):
            count_expert_num_tokens(ids, num_local, method=method)

    def test_deterministic(self, method, device):
        ids = distinct_ids(1200 if method == "histogram" else 64, 48, 8, device)  # several programs
        emap = contiguous_expert_map(48, 2, 1, device=device)
        runs = {tuple(count_expert_num_tokens(ids, 24, emap, method=method).tolist()) for _ in range(10)}
        assert len(runs) == 1


def test_unknown_method_raises(device):
    ids = torch.zeros(3, 2, dtype=torch.int32, device=device)
    with pytest.raises(InvalidInputError, match="method"):
        count_expert_num_tokens(ids, 4, method="bincount")


def test_meta_device_ids_raise():
    with pytest.raises(InvalidInputError, match="meta"):
        count_expert_num_tokens(torch.zeros(3, 2, dtype=torch.int32, device="meta"), 4)


@pytest.mark.parametrize("numel", [4097, 20000, 3 * 4096])
def test_several_programs_stride_over_tiles(numel, device):
    # Past one 4096-id tile the histogram takes several programs (4 under the interpreter), each
    # striding over every 4th tile and adding its partial histogram into a zero-filled output.
    ids = torch.randint(-1, 70, (numel,), device=device)
    for num_local, emap in [(64, None), (32, contiguous_expert_map(64, 2, 1, device=device)), (31, None)]:
        check(ids, num_local, emap, method="histogram")


def test_sentinel_bin_fallback(device):
    # Triton releases whose tl.histogram has no `mask` send invalid ids to a spare bin instead.
    ids = torch.randint(-1, 70, (5000, 2), device=device)
    for num_local, emap in [(64, None), (32, contiguous_expert_map(64, 2, 1, device=device)), (31, None), (32, None)]:
        out = count_mod.launch_count(ids, num_local, emap, masked=False)
        assert torch.equal(out.cpu(), count_reference(ids, num_local, emap).cpu())


@pytest.mark.skipif(not moekit.device.interpreting(), reason="simulates a Ctrl-C inside the interpreter's grid loop")
def test_an_interrupted_count_leaves_nothing_behind(monkeypatch, device):
    # A count used to keep a reusable scratch that an interrupted launch left dirty, so every later
    # multi-program count in the process was wrong. A Ctrl-C in Jupyter lands inside the
    # interpreter's loop over programs: raise there, after the first program ran.
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_grid_idx = builder.set_grid_idx

    def interrupt_after_first_program(x, y, z):
        if x > 0:
            raise KeyboardInterrupt
        set_grid_idx(x, y, z)

    ids = torch.randint(-1, 64, (9000, 2), device=device)
    monkeypatch.setattr(builder, "set_grid_idx", interrupt_after_first_program)
    with pytest.raises(KeyboardInterrupt):
        count_expert_num_tokens(ids, 64)
    monkeypatch.undo()
    for _ in range(3):
        check(ids, 64, method="histogram")
        check(ids[:100], 64, method="histogram")


def test_counts_from_several_threads(device):
    cases = [torch.randint(-1, 40, (n, 4), device=device) for n in (50, 3000, 2000, 7)]
    results = [None] * len(cases)

    def work(i):
        results[i] = count_expert_num_tokens(cases[i], 40)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ids, got in zip(cases, results, strict=True):
        assert torch.equal(got.cpu(), count_reference(ids, 40).cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["histogram", "scan"])
@pytest.mark.parametrize("M,topk,E_,ep", [(65536, 8, 256, 1), (262144, 8, 256, 8), (16384, 6, 64, 4), (128, 8, 64, 1)])
def test_large_on_gpu(method, M, topk, E_, ep):
    ids = torch.randint(-1, E_, (M, topk), device="cuda", dtype=torch.int32)
    for emap in maps(E_, ep, "cuda")[:2]:
        for _ in range(2):
            check(ids, E_ // ep, emap, method=method)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [128, 4096, 262144])  # one program (stores), several (zero-fill + atomics)
def test_cuda_graph_capture_on_gpu(M):
    ids = torch.randint(-1, 256, (M, 8), device="cuda", dtype=torch.int32)
    expected = count_reference(ids, 256)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        count_expert_num_tokens(ids, 256)  # compiled before capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = [count_expert_num_tokens(ids, 256) for _ in range(3)]
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, expected) for o in outs)


@pytest.mark.gpu
def test_two_streams_on_gpu():
    ids = [torch.randint(-1, 256, (65536, 8), device="cuda", dtype=torch.int32) for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(20):
        for k in range(2):
            with torch.cuda.stream(streams[k]):
                outs[k].append(count_expert_num_tokens(ids[k], 256))
    torch.cuda.synchronize()
    for k in range(2):
        assert all(torch.equal(o, count_reference(ids[k], 256)) for o in outs[k])


@pytest.mark.gpu
def test_map_on_other_device_raises_on_gpu():
    ids = torch.zeros(3, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(InvalidIdsError):
        count_expert_num_tokens(ids, 4, torch.zeros(8, dtype=torch.int32))


@pytest.mark.gpu
def test_cpu_ids_rejected_when_compiling():
    with pytest.raises(InvalidInputError, match="CPU"):
        count_expert_num_tokens(torch.zeros(3, 2, dtype=torch.int32), 4)


def test_an_absurd_number_of_local_experts_is_named_before_anything_is_allocated(device):
    with expect_raises(InvalidInputError, match="num_local_experts must be at most"):
        moekit.count_expert_num_tokens(torch.tensor([[0, 1]], dtype=torch.int32, device=device), 2**40)


@pytest.mark.parametrize("method", ["histogram", "scan"])
def test_the_documented_maximum_of_experts_is_counted_and_one_more_is_named(method, device):
    # Before: E >= 2**20 passed the door and Triton raised "numel exceeds triton maximum tensor numel".
    from moekit.validate import MAX_EXPERTS

    ids = torch.randint(-1, MAX_EXPERTS, (64, 4), dtype=torch.int32, device=device)
    ids[0, 0] = MAX_EXPERTS - 1  # the last expert is used
    check(ids, MAX_EXPERTS, method=method)
    emap = maps(MAX_EXPERTS, 4, device)[3]
    check(ids, MAX_EXPERTS // 4, emap, method=method)
    with expect_raises(InvalidInputError, match=f"num_local_experts must be at most {MAX_EXPERTS}"):
        count_expert_num_tokens(ids, MAX_EXPERTS + 1, method=method)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_local", [32, 64])
def test_map_entries_past_the_local_experts_never_reach_the_histogram(num_local):
    # On a GPU tl.histogram keeps only the low bits of a value past its bins: a map entry equal to
    # num_local (a power of two, so the bins end there) would be counted as local expert 0. The
    # interpreter drops such values, so the answer alone cannot show it: the probe sees each value.
    from moekit.workbook.probes import watch_memory

    E = 2 * num_local
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[:num_local] = torch.arange(num_local, dtype=torch.int32)
    emap[num_local], emap[num_local + 1] = num_local, num_local + 5  # bad entries, ignored by the kernel
    ids = torch.randint(0, E, (300, 4), dtype=torch.int32)
    out = torch.empty(num_local, dtype=torch.int32)
    with watch_memory(ids=ids, map=emap, out=out) as ops:
        count_mod.launch_count(ids, num_local, emap, out=out)
    assert ops.histogram_misses == [], ops.histogram_misses[:3]
    assert torch.equal(out, count_reference(ids, num_local, emap))
