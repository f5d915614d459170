"""benchmarks.results_view.peer_run: a same-process run beside triton_kernels, read back."""

from __future__ import annotations

import json

from benchmarks.results_view import peer_rows
from benchmarks.results_view.peer_run import gemm_us
from moekit.errors import InvalidInputError
from moekit.testing import expect_raises

TOP_MOEKIT = [{"name": "_fused_moe_kernel", "us": 400.0}, {"name": "_persistent_moe_kernel", "us": 250.0},
              {"name": "_silu_and_mul_kernel", "us": 30.0},
              {"name": "_weighted_topk_sum_kernel", "us": 40.0}]  # fmt: skip
TOP_TK = [{"name": "_p_matmul_ogs_NNN_bf16", "us": 390.0}, {"name": "_p_matmul_ogs_NNN_bf16", "us": 220.0},
          {"name": "_reduce", "us": 290.0}]  # fmt: skip


def test_gemm_time_counts_every_gemm_and_the_activation_only():
    assert gemm_us("moekit", TOP_MOEKIT) == 680.0  # not the weighted sum
    assert gemm_us("moekit_fuse_act", TOP_MOEKIT[1:2]) == 250.0
    assert gemm_us("tk_gemms", TOP_TK) == 610.0  # not its reduce
    assert gemm_us("tk", []) is None


def test_rows_per_shape_and_M(tmp_path):
    layer = [
        {"shape": "qwen3_30b_a3b", "M": 4096, "tk_ok": True},  # a routing-check row: no contender
        {"shape": "qwen3_30b_a3b", "M": 4096, "contender": "moekit", "us": 790.0, "status": "ok", "floor_us": 391.4,
         "rel_err_vs_fp32_ref": 0.004, "phases": {"top": TOP_MOEKIT}},
        {"shape": "qwen3_30b_a3b", "M": 4096, "contender": "tk_gemms", "us": 1755.0, "status": "ok",
         "floor_us": 391.4, "rel_err_vs_fp32_ref": 0.003, "phases": {"top": TOP_TK}},
        {"shape": "qwen3_30b_a3b", "M": 1, "contender": "tk", "status": "skipped: budget"},
    ]  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"layer": layer}))
    (row,) = peer_rows(path)
    assert row == {"shape": "qwen3_30b_a3b", "M": 4096, "floor us": 391.4, "moekit us": 790.0, "moekit err": 0.004,
                   "moekit gemm us": 680.0, "tk_gemms us": 1755.0, "tk_gemms err": 0.003,
                   "tk_gemms gemm us": 610.0}  # fmt: skip


def test_bad_files_are_named(tmp_path):
    with expect_raises(InvalidInputError, "no such file"):
        peer_rows(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    with expect_raises(InvalidInputError, "not a tk_anchor result file"):
        peer_rows(tmp_path / "other.json")
