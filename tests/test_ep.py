"""moekit.ep: the expert-parallel problem every rank builds, the report, and the CLI (2 gloo ranks)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from moekit.ep import EPConfig, RankResult, format_results, global_problem, run_rank
from moekit.errors import InvalidInputError
from moekit.testing import MoEProblem, expect_raises
from moekit.types import QuantScheme


def test_ep_config_defaults_and_is_frozen():
    c = EPConfig((8, 4))
    assert (c.E, c.topk, c.K, c.N, c.chunk_size, c.experts) == (16, 2, 128, 256, None, "triton")
    assert (c.quant, c.metadata_policy, c.dtype) == (QuantScheme.NONE, "per_chunk", torch.bfloat16)
    assert (c.skew, c.empty_every, c.seed) == (1.0, None, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.E = 8
    assert EPConfig((8, 4), E=8) == EPConfig((8, 4), E=8) != EPConfig((8, 4), E=8, seed=1)


def test_global_problem_is_every_ranks_tokens_on_the_cpu():
    c = EPConfig((8, 0, 4), E=8, topk=2, K=64, N=64, empty_every=3)
    p = global_problem(c)
    assert isinstance(p, MoEProblem) and p.M == 12
    assert p.w1.shape == (8, 64, 64) and p.w2.shape == (8, 64, 32) and p.topk_ids.shape == (12, 2)
    assert all(t.device.type == "cpu" for t in p.inputs())
    assert p.topk_ids[::3, -1].tolist() == [-1] * 4


def test_global_problem_is_identical_for_equal_configs():
    c = EPConfig((6, 6), E=8, K=64, N=64)
    a, b = global_problem(c), global_problem(dataclasses.replace(c))
    for x, y in zip(a.inputs(), b.inputs(), strict=True):
        assert torch.equal(x, y)
    other = global_problem(dataclasses.replace(c, seed=3))
    assert not torch.equal(a.hidden, other.hidden)


def test_global_problem_fp8():
    p = global_problem(EPConfig((4, 4), E=4, quant=QuantScheme.FP8_BLOCK))
    assert p.quant is QuantScheme.FP8_BLOCK and p.w1_scale.shape == (4, 2, 1) and p.w2_scale.shape == (4, 1, 1)


def test_run_rank_needs_one_token_count_per_rank():
    with expect_raises(InvalidInputError, match=r"one token count per rank \(len\(Ms\) == world_size=2\)"):
        run_rank(0, 2, EPConfig((8, 4, 4), E=8))


def rank_result(rank, **kw):
    counts = torch.tensor([[1, 2, 0], [3, 0, 4]])
    fields = dict(rank=rank, M=5, received=10, output=None, reference=torch.randn(5, 8), max_abs_err=0.0123,
                  close=True, counts=counts, backends=["triton", "triton"], tokens_meta=[4, 2, 4],
                  received_from=[6, 4])  # fmt: skip
    return RankResult(**{**fields, **kw})


def test_format_results():
    text = format_results([rank_result(0), rank_result(1, close=False, backends=["triton"])])
    lines = text.splitlines()
    assert lines[0] == ("rank 0: M=5 tokens, received 10 (token, slot) rows (from each rank: [6, 4]); "
                        "max |err| 0.0123 (ok)")  # fmt: skip
    assert lines[1:3] == ["  chunk 0 [triton]: [1, 2, 0]", "  chunk 1 [triton]: [3, 0, 4]"]
    assert lines[3].endswith("(MISMATCH)")
    assert lines[5] == "  chunk 1 [?]: [3, 0, 4]"  # a chunk with no recorded backend
    failed = format_results([rank_result(0, error="StaleMetadataError: stale", counts=torch.zeros(0, 3))])
    assert failed.splitlines() == [
        "rank 0: M=5 tokens, received 10 (token, slot) rows (from each rank: [6, 4]); StaleMetadataError: stale"
    ]


@pytest.mark.interpreter
@pytest.mark.distributed
def test_cli_runs_two_gloo_ranks():
    cmd = [sys.executable, "-m", "moekit.ep", "--world-size", "2", "--M", "8,4", "--E", "8", "--topk", "2",
           "--K", "64", "--N", "64"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0: M=8 tokens" in done.stdout and "rank 1: M=4 tokens" in done.stdout
    assert done.stdout.count("(ok)") == 2 and "MISMATCH" not in done.stdout


@pytest.mark.parametrize("argv, env, says", [
    (["--M", "abc"], {}, "argument --M: expected one int >= 0, or one per rank (64,0), got 'abc'"),
    (["--M", "-3"], {}, "argument --M: expected one int >= 0"),
    (["--M", "4,-1"], {}, "argument --M: expected one int >= 0"),
    (["--K", "0"], {}, "argument --K: expected an int >= 1, got '0'"),
    (["--N", "3"], {}, "argument --N: expected an even int >= 2, got '3'"),
    (["--E", "4", "--topk", "5"], {}, "--topk 5 is more than --E 4 experts"),
    (["--world-size", "2", "--M", "1,2,3"], {}, "expected one token count or 2 (one per rank), got 3"),
    (["--timeout", "nan"], {}, "argument --timeout: expected a number >= 0.001"),
    ([], {"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ([], {"RANK": "0", "WORLD_SIZE": "abc"}, "RANK and WORLD_SIZE must be ints, got RANK='0', WORLD_SIZE='abc'"),
    ([], {"RANK": "2", "WORLD_SIZE": "2"}, "0 <= RANK < WORLD_SIZE"),
])  # fmt: skip
def test_cli_bad_values_are_usage_errors(monkeypatch, capsys, argv, env, says):
    # Before: raw tracebacks (ValueError from int(), or deep inside the forward).
    from moekit.ep import main

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as caught:
        main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "usage: python -m moekit.ep" in err and says in err, err
    assert "Traceback" not in err


@pytest.mark.distributed
def test_cli_shows_the_named_error_of_every_rank(capsys):
    # Before: AttributeError: 'NoneType' object has no attribute 'counts_matrix' (no trace after
    # a door error); a bad experts/quant pair raised in every rank with a traceback.
    from moekit.ep import main

    common = ["--world-size", "2", "--M", "3", "--E", "4", "--K", "64", "--N", "64", "--timeout", "60"]
    assert main([*common, "--experts", "triton_or_deep_gemm"]) == 1  # fp8 needs K and N/2 multiples of 128
    out = capsys.readouterr().out
    assert out.count("QuantizationError: fp8 block TritonExperts need K and N/2 to be multiples of 128") == 2, out
    assert main([*common, "--experts", "deep_gemm", "--quant", "none"]) == 1
    out = capsys.readouterr().out
    assert out.count("QuantizationError: DeepGemmExperts needs quant=QuantScheme.FP8_BLOCK") == 2, out


@pytest.mark.interpreter
@pytest.mark.distributed
def test_cli_under_torchrun_with_one_process(monkeypatch, capsys):
    import socket

    import torch.distributed as dist

    from moekit.ep import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    try:
        assert main(["--M", "5", "--E", "4", "--K", "32", "--N", "32", "--backend", "gloo", "--timeout", "30"]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert "rank 0: M=5 tokens" in capsys.readouterr().out
