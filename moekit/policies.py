"""What the chunk loop hands each chunk: its workspaces and its tokens per expert.

Each question has two answers, one small strategy each. The first is PR #20392's fix and the
default; the second replays the parent commit (``41060c6e0``), for teaching:

=============  ===================================  =========================================
question       the fix (``"per_chunk"``)            before it
=============  ===================================  =========================================
workspaces     ``workspace_shapes(M=e-s)`` per      ``"once"``: ``workspace_shapes(M=C)`` once;
               chunk: each chunk gets what its      every chunk carves its caches out of those
               backend declared for its M           buffers (prefix views, as ``_resize_cache``)
tokens per     ``count_expert_num_tokens(ids[s:e])``  ``"whole_batch"``: every chunk is handed
expert         per chunk                            the counts that prepare returned for all M
=============  ===================================  =========================================

Under ``"once"`` a smaller chunk of the same backend fits in the leading elements of the
buffers declared for the first chunk, which is why the pre-fix loop worked until a dispatching
experts class switched backend between chunks. moekit's guard (on by default) refuses a chunk
whose own layout differs from the one declared once, before the experts run; with the guard off
the chunk runs in those buffers, as upstream's did.
"""

from __future__ import annotations

from moekit.errors import InvalidInputError, WorkspaceShapeError
from moekit.plan import Chunk
from moekit.types import ExpertTokensMetadata, WorkspaceShapes


def same_layout(own: WorkspaceShapes, declared: WorkspaceShapes) -> bool:
    """Whether ``own`` is ``declared`` with at most as many rows: the same backend at a smaller M."""
    if own.dtype != declared.dtype:
        return False
    pairs = ((own.workspace13, declared.workspace13), (own.workspace2, declared.workspace2))
    return all(len(a) == len(b) and (not a or (a[1:] == b[1:] and a[0] <= b[0])) for a, b in pairs)


class PerChunkWorkspaces:
    """The fix: every chunk gets the buffers it declared."""

    name = "per_chunk"

    def given(self, own: WorkspaceShapes, chunk: Chunk, plan) -> WorkspaceShapes:
        return own


class DeclaredOnceWorkspaces:
    """Before the fix: the shapes declared for the first chunk serve every chunk."""

    name = "once"

    def __init__(self, experts, *, guard: bool):
        self.experts, self.guard = experts, guard  # the experts are named in the guard's message

    def given(self, own: WorkspaceShapes, chunk: Chunk, plan) -> WorkspaceShapes:
        declared = plan.declared_once()
        if self.guard and not same_layout(own, declared):
            raise WorkspaceShapeError(self._message(own, declared, chunk, plan))
        return declared

    def _message(self, own: WorkspaceShapes, d: WorkspaceShapes, chunk: Chunk, plan) -> str:
        return (
            f"workspace_policy='once': {self.experts.name} declared its workspaces once, for the first chunk, as "
            f"workspace13={d.workspace13}, workspace2={d.workspace2} ({d.dtype}). Chunk {chunk.index} "
            f"(tokens [{chunk.start}, {chunk.end}), M={chunk.size}) runs backend '{plan.backend(chunk)}', "
            f"which declares workspace13={own.workspace13}, workspace2={own.workspace2}. This is "
            "bug 1 of vLLM PR #20392: a dispatching experts class may change backend between "
            "chunks, so workspace shapes must be computed per chunk (workspace_policy='per_chunk'). "
            "(moekit's guard; upstream had no such check: ModularKernel(guard=False) replays it.)"
        )


class PerChunkCounts:
    """The fix: a chunk is handed its own tokens per expert (recounted; prepare's for one chunk of every row)."""

    name = "per_chunk"
    recounts = True

    def tokens_meta(self, whole: ExpertTokensMetadata | None, counts, *, single: bool) -> ExpertTokensMetadata | None:
        if whole is None or single:
            return whole
        # The CPU copy is blocking on purpose: consumers size buffers from it (upstream #20903).
        return ExpertTokensMetadata.from_counts(counts, with_cpu=whole.expert_num_tokens_cpu is not None)


class WholeBatchCounts:
    """Before the fix: every chunk is handed the counts prepare returned for the whole batch."""

    name = "whole_batch"
    recounts = False

    def tokens_meta(self, whole: ExpertTokensMetadata | None, counts, *, single: bool) -> ExpertTokensMetadata | None:
        return whole


WORKSPACE_POLICIES = ("per_chunk", "once")
METADATA_POLICIES = {"per_chunk": PerChunkCounts, "whole_batch": WholeBatchCounts}


def check_policy(value, allowed, name: str) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise InvalidInputError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value
