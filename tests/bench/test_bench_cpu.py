"""CPU tests of the benchmark harness's pure parts: shapes, accounting, the grouped_mm peer."""

from __future__ import annotations

import pytest
import torch

from moekit.bench import peers, shapes
from moekit.errors import InvalidInputError
from moekit.reference import moe_reference
from moekit.testing import assert_close

QWEN = shapes.get_shape("qwen3_30b_a3b")
DSV3 = shapes.get_shape("deepseek_v3")


def test_named_shapes():
    assert (QWEN.E, QWEN.topk, QWEN.K, QWEN.I, QWEN.N) == (128, 8, 2048, 768, 1536)
    assert (DSV3.E, DSV3.topk, DSV3.K, DSV3.I, DSV3.N) == (256, 8, 7168, 2048, 4096)
    with pytest.raises(InvalidInputError, match="qwen3_30b_a3b"):
        shapes.get_shape("mixtral")


def test_flops_count_both_gemms():
    # GEMM1: [8, 2048] x [2048, 1536]; GEMM2: [8, 768] x [768, 2048]
    assert shapes.layer_flops(QWEN, 1) == 2 * 8 * 2048 * 1536 + 2 * 8 * 768 * 2048
    assert shapes.layer_flops(QWEN, 4096) == 4096 * shapes.layer_flops(QWEN, 1)


def test_bytes_count_hit_experts_and_activations():
    one = (1536 * 2048 + 2048 * 768) * 2
    assert QWEN.expert_bytes("bf16") == one
    assert shapes.layer_bytes(QWEN, 1, 8, "bf16") == 8 * one + 2 * 2048 * 2
    # fp8: one byte per weight plus fp32 128x128 block scales
    scales = 4 * (12 * 16 + 16 * 6)
    assert QWEN.expert_bytes("fp8") == one // 2 + scales
    with pytest.raises(InvalidInputError):
        shapes.layer_bytes(QWEN, 1, 9, "bf16")  # 1 token x topk 8 cannot hit 9 experts
    with pytest.raises(InvalidInputError):
        QWEN.expert_bytes("int4")


@pytest.mark.parametrize(
    ("shape", "M", "facts_us"),
    [(QWEN, 1, 17.6), (QWEN, 128, 281.0), (QWEN, 4096, 391.0), (QWEN, 16384, 1566.0), (DSV3, 16384, 14600.0)],
)
def test_floors_match_facts(shape, M, facts_us):
    unique = round(shapes.expected_unique_experts(shape, M))
    floor = shapes.layer_floor(shape, M, unique, "bf16")
    assert floor.us == pytest.approx(facts_us, rel=0.005)
    assert floor.us == pytest.approx(shapes.FACTS_FLOORS[(shape.name, "bf16", M)], rel=0.005)
    assert floor.bound == ("memory" if M <= 128 else "compute")


def test_fp8_floor_uses_the_fp8_peak():
    bf16 = shapes.layer_floor(DSV3, 16384, 256, "bf16")
    fp8 = shapes.layer_floor(DSV3, 16384, 256, "fp8")
    assert fp8.compute_us == pytest.approx(bf16.compute_us * 790 / 1365)
    assert fp8.memory_us < bf16.memory_us


def test_targets_bind_the_right_peers():
    (t,) = shapes.TARGETS[("qwen3_30b_a3b", "bf16", 4096)]
    assert shapes.check_target(t, "triton", us=550.0) is True
    assert shapes.check_target(t, "triton", us=650.0) is False
    assert shapes.check_target(t, "grouped_mm", us=550.0) is None  # a peer, not moekit
    dg, fallback = shapes.TARGETS[("deepseek_v3", "fp8", 4096)]
    assert shapes.check_target(dg, "deep_gemm", us=1.0, gemm_tflops=1200.0, non_gemm_fraction=0.2) is True
    assert shapes.check_target(dg, "deep_gemm", us=1.0, gemm_tflops=1200.0, non_gemm_fraction=0.3) is False
    assert shapes.check_target(dg, "deep_gemm_triton", us=1.0, gemm_tflops=2000.0) is None
    assert shapes.check_target(fallback, "deep_gemm_triton", us=1.0, gemm_tflops=650.0) is True
    assert shapes.check_target(fallback, "deep_gemm_triton", us=1.0) is None  # rate not measured


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
    weights, ids = _routing(M, E, topk, seed=M)
    x = peers.LayerInputs(
        hidden=torch.randn(M, K, dtype=torch.bfloat16),
        w1=(torch.randn(E, 2 * I, K) / 8).to(torch.bfloat16),
        w2=(torch.randn(E, K, I) / 8).to(torch.bfloat16),
        topk_weights=weights,
        topk_ids=ids,
    )
    out = peers.grouped_mm_moe(x)
    assert out.shape == (M, K) and out.dtype == torch.bfloat16
    ref = moe_reference(x.hidden, x.w1, x.w2, weights, ids)
    assert_close(out, ref, dtype=torch.bfloat16)


def test_grouped_mm_peer_refuses_fp8_and_skips_politely():
    p = peers.make_peer("grouped_mm", "fp8")
    assert p.skipped and "bf16" in p.skipped
    with pytest.raises(InvalidInputError, match="skipped"):
        p.run(None)
    with pytest.raises(InvalidInputError, match="peer must be one of"):
        peers.make_peer("cublas", "bf16")
    assert peers.make_peer("deep_gemm", "bf16").skipped


# ----------------------------------------------------------------------------------------------
# Problem setup, the sampled oracle, and the subcommands' CPU behaviour.

TINY = shapes.LayerShape("tiny", E=6, topk=2, K=256, I=128)


def test_sample_rows_and_rel_error():
    from moekit.bench.measure import rel_error, sample_rows

    assert sample_rows(5, 8).tolist() == [0, 1, 2, 3, 4]
    rows = sample_rows(1000, 16)
    assert rows[0] == 0 and rows[-1] == 999 and len(rows) == 16
    ref = torch.randn(4, 8)
    assert rel_error(ref, ref) == 0.0
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert not rel_error(bad, ref) <= 1.0  # NaN never passes


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_problem_and_blocked_reference(dtype):
    from moekit.bench.problem import make_inputs, make_weights, reference_for
    from moekit.quant import dequantize_fp8_block

    weights = make_weights(TINY, dtype, seed=0, block=4, device="cpu")  # 4 does not divide E=6
    x = make_inputs(TINY, 10, weights, router="uniform", seed=1, device="cpu")
    assert x.w1.shape == (6, 256, 256) and x.w2.shape == (6, 256, 128)
    rows = torch.tensor([0, 3, 9])
    got = reference_for(x, rows, dtype)
    w1, w2 = x.w1, x.w2
    hidden = x.hidden[rows]
    if dtype == "fp8":
        assert x.w1.dtype == torch.float8_e4m3fn and x.w1_scale.shape == (6, 2, 2)
        from moekit.quant import dequantize_fp8_per_token_group, quantize_fp8_per_token_group

        w1, w2 = dequantize_fp8_block(w1, x.w1_scale), dequantize_fp8_block(w2, x.w2_scale)
        hidden = dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(hidden))
    want = moe_reference(hidden, w1, w2, x.topk_weights[rows], x.topk_ids[rows])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().mean() > 0.05  # 1/sqrt(fan_in) scaling keeps outputs O(1), not tiny


def test_layer_dry_run_and_cpu_refusal(capsys):
    from moekit.bench import layer

    assert layer.main(["--shape", "deepseek_v3", "--M", "16384", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "14613.8" in out and "23200" in out and "<= 18000 us" in out
    assert layer.main(["--M", "1"]) == 2  # no GPU here: a clear refusal, not a traceback
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        layer.parse(["--peers", "cublas"])


def test_chunking_parse_and_declared_workspace():
    from moekit.bench import chunking
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
    from moekit.bench import chunking

    assert chunking.main(["--dry-run", "--C", "1024", "None"]) == 0
    assert "1.08" in capsys.readouterr().out


def _fake_timers(monkeypatch):
    """Replace the GPU-only timers so the whole orchestration runs on the CPU."""
    from moekit.bench import common, measure

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
    import importlib.util
    import json

    from moekit.bench import layer

    monkeypatch.setitem(shapes.SHAPES, "tiny", TINY)
    monkeypatch.setattr(layer, "DEVICE", "cpu")
    _fake_timers(monkeypatch)
    path = tmp_path / "layer-tiny.json"
    argv = ["--shape", "tiny", "--M", "3", "40", "--graph-max-M", "8", "--rotate", "2", "--phases",
            "--peers", "grouped_mm,deep_gemm", "--json", str(path)]
    assert layer.main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["M"], r["peer"]) for r in rows] == [(3, "grouped_mm"), (3, "deep_gemm"), (40, "grouped_mm"),
                                                   (40, "deep_gemm")]
    small, skipped, large = rows[0], rows[1], rows[2]
    assert small["status"] == "ok" and small["mode"] == "graph x2" and small["us"] == 5.0
    assert small["rel_err"] < 0.02 and small["host_syncs"]
    assert large["mode"] == "eager" and large["us"] == 10.0 and large["gemm_tflops"] > 0
    assert skipped["status"].startswith("skipped") and "us" not in skipped
    assert small["floor_us"] > 0 and large["floor_fraction"] == pytest.approx(large["floor_us"] / 10.0)

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_summary", root / "scripts" / "bench_summary.py")
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    capsys.readouterr()
    assert summary.main(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "grouped_mm" in out and "host sync: moekit/x.py" in out and "skipped" in out


def test_chunking_orchestration_on_cpu(monkeypatch, tmp_path):
    """Chunked and unchunked TritonExperts (interpreter) agree; workspace shrinks with C."""
    import json

    from moekit.bench import chunking, measure

    pytest.importorskip("moekit.experts.triton")
    monkeypatch.setitem(shapes.SHAPES, "tiny", TINY)
    monkeypatch.setattr(chunking, "DEVICE", "cpu")
    _fake_timers(monkeypatch)
    monkeypatch.setattr(measure, "peak_bytes", lambda fn, release, **kw: (release(), fn(), 1)[2])
    path = tmp_path / "chunking.json"
    argv = ["--shape", "tiny", "--M", "40", "--C", "16", "None", "--ws-M", "16", "256", "--json", str(path)]
    assert chunking.main(argv) == 0
    record = json.loads(path.read_text())
    whole, chunked = record["rows"]
    assert (whole["C"], whole["chunks"], chunked["C"], chunked["chunks"]) == (None, 1, 16, 3)
    assert whole["status"] == chunked["status"] == "ok" and chunked["rel_diff_vs_unchunked"] < 1e-2
    assert chunked["peak_workspace_bytes"] < whole["peak_workspace_bytes"]
    assert chunked["pool_grows"] == 1
    declared = {r["C"]: r for r in record["declared_workspace_bytes"]}
    assert declared[16]["M=16"] == declared[16]["M=256"] < declared[None]["M=256"]
