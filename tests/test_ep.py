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
