"""Named errors. Every public entry point validates its inputs and raises one of these.

Each message says what was expected and what came, so that a reader can fix the call without
reading moekit's source. All of them subclass :class:`MoekitError`, and the ones about bad
arguments also subclass :class:`ValueError`, so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class MoekitError(Exception):
    """Base class of every error moekit raises on purpose."""


class InvalidInputError(MoekitError, ValueError):
    """A tensor argument has the wrong rank, shape, dtype, device or layout."""


class InvalidIdsError(InvalidInputError):
    """``topk_ids`` (or an ``expert_map``) is not a signed integer tensor of the expected shape,
    or holds an id that cannot be resolved."""


class FormatMismatchError(MoekitError, TypeError):
    """A prepare/finalize stage and an experts class disagree on the activation format."""


class WorkspaceShapeError(MoekitError, RuntimeError):
    """A workspace or output buffer does not have the shape the experts declared for this chunk."""


class ChunkSizeError(MoekitError, ValueError):
    """The chunk size is not a positive int (or None)."""


class QuantizationError(MoekitError, ValueError):
    """Weights, scales or shapes do not fit the quantization scheme the experts ask for."""


class CapacityError(MoekitError, RuntimeError):
    """More tokens went to one expert than a batched buffer can hold (``max_tokens``)."""


class StaleMetadataError(MoekitError, RuntimeError):
    """``ExpertTokensMetadata`` does not describe the tokens it came with (bug 2 of PR #20392)."""


class BackendUnavailableError(MoekitError, RuntimeError):
    """An optional backend (deep_gemm) was asked for but cannot run here."""


class OptionalDependencyError(MoekitError, ImportError):
    """An optional extra (for example ``moekit[hf]``) is needed but not installed."""


class DistributedError(MoekitError, RuntimeError):
    """A rank of a torch.distributed run failed; the message holds that rank's traceback."""


class UnsupportedModelError(MoekitError, ValueError):
    """A model's MoE layers do not use the gated ``gate_up_proj``/``down_proj`` layout."""


class ExerciseFailed(MoekitError, AssertionError):
    """A workbook check (:mod:`moekit.workbook`) found a case the learner's code gets wrong; the
    message names the case, what was expected and what came."""


__all__ = [
    "BackendUnavailableError",
    "CapacityError",
    "ChunkSizeError",
    "DistributedError",
    "ExerciseFailed",
    "FormatMismatchError",
    "InvalidIdsError",
    "InvalidInputError",
    "MoekitError",
    "OptionalDependencyError",
    "QuantizationError",
    "StaleMetadataError",
    "UnsupportedModelError",
    "WorkspaceShapeError",
]
