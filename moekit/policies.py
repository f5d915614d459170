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

from dataclasses import dataclass

from moekit.chunking import ChunkRange
from moekit.errors import InvalidInputError, WorkspaceShapeError
from moekit.types import ExpertTokensMetadata, ProblemSize, WorkspaceShapes

WORKSPACE_POLICIES = ("per_chunk", "once")
METADATA_POLICIES = ("per_chunk", "whole_batch")


def check_policy(value, allowed: tuple[str, ...], name: str) -> str:
    if value not in allowed:
        raise InvalidInputError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def same_layout(own: WorkspaceShapes, declared: WorkspaceShapes) -> bool:
    """Whether ``own`` is ``declared`` with at most as many rows: the same backend at a smaller M."""
    if own.dtype != declared.dtype:
        return False
    pairs = ((own.workspace13, declared.workspace13), (own.workspace2, declared.workspace2))
    return all(len(a) == len(b) and (not a or (a[1:] == b[1:] and a[0] <= b[0])) for a, b in pairs)


class PerChunkWorkspaces:
    """The fix: every chunk gets the buffers it declared."""

    name = "per_chunk"

    def buffers_for(self, own: WorkspaceShapes, r: ChunkRange, sub: ProblemSize) -> WorkspaceShapes:
        return own


@dataclass
class DeclaredOnceWorkspaces:
    """Before the fix: the shapes declared for the first chunk serve every chunk."""

    declared: WorkspaceShapes
    experts: object  # the Experts, named in the guard's message
    guard: bool
    name = "once"

    def buffers_for(self, own: WorkspaceShapes, r: ChunkRange, sub: ProblemSize) -> WorkspaceShapes:
        if self.guard and not same_layout(own, self.declared):
            raise WorkspaceShapeError(self._message(own, r, sub))
        return self.declared

    def _message(self, own: WorkspaceShapes, r: ChunkRange, sub: ProblemSize) -> str:
        d, name = self.declared, self.experts.name
        return (
            f"workspace_policy='once': {name} declared its workspaces once, for the first chunk, as "
            f"workspace13={d.workspace13}, workspace2={d.workspace2} ({d.dtype}). Chunk {r.index} "
            f"(tokens [{r.start}, {r.end}), M={sub.M}) runs backend '{self.experts.backend_for(sub)}', "
            f"which declares workspace13={own.workspace13}, workspace2={own.workspace2}. This is "
            "bug 1 of vLLM PR #20392: a dispatching experts class may change backend between "
            "chunks, so workspace shapes must be computed per chunk (workspace_policy='per_chunk'). "
            "(moekit's guard; upstream had no such check: ModularKernel(guard=False) replays it.)"
        )


def chunk_metadata(
    policy: str, whole: ExpertTokensMetadata | None, counts, *, single: bool
) -> ExpertTokensMetadata | None:
    """The tokens per expert a chunk is handed.

    ``counts`` are the chunk's own (device) counts, or None when nobody needs them. One chunk
    covering every row keeps prepare's metadata as it is (nothing to recount).
    """
    if whole is None or single or policy == "whole_batch":
        return whole
    # The CPU copy is blocking on purpose: consumers size buffers from it (upstream #20903).
    return ExpertTokensMetadata.from_counts(counts, with_cpu=whole.expert_num_tokens_cpu is not None)
