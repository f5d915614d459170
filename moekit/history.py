"""Upstream's chunk loop as it was between PR #20392 and its removal, as strategies to plug in.

vLLM's modular kernel kept its chunk loop for eight months after #20392 fixed it (``fdadb6f43``,
2025-07-10) until #34086 removed it (``2cdf92228``, 2026-03-13), and more bugs lived in it; four
of them, from the reference's timeline, are here. Each hash below is the upstream squash-merge
commit of the PR named beside it (vllm-project/vllm, checked in its git history). Each class is
one bug, small enough to read beside the upstream change that fixed it, and plugs into a real
:class:`moekit.ModularKernel` so that the real loop, experts and kernels meet the bug::

    kernel = moekit.ModularKernel(pf, experts, chunk_size=C)
    kernel.planner = history.TokenPlannerBefore26528(C)        # swap one strategy, then call it

==============================  =========================================  ===============================
class                           what upstream did (since)                  fixed by (merge commit, date)
==============================  =========================================  ===============================
TokenPlannerBefore26528         chunk count ``cdiv(M, min(M, C))``: a      #26528 ``1ee35382c`` 2025-10-09
                                rank with no tokens divides by zero
                                (#24812 ``da364615f``, 2025-10-08)
TokenPlannerBefore28728         ``a2_scale`` sliced ``(e, e)``: every      #28728 ``fd4555089`` 2025-11-14
                                chunk handed an empty per-token scale
                                (#24812 ``da364615f``, 2025-10-08)
ProfileRunReservation           the profile run's worst-case reservation   #30899 ``e3fc374a9`` 2025-12-17
  + LockablePool                sized from that run's own counts (#27426
                                ``1840c5cb1``, 2025-11-21); the workspace
                                locked afterwards (#27532 ``3e41992fe``)
TokenPlannerBefore29935         the chunking kill switch read, then        #29935 ``8372be282`` 2025-12-18
                                ignored: the loop asked the experts only
                                (#20392 ``fdadb6f43``, 2025-07-10)
==============================  =========================================  ===============================

None of them is a default, and none raises to imitate a bug: each computes what upstream
computed, and what fails is what failed there (Python's ZeroDivisionError; a locked workspace
refusing to grow, the mechanism of upstream's WorkspaceManager, which moekit's pool lacks and
:class:`LockablePool` adds), or moekit's guard where running on would be undefined. ``one_rank_group``
gives a notebook one rank of a process group, so that a collective prepare/finalize (whose
ranks join even with no tokens, as upstream's DeepEP ranks did) runs in one process.
"""

from __future__ import annotations

import contextlib

import torch

from moekit.errors import ChunkSizeError, InvalidInputError, MoekitError
from moekit.kernels.host_math import cdiv
from moekit.plan import TokenPlanner, slice_scales
from moekit.types import WorkspaceShapes
from moekit.validate import check_flag, check_positive_int
from moekit.workspace import WorkspacePool, pool_bytes

# VLLM_FUSED_MOE_CHUNK_SIZE's default at runtime from #7995 (34a0e96d4, 2024-08-30; 65536 since #6029,
# 12a59959e) until #27426 (1840c5cb1, 2025-11-21) lowered it to 16384; its type stub said 64 * 1024 until then.
# So 32768 is the default of #20392 (fdadb6f43) and of the loop the 26528 and 28728 replays show; the
# reservation replay (#27426 to #30899) ran at 16384 upstream, and the kill-switch bug lived under both.
UPSTREAM_CHUNK_SIZE = 32768


def _upstream_chunk_size(chunk_size) -> int:
    # Upstream always had a chunk size (the env var); None, moekit's "one chunk", did not exist there.
    return check_positive_int(chunk_size, "upstream's chunk size (VLLM_FUSED_MOE_CHUNK_SIZE)", error=ChunkSizeError)


class TokenPlannerBefore26528(TokenPlanner):
    """Token chunks counted as ``_chunk_info`` counted them from #24812 (``da364615f``, 2025-10-08)
    to #26528 (``1ee35382c``, 2025-10-09).

    Upstream took the chunk size as ``min(M, C)`` for experts that chunk (``max(M, 1)`` for the
    others), then ``num_chunks = cdiv(M, chunk size)``. A rank that receives no tokens has M = 0,
    so a chunking expert's chunk size is 0 and ``cdiv(0, 0)`` raises ZeroDivisionError (issue
    #26523, which #26528 names as fixed). The fix took ``max(1, ...)`` (``1ee35382c``). moekit
    plans no chunk for M = 0 (``chunk_ranges``), and without a collective stage its forward
    returns before planning.

    Args:
        chunk_size: C (default: upstream's default, 32768).
    """

    def __init__(self, chunk_size: int = UPSTREAM_CHUNK_SIZE):
        super().__init__(_upstream_chunk_size(chunk_size))
        self.num_chunks: int | None = None  # what the last plan counted

    def plan(self, experts, batch, pool):
        M = batch.problem.M
        size = min(M, self.chunk_size) if experts.supports_chunking else max(M, 1)
        self.num_chunks = cdiv(M, size)  # M = 0 with a chunking expert: cdiv(0, 0)
        return super().plan(experts, batch, pool)


class TokenPlannerBefore28728(TokenPlanner):
    """Token chunks whose ``a2_scale`` is sliced ``(e, e)``, the misprint of #24812 (``da364615f``)
    fixed by #28728 (``fd4555089``).

    A per-tensor scale (one element) passes the slicing whole (``_slice_scales`` at ``da364615f``,
    as ``_chunk_scales`` did at #20392, ``fdadb6f43``), so only per-token scales met the
    misprint, and each was cut to an empty slice: no chunk got the scales of its own tokens. A
    kernel that reads a per-row scale from an empty tensor reads past its end, which is undefined;
    moekit's guard (``ModularKernel(guard=True)``, the default) refuses such a chunk by name
    before its experts run.
    """

    @staticmethod
    def slice_a2(a2_scale: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
        return slice_scales(a2_scale, end, end)


class TokenPlannerBefore29935(TokenPlanner):
    """Token chunks that read a kill switch and then ignore it, as the loop did from #20392
    (``fdadb6f43``, 2025-07-10) to #29935 (``8372be282``, 2025-12-18).

    ``enable_chunking()`` (``VLLM_ENABLE_FUSED_MOE_ACTIVATION_CHUNKING and supports_chunking()``,
    from #19642, ``33d51f599``) still existed, but #20392's loop asked ``supports_chunking()``
    directly, so switching chunking off changed nothing. #29935 made the loop (and #27426's
    profile-run reservation) call ``enable_chunking()``; its PR reports better throughput with
    chunking off. In moekit the one switch is the constructor's ``chunk_size=None``, read in one
    place.

    Args:
        chunk_size: C.
        enable_chunking: the kill switch (upstream's env var, ``"1"`` by default).
    """

    def __init__(self, chunk_size: int = UPSTREAM_CHUNK_SIZE, *, enable_chunking: bool = True):
        super().__init__(_upstream_chunk_size(chunk_size))
        self.switch = check_flag(enable_chunking, "enable_chunking")

    def enable_chunking(self, experts) -> bool:
        """What the switch asks for (upstream's ``enable_chunking()``); nothing in the plan calls it."""
        return self.switch and experts.supports_chunking


class WorkspaceLockedError(MoekitError, RuntimeError):
    """A locked :class:`LockablePool` was asked for more bytes than it holds."""


class LockablePool(WorkspacePool):
    """A workspace pool that stops growing once locked, as upstream's WorkspaceManager after
    CUDA-graph capture: a request larger than the buffer then fails instead of growing it
    (upstream raised AssertionError; here WorkspaceLockedError, with both sizes).

    The WorkspaceManager came with #27532 (``3e41992fe``, 2025-12-12), titled as an attention
    change (a sparse prefill kernel for DeepSeek-V3.2's fp8 KV cache). What matters here is that
    it added ``vllm/v1/worker/workspace.py``, moved the modular kernel's workspaces from its
    per-class shared buffers into that one manager, and had the GPU model runner lock it after
    capturing the CUDA graphs."""

    workspace_locked = False  # until lock_workspace()

    def lock_workspace(self) -> None:
        """From now on, refuse to grow (upstream locked after capturing its CUDA graphs)."""
        self.workspace_locked = True

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the workspace buffer now (the most a locked pool hands out)."""
        return self._buffer.numel()

    def take(self, shapes: WorkspaceShapes):
        need = pool_bytes(shapes)
        if self.workspace_locked and need > self.capacity_bytes:
            raise WorkspaceLockedError(
                f"the workspace is locked at {self.capacity_bytes} bytes, and a chunk asks for {need} "
                f"(workspace13={shapes.workspace13}, workspace2={shapes.workspace2}, {shapes.dtype}); a locked "
                "workspace does not grow"
            )
        return super().take(shapes)


class ProfileRunReservation:
    """A workspace policy: every chunk gets its own shapes, and the first forward (the profile
    run) first reserves the worst case at C rows in the pool, as #27426 did (``1840c5cb1``,
    2025-11-21; upstream reserved at ``VLLM_FUSED_MOE_CHUNK_SIZE``, whose default the same
    commit lowered from 32768 to 16384).

    ``with_counts=True`` is the reservation before #30899 (``e3fc374a9``): it handed
    ``workspace_shapes`` the profile run's own tokens per expert, and an experts class that sizes
    from CPU counts (DeepGEMM's layout: every expert's rows padded to 128) then reserved for that
    run's routing, not for the worst. Once the pool is locked a later batch routed more widely
    asks for more, and fails. ``with_counts=False`` is #30899's fix: no counts, so the experts
    size the worst case for C rows.

    Args:
        pool: the kernel's pool (a :class:`LockablePool`; pass the same one as ``ModularKernel(pool=...)``).
        chunk_size: C, the rows the reservation is sized for.
        with_counts: hand the profile run's counts to the reservation (the bug) or not (the fix).
    """

    name = "per_chunk"

    def __init__(self, pool: WorkspacePool, chunk_size: int, *, with_counts: bool):
        self.pool, self.chunk_size, self.with_counts = pool, _upstream_chunk_size(chunk_size), with_counts
        self.reserved: WorkspaceShapes | None = None

    def given(self, own: WorkspaceShapes, chunk, plan) -> WorkspaceShapes:
        if self.reserved is None:
            batch = plan.batch
            meta = batch.prepared.tokens_meta if self.with_counts else None
            self.reserved = plan.experts.workspace_shapes(
                batch.problem.with_M(self.chunk_size), act_dtype=batch.prepared.a1q.dtype, tokens_meta=meta
            )
            self.pool.take(self.reserved)
        return own


@contextlib.contextmanager
def one_rank_group():
    """A process group of one rank in this process (the world), destroyed on exit: gloo on a
    CPU, NCCL where moekit runs on a GPU (:func:`moekit.distributed.default_backend`).

    Enough for a collective prepare/finalize (``All2AllPrepareFinalize``) to run a rank's whole
    forward in a notebook: the exchanges are local copies, and a rank with no tokens still plans.

    Raises:
        InvalidInputError: a process group is already initialized here.
    """
    import torch.distributed as dist

    from moekit.distributed import default_backend

    if dist.is_initialized():
        raise InvalidInputError("a process group is already initialized in this process")
    dist.init_process_group(default_backend(1), store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
