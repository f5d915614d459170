"""CPU tests of the benchmark harness: the grouped_mm peer, the problem and its oracle, and every
subcommand's orchestration with the GPU timers replaced by fakes."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from benchmarks.harness import chunking, common, count, layer, measure, peers, problem
from moekit import roofline
from moekit.errors import InvalidInputError
from moekit.quant import FP8
from moekit.testing import assert_close, make_problem

TINY = roofline.LayerShape("tiny", E=6, topk=2, K=256, I=128)


def _routing(M, E, topk, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).to(torch.int32)
    weights = torch.rand(M, topk, generator=g) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


def test_permute_by_expert_groups_pairs():
    weights, ids = _routing(M=9, E=5, topk=2)
    perm = peers.permute_by_expert(ids, 5)
    flat = ids.flatten().long()
    sorted_ids = flat[perm.order]
    assert torch.all(sorted_ids[1:] >= sorted_ids[:-1])
    counts = torch.bincount(flat, minlength=5)
    assert perm.offsets.dtype == torch.int32
    assert perm.offsets.tolist() == torch.cumsum(counts, 0).tolist()
    assert torch.equal(perm.token, perm.order // 2)


def test_unpermute_and_reduce_weights_and_sums():
    weights, ids = _routing(M=6, E=4, topk=3, seed=1)
    perm = peers.permute_by_expert(ids, 4)
    per_pair = torch.randn(6 * 3, 7)  # rows in (token, slot) order
    out = peers.unpermute_and_reduce(per_pair[perm.order], perm, weights)
    expected = (per_pair.view(6, 3, 7) * weights.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out, expected)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize(("M", "E", "topk", "K", "I"), [(16, 8, 2, 64, 32), (5, 7, 3, 48, 16)])
def test_grouped_mm_peer_matches_reference(M, E, topk, K, I):
    p = make_problem(M, E=E, topk=topk, K=K, N=2 * I, seed=M, device="cpu")
    out = peers.grouped_mm_moe(p)
    assert out.shape == (M, K) and out.dtype == torch.bfloat16
    assert_close(out, p.reference(), dtype=torch.bfloat16)


def test_grouped_mm_peer_refuses_fp8_and_skips_politely():
    p = peers.make_peer("grouped_mm", "fp8")
    assert p.skipped and "bf16" in p.skipped
    with pytest.raises(InvalidInputError, match="skipped"):
        p.run(None)
    with pytest.raises(InvalidInputError, match="peer must be one of"):
        peers.make_peer("cublas", "bf16")
    assert peers.make_peer("deep_gemm", "bf16").skipped
    with pytest.raises(InvalidInputError, match="dtype must be one of"):
        common.quant_of("int4")


def test_sample_rows_and_rel_error():
    assert measure.sample_rows(5, 8).tolist() == [0, 1, 2, 3, 4]
    rows = measure.sample_rows(1000, 16)
    assert rows[0] == 0 and rows[-1] == 999 and len(rows) == 16
    ref = torch.randn(4, 8)
    assert measure.rel_error(ref, ref) == 0.0
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert not measure.rel_error(bad, ref) <= 1.0  # NaN never passes


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_problem_and_blocked_reference(dtype):
    x = problem.build_problem(TINY, 10, dtype, seed=1, device="cpu")
    assert x.w1.shape == (6, 256, 256) and x.w2.shape == (6, 256, 128) and x.hidden.dtype == torch.bfloat16
    if dtype == "fp8":
        assert x.w1.dtype == FP8 and x.w1_scale.shape == (6, 2, 2)
    rows = torch.tensor([0, 3, 9])
    want = problem.restrict(x, rows).reference()  # fp8: on the fp8-rounded activations
    torch.testing.assert_close(problem.reference_for(x, rows), want)
    blocked = problem.blockwise_reference(problem.restrict(x, rows), block=4)  # 4 does not divide E=6
    torch.testing.assert_close(blocked, want, rtol=1e-5, atol=1e-5)
    assert want.abs().mean() > 0.05  # 1/sqrt(fan_in) scaling keeps outputs O(1), not tiny

    other = problem.with_tokens(x, 7, router="skewed", seed=5)
    assert other.w1 is x.w1 and other.w1_scale is x.w1_scale  # same weights, new tokens
    assert other.hidden.shape == (7, 256) and other.topk_ids.shape == (7, 2) and other.quant is x.quant


@pytest.mark.interpreter
def test_layer_dry_run_and_cpu_refusal(capsys):
    assert layer.main(["--shape", "deepseek_v3", "--M", "16384", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "14613.8" in out and "23200" in out and "<= 18000 us" in out
    assert layer.main(["--M", "1"]) == 2  # no GPU here: a clear refusal, not a traceback
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        layer.parse(["--peers", "cublas"])


def test_chunking_parse_and_declared_workspace():
    from moekit.experts.base import Experts
    from moekit.types import WorkspaceShapes

    assert chunking.parse(["--C", "256", "None"]).C == [256, None]

    class RowsExperts(Experts):  # declares M*topk rows of N and of K/2 (bf16)
        def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
            rows = problem.M * problem.topk
            out = (problem.M, problem.topk, problem.K)
            return WorkspaceShapes((rows, problem.N), (rows, problem.N // 2), out, torch.bfloat16)

        def apply(self, call):
            raise NotImplementedError

    table = chunking.declared_table(RowsExperts(), TINY, [64, None], [32, 128, 1024])
    small, whole = table
    per_row = (TINY.N + TINY.I) * 2 * TINY.topk  # bytes per token
    assert small["M=32"] == 32 * per_row and small["M=128"] == small["M=1024"] == 64 * per_row
    assert whole["M=1024"] == 1024 * per_row  # unchunked grows with M


def test_chunking_dry_run_prints_plan(capsys):
    assert chunking.main(["--dry-run", "--C", "1024", "None"]) == 0
    assert "1.08" in capsys.readouterr().out
    assert chunking.main(["--dry-run", "--experts", "deep_gemm", "--dtype", "bf16"]) == 0
    assert "no declared table: QuantizationError" in capsys.readouterr().out


def _fake_timers(monkeypatch):
    """Replace the GPU-only timers so the whole orchestration runs on the CPU."""

    def graph(calls, **kw):
        for c in calls:
            c()
        return 5.0

    monkeypatch.setattr(common, "gpu_or_reason", lambda: None)
    monkeypatch.setattr(measure, "eager_us", lambda fn, **kw: (fn(), 10.0)[1])
    monkeypatch.setattr(measure, "graph_us", graph)
    monkeypatch.setattr(measure, "host_syncs", lambda fn, **kw: ["moekit/x.py:1: y.item()"])
    monkeypatch.setattr(measure, "peak_bytes", lambda fn, **kw: (fn(), 3 * 2**20)[1])
    monkeypatch.setattr(measure, "kernel_phases", lambda fn, **kw: measure.Phases(6.0, 2.0, []))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_layer_orchestration_on_cpu(monkeypatch, tmp_path, capsys):
    """The path the GPU run takes (check, time, annotate, JSON, summary), with fake timers."""
    from benchmarks import bench_summary

    monkeypatch.setitem(roofline.SHAPES, "tiny", TINY)
    _fake_timers(monkeypatch)
    path = tmp_path / "layer-tiny.json"
    argv = ["--shape", "tiny", "--M", "3", "40", "--graph-max-M", "8", "--rotate", "2", "--phases",
            "--peers", "grouped_mm,deep_gemm", "--json", str(path)]
    assert layer.main(argv, device="cpu") == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["M"], r["peer"]) for r in rows] == [(3, "grouped_mm"), (3, "deep_gemm"), (40, "grouped_mm"),
                                                   (40, "deep_gemm")]
    small, skipped, large = rows[0], rows[1], rows[2]
    assert small["status"] == "ok" and small["mode"] == "graph x2" and small["us"] == 5.0
    assert small["rel_err"] < 0.02 and small["host_syncs"]
    assert large["mode"] == "eager" and large["us"] == 10.0 and large["gemm_tflops"] > 0
    assert skipped["status"].startswith("skipped") and "us" not in skipped
    assert small["floor_us"] > 0 and large["floor_fraction"] == pytest.approx(large["floor_us"] / 10.0)

    capsys.readouterr()
    assert bench_summary.main(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "grouped_mm" in out and "host sync: moekit/x.py" in out and "skipped" in out


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_layer_rounds_time_every_checked_peer_again_and_take_the_median(monkeypatch, tmp_path):
    monkeypatch.setitem(roofline.SHAPES, "tiny", TINY)
    _fake_timers(monkeypatch)
    times = iter([10.0, 30.0, 20.0])
    monkeypatch.setattr(measure, "eager_us", lambda fn, **kw: (fn(), next(times))[1])
    path = tmp_path / "layer-rounds.json"
    argv = ["--shape", "tiny", "--M", "40", "--graph-max-M", "0", "--rounds", "3",
            "--peers", "grouped_mm,deep_gemm", "--json", str(path)]
    assert layer.main(argv, device="cpu") == 0
    timed, skipped = json.loads(path.read_text())["rows"]
    assert timed["us_rounds"] == [10.0, 30.0, 20.0] and timed["us"] == 20.0 and timed["spread"] == 1.0
    assert "us_rounds" not in skipped
    with pytest.raises(SystemExit):
        layer.parse(["--rounds", "0"])


@pytest.mark.interpreter
def test_layer_fp8_with_the_blockwise_reference_on_cpu(monkeypatch, tmp_path):
    """fp8 block weights through moekit's experts, checked against the block-at-a-time oracle
    (the path a DeepSeek-V3-sized layer takes)."""
    monkeypatch.setitem(roofline.SHAPES, "tiny", TINY)
    monkeypatch.setattr(problem, "WHOLE_REFERENCE_BYTES", 0)
    _fake_timers(monkeypatch)
    path = tmp_path / "layer-fp8.json"
    argv = ["--shape", "tiny", "--dtype", "fp8", "--M", "12", "--graph-max-M", "0",
            "--peers", "triton,deep_gemm_triton", "--json", str(path)]
    assert layer.main(argv, device="cpu") == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["peer"] for r in rows] == ["triton", "deep_gemm_triton"]
    assert all(r["status"] == "ok" and r["rel_err"] < layer.TOLERANCE["fp8"] for r in rows)


@pytest.mark.interpreter
def test_chunking_orchestration_on_cpu(monkeypatch, tmp_path):
    """Chunked (by tokens and by sorted rows) and unchunked TritonExperts (interpreter) agree;
    workspace shrinks with C; row chunks read fewer weight bytes than token chunks."""
    monkeypatch.setitem(roofline.SHAPES, "tiny", TINY)
    _fake_timers(monkeypatch)
    monkeypatch.setattr(measure, "peak_bytes", lambda fn, release, **kw: (release(), fn(), 1)[2])
    monkeypatch.setattr(chunking, "HOST_REPEATS", 1)  # each interpreted forward costs seconds
    monkeypatch.setattr(measure, "eager_us", lambda fn, **kw: 10.0)  # so the timers run no forward here
    monkeypatch.setattr(measure, "graph_us", lambda calls, **kw: 5.0)  # (the layer test runs them through)
    path = tmp_path / "chunking.json"
    argv = ["--shape", "tiny", "--M", "40", "--C", "16", "None", "--ws-M", "16", "256", "--json", str(path)]
    assert chunking.main(argv, device="cpu") == 0
    record = json.loads(path.read_text())
    whole, chunked, by_rows = record["rows"]
    assert (whole["C"], whole["chunks"], chunked["C"], chunked["chunks"]) == (None, 1, 16, 3)
    assert by_rows["chunk_by"] == "rows" and by_rows["C"] == chunking.row_sizes(chunking.parse(argv), TINY.topk)[0]
    assert whole["status"] == chunked["status"] == by_rows["status"] == "ok"
    assert chunked["rel_diff_vs_unchunked"] < 1e-2 and by_rows["rel_diff_vs_unchunked"] < 1e-2
    assert by_rows["weight_bytes"] <= chunked["weight_bytes"]
    assert chunked["peak_workspace_bytes"] < whole["peak_workspace_bytes"]
    assert chunked["pool_grows"] == 1
    declared = {r["C"]: r for r in record["declared_workspace_bytes"]}
    assert declared[16]["M=16"] == declared[16]["M=256"] < declared[None]["M=256"]


@pytest.mark.interpreter
def test_count_cases_and_sweep_on_cpu(monkeypatch, capsys):
    """Every contender, the histogram variants included, is exact; the sweep ranks launch shapes."""
    from benchmarks.variants.count_histogram import VARIANTS

    fake = lambda fn: (fn(), 1.0)[1]
    rows = count.run_case(300, 4, 16, 2, dtype=torch.int32, device="cpu", graph=False, timer=fake,
                          variants=tuple(VARIANTS))
    methods = [r["method"] for r in rows]
    assert methods[:4] == ["scan", "histogram", "torch.bincount", "torch.histc"]
    assert methods[4:] == [f"variant:{v}" for v in VARIANTS]
    assert all(r["E_local"] == 8 and r["us"] == 1.0 and r["floor_us"] > 0 for r in rows)

    monkeypatch.setattr(count, "SWEEP", dict(block=(128, 256), programs_per_sm=(1, 3), num_warps=(4,)))
    swept = count.sweep(300, 4, 16, 2, dtype=torch.int32, device="cpu", variant="ticket", timer=fake)
    assert len(swept) == 4 and {r["variant"] for r in swept} == {"ticket"}

    assert count.main(["--cpu-sanity", "--variants", "memset,partials"]) == 0
    assert "variant:partials" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        count._parse(["--variants", "nope"])


def test_cli_and_gpu_checks_import(capsys):
    from benchmarks.harness.__main__ import main

    assert main(["--help"]) == 0 and main([]) == 2 and main(["nope"]) == 2
    assert "layer" in capsys.readouterr().out
    for name in ("gpu_check_triton", "gpu_check_deep_gemm", "gpu_count_variants", "gpu_ep_bench", "bench_summary"):
        assert callable(importlib.import_module(f"benchmarks.{name}").main)


def test_phases_count_the_activation_beside_the_gemms():
    ph = measure.phases_of({"_fused_moe_kernel_0d1d": 30.0, "_persistent_moe_kernel": 20.0, "_silu_and_mul_kernel": 4.0,
                            "_align_scan_kernel": 3.0,
                            "_p_matmul_ogs_NNT_bf16xbf16xbf16_128x256x64x1_swiglu": 40.0, "Memset (Device)": 1.0})
    assert ph.gemm_us == 90.0 and ph.other_us == 8.0
    assert ph.activation_us == 4.0  # a GEMM with a fused activation counts once, as a GEMM
    assert ph.gemm_and_activation_us == 94.0
    assert ph.kernels[0]["gemm"] and ph.kernels[1]["name"] == "_fused_moe_kernel_0d1d"
