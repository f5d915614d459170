"""moekit.integrations.hf_routing: transformers' routing in moekit's convention, in one launch."""

from __future__ import annotations

import torch

import moekit
from moekit.experts import TritonExperts
from moekit.integrations.hf_routing import launch_marker_to_moekit
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.testing import make_problem


def test_the_marker_becomes_minus_one_and_bad_ids_poison_their_weight(device):
    ids = torch.tensor([[0, 1000], [8, 3], [-2, 1], [-1, 2]], device=device)
    weights = torch.rand(4, 2, device=device)
    got_ids, got = launch_marker_to_moekit(ids, weights, 8)
    assert got_ids.tolist() == [[0, 1000], [-1, 3], [-2, 1], [-1, 2]] and got_ids.dtype == ids.dtype
    assert got.isnan().tolist() == [[False, True], [False, False], [True, False], [False, False]]
    assert torch.equal(got[~got.isnan()], weights[~got.isnan()])


def test_a_poisoned_slot_makes_its_token_nan_through_the_layer(device):
    # What a GPU forward does with an id outside [-1, E] (the kernels treat it as an empty slot):
    # its weight is NaN, so finalize's weighted sum makes that token's row NaN, never plausible.
    ids = torch.tensor([[0, 1000], [8, 3], [-2, 1], [-1, 2]], device=device)
    ids_out, weights = launch_marker_to_moekit(ids, torch.rand(4, 2, device=device), 8)
    p = make_problem(4, E=8, topk=2, K=32, N=64, dtype=torch.float32, device=device)
    as_the_kernels_see_them = torch.where((ids_out > 7) | (ids_out < -1), -1, ids_out)
    with torch.no_grad():
        out = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts())(p.hidden, p.w1, p.w2, weights,
                                                                            as_the_kernels_see_them)  # fmt: skip
    assert out.isnan().any(1).tolist() == [True, False, True, False]


def test_empty_routing_launches_nothing(device):
    ids, w = launch_marker_to_moekit(torch.empty(0, 2, dtype=torch.int64, device=device),
                                     torch.empty(0, 2, device=device), 8)  # fmt: skip
    assert ids.shape == w.shape == (0, 2)


def test_the_integrations_prepare_converts_the_ids_where_told(device):
    """MarkerPrepareFinalize(convert=True): prepare hands the experts moekit's ids and weights (what
    launch_marker_to_moekit gives, the placement's expert count as the marker); convert=False (the
    integration on the CPU, where ids come converted) hands on the caller's."""
    from moekit.integrations.hf_routing import MarkerPrepareFinalize
    from moekit.types import ExpertPlacement, QuantScheme

    ids = torch.tensor([[0, 1000], [8, 3], [-2, 1], [-1, 2]], device=device)
    weights, hidden = torch.rand(4, 2, device=device), torch.randn(4, 32, device=device)
    placement = ExpertPlacement(global_num_experts=8, num_local_experts=8)
    want_ids, want_weights = launch_marker_to_moekit(ids, weights, 8)
    got = MarkerPrepareFinalize(convert=True).prepare(hidden, weights, ids, quant=QuantScheme.NONE, placement=placement)
    assert torch.equal(got.topk_ids, want_ids) and torch.equal(got.topk_weights.isnan(), want_weights.isnan())
    assert torch.equal(got.topk_weights.nan_to_num(), want_weights.nan_to_num()) and ids[1, 0] == 8  # inputs kept
    kept = MarkerPrepareFinalize(convert=False).prepare(
        hidden, weights, ids, quant=QuantScheme.NONE, placement=placement
    )
    assert kept.topk_ids is ids and kept.topk_weights is weights


def test_the_integration_converts_in_prepare_on_a_gpu_only():
    from moekit.integrations.transformers import Settings

    settings = Settings("t", TritonExperts, TritonExperts, None, {})
    assert settings.build_kernel(torch.device("cpu")).prepare_finalize.convert is False
    assert settings.build_kernel(torch.device("meta")).prepare_finalize.convert is True  # (as on a GPU)


def test_the_stage_names_itself_and_refuses_a_convert_that_is_not_a_bool():
    from moekit.errors import InvalidInputError
    from moekit.integrations.hf_routing import MarkerPrepareFinalize
    from moekit.testing import expect_raises

    assert repr(MarkerPrepareFinalize(convert=True)).startswith("MarkerPrepareFinalize(")
    with expect_raises(InvalidInputError, "convert"):
        MarkerPrepareFinalize(convert="no")
