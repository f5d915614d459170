"""The pre-fix policies at the end of moekit.modular_kernel: what the chunk loop hands each chunk."""

from __future__ import annotations

import pytest
import torch

from moekit.errors import InvalidInputError, WorkspaceShapeError
from moekit.experts import TritonExperts
from moekit.modular_kernel import (
    METADATA_POLICIES,
    WORKSPACE_POLICIES,
    DeclaredOnceWorkspaces,
    PerChunkCounts,
    PerChunkWorkspaces,
    WholeBatchCounts,
    check_policy,
    same_layout,
)
from moekit.plan import TokenChunk
from moekit.testing import expect_raises
from moekit.types import ExpertTokensMetadata, ProblemSize, WorkspaceShapes

BF16 = torch.bfloat16


def shapes(ws13, ws2, output=(4, 2, 64), dtype=BF16) -> WorkspaceShapes:
    return WorkspaceShapes(ws13, ws2, output, dtype)


def counts(E: int = 8) -> torch.Tensor:
    return torch.randint(1, 50, (E,), dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# same_layout


def test_same_layout_is_the_same_backend_at_a_smaller_m():
    declared = shapes((16, 2, 256), (32, 128))
    assert same_layout(declared, declared)
    assert same_layout(shapes((3, 2, 256), (6, 128)), declared)
    assert same_layout(shapes((0, 2, 256), (0, 128)), declared)


@pytest.mark.parametrize(
    "own, why",
    [
        (shapes((17, 2, 256), (32, 128)), "more rows than declared"),
        (shapes((16, 2, 128), (32, 128)), "another row width"),
        (shapes((32, 256), (32, 128)), "another rank"),
        (shapes((16, 2, 256), (32, 128), dtype=torch.float32), "another dtype"),
    ],
)
def test_another_layout_is_not_the_same(own, why):
    assert not same_layout(own, shapes((16, 2, 256), (32, 128))), why


def test_empty_workspaces_match_only_empty_ones():
    assert same_layout(shapes((), ()), shapes((), ()))
    assert not same_layout(shapes((), (8,)), shapes((4,), (8,)))


# ---------------------------------------------------------------------------------------------
# the workspace policies

CHUNK = TokenChunk(2, 256, 300)
SUB = ProblemSize(44, 256, 128, 2, 8, 8)


class Plan:
    """The two things a workspace policy asks of a plan."""

    def __init__(self, declared: WorkspaceShapes):
        self.declared, self.asked = declared, 0

    def declared_once(self) -> WorkspaceShapes:
        self.asked += 1
        return self.declared

    def backend(self, chunk) -> str:
        return TritonExperts().backend_for(SUB)


def test_per_chunk_workspaces_hand_each_chunk_its_own():
    own = shapes((44, 2, 256), (88, 128))
    policy = PerChunkWorkspaces()
    assert policy.name == "per_chunk" == WORKSPACE_POLICIES[0]
    plan = Plan(shapes((1,), (1,)))
    assert policy.given(own, CHUNK, plan) is own and plan.asked == 0


def test_declared_once_hands_every_chunk_the_first_chunks_shapes():
    declared = shapes((128, 2, 256), (256, 128))
    for guard in (True, False):
        policy = DeclaredOnceWorkspaces(TritonExperts(), guard=guard)
        assert policy.name == "once" and policy.name in WORKSPACE_POLICIES
        assert policy.given(shapes((44, 2, 256), (88, 128)), CHUNK, Plan(declared)) is declared


def test_declared_once_guard_names_bug_1_and_the_chunk():
    declared = shapes((128, 2, 256), (256, 128))
    other = shapes((300, 512), (300, 512))  # another backend's layout
    policy = DeclaredOnceWorkspaces(TritonExperts(), guard=True)
    with expect_raises(WorkspaceShapeError, match="bug 1 of vLLM PR #20392") as caught:
        policy.given(other, CHUNK, Plan(declared))
    for part in ("TritonExperts declared", "Chunk 2 (tokens [256, 300), M=44)", "backend 'triton'",
                 "workspace13=(128, 2, 256)", "workspace13=(300, 512)", "workspace_policy='per_chunk'"):  # fmt: skip
        assert part in caught.message, part


def test_declared_once_without_guard_returns_the_declared_shapes_even_when_they_differ():
    declared = shapes((128, 2, 256), (256, 128))
    policy = DeclaredOnceWorkspaces(TritonExperts(), guard=False)
    assert policy.given(shapes((300, 512), (300, 512)), CHUNK, Plan(declared)) is declared


# ---------------------------------------------------------------------------------------------
# the metadata policies


@pytest.mark.parametrize("policy", [PerChunkCounts(), WholeBatchCounts()])
def test_no_metadata_stays_none(policy):
    assert policy.tokens_meta(None, counts(), single=False) is None
    assert policy.tokens_meta(None, None, single=True) is None


@pytest.mark.parametrize("policy", [PerChunkCounts(), WholeBatchCounts()])
def test_a_single_chunk_keeps_the_whole_metadata(policy):
    whole = ExpertTokensMetadata.from_counts(counts(), with_cpu=True)
    assert policy.tokens_meta(whole, counts(), single=True) is whole


def test_whole_batch_hands_every_chunk_the_whole_metadata():
    whole = ExpertTokensMetadata.from_counts(counts(), with_cpu=False)
    policy = WholeBatchCounts()
    assert policy.tokens_meta(whole, counts(), single=False) is whole and not policy.recounts


@pytest.mark.parametrize("with_cpu", [True, False])
def test_per_chunk_builds_metadata_from_the_chunks_counts(with_cpu):
    whole = ExpertTokensMetadata.from_counts(counts(), with_cpu=with_cpu)
    mine = counts()
    policy = PerChunkCounts()
    meta = policy.tokens_meta(whole, mine, single=False)
    assert policy.recounts
    assert meta is not whole and meta.expert_num_tokens is mine
    if with_cpu:  # a CPU copy only where the whole one had one
        assert meta.expert_num_tokens_cpu.device.type == "cpu"
        assert torch.equal(meta.expert_num_tokens_cpu, mine.cpu())
    else:
        assert meta.expert_num_tokens_cpu is None


# ---------------------------------------------------------------------------------------------
# check_policy


def test_check_policy():
    assert WORKSPACE_POLICIES == ("per_chunk", "once") and tuple(METADATA_POLICIES) == ("per_chunk", "whole_batch")
    assert {name: cls.name for name, cls in METADATA_POLICIES.items()} == {"per_chunk": "per_chunk",
                                                                            "whole_batch": "whole_batch"}  # fmt: skip
    for allowed in (WORKSPACE_POLICIES, METADATA_POLICIES):
        for value in allowed:
            assert check_policy(value, allowed, "policy") == value
    message = r"metadata_policy must be one of \('per_chunk', 'whole_batch'\), got 'once'"
    with expect_raises(InvalidInputError, match=message):
        check_policy("once", METADATA_POLICIES, "metadata_policy")
    with expect_raises(InvalidInputError, match="got None"):
        check_policy(None, WORKSPACE_POLICIES, "workspace_policy")
