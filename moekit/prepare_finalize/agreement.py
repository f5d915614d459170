"""What the ranks of an all-to-all must agree on before any token moves, checked on every rank.

Ranks that disagree about the layer (a dtype of the same size, another K, another E, a placement
in which an expert has no owner or two, another dispatch mode or capacity) would otherwise
exchange bytes that mean different things on each side, or split sizes that do not match:
garbage, or gloo aborting the process. So every dispatch starts with one small, fixed-size
exchange: each rank's header

    [version, refused, dtype, K, E_global, E_local, topk, quant, mode, capacity, check,
     has map, map changed, bad map entries]

gathered to every rank. Every rank compares all headers and, on any difference, raises the same
named error naming which rank disagrees about what. ``refused`` is non-zero when the rank's own
inputs were rejected at the door (:meth:`Agreement.refuse`): the others then raise too, instead
of waiting for a rank that will never dispatch. The map's own columns are computed on the device
(no host read but the header's): whether its values changed since this rank last agreed, and how
many entries are neither -1 nor a local id (then every rank raises InvalidIdsError). When any
rank's map changed, the ranks gather their expert maps again and check that every expert has
exactly one owner. All ranks see the same headers, so they always take the same branch: nobody
is left waiting in a collective the others skipped.

Every exchange waits at most ``timeout_s`` (then :class:`~moekit.errors.DistributedError`).
``topk_ids`` need not agree in dtype: ids travel as int32 whatever each caller passed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit import errors
from moekit.distributed.collectives import all_gather
from moekit.errors import DistributedError, InvalidIdsError, InvalidInputError
from moekit.types import ExpertPlacement, QuantScheme

_VERSION = 3
WIRE_IDS = torch.int32  # the dtype expert ids travel in (E_global must fit)
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_QUANT = {QuantScheme.NONE: 0, QuantScheme.FP8_BLOCK: 1}
MODES, CHECKS = ("exact", "capacity"), ("sync", "deferred")  # of All2AllPrepareFinalize
REFUSED, E_LOCAL, HAS_MAP, CHANGED, BAD_MAP = 1, 5, 11, 12, 13  # columns that are per rank, not compared
# The compared columns and what to call them in a message.
_AGREED = {0: "header version", 2: "hidden dtype", 3: "K", 4: "global_num_experts", 6: "topk", 7: "quant scheme",
           8: "dispatch mode", 9: "max_tokens_per_rank", 10: "capacity check"}  # fmt: skip
_NAMES = {2: {v: str(k).removeprefix("torch.") for k, v in _DTYPES.items()}, 7: {v: k.value for k, v in _QUANT.items()},
          8: dict(enumerate(MODES)), 10: dict(enumerate(CHECKS))}  # fmt: skip
# A refused rank's error class travels as its index here (+1), so that its peers raise the same class.
_REFUSALS = (
    errors.InvalidIdsError,
    errors.InvalidInputError,
    errors.QuantizationError,
    errors.FormatMismatchError,
    errors.ChunkSizeError,
    errors.WorkspaceShapeError,
    errors.CapacityError,
    errors.StaleMetadataError,
    errors.BackendUnavailableError,
    errors.DistributedError,
    errors.MoekitError,
)


@dataclass(frozen=True)
class Dispatch:
    """How a stage dispatches (all ranks must match): ``mode``, capacity ``C`` (None in exact mode), ``check``."""

    mode: str = "exact"
    capacity: int | None = None
    check: str = "sync"


@dataclass(frozen=True)
class Layer:
    """What one agreement covers: while a call's layer equals the last agreed one, capacity mode
    exchanges nothing but its blocks (and a refusing rank builds blocks of the size its peers expect)."""

    dtype: torch.dtype
    K: int
    E: int
    E_local: int
    topk: int
    quant: QuantScheme
    dispatch: Dispatch


@dataclass(frozen=True)
class Placement:
    """Where every expert lives, as all ranks agreed.

    - ``owner[g]``, ``local[g]``: the rank that owns global expert g, and g's local id there;
    - ``sizes[r]``: how many experts rank r owns (blocks may differ in size);
    - ``position[g]``: g's place when experts are listed by (owner, local id); sorting pairs by
      it groups them by destination rank, then by the destination's local expert;
    - ``by_position``: the global ids in that order.
    """

    owner: torch.Tensor
    local: torch.Tensor
    sizes: tuple[int, ...]
    position: torch.Tensor
    by_position: torch.Tensor


def refusal_code(error: BaseException) -> int:
    """The code that tells the peers which named error a rank raised at its door (1-based; an error
    of no listed class travels as MoekitError, the last)."""
    return next((i for i, cls in enumerate(_REFUSALS, 1) if isinstance(error, cls)), len(_REFUSALS))


def _refused_class(code: int) -> type[errors.MoekitError]:
    return _REFUSALS[code - 1] if 0 < code <= len(_REFUSALS) else DistributedError


def refusal_error(codes: dict[int, int], rank: int) -> errors.MoekitError:
    """The error a rank raises when ranks ``codes`` (rank -> refusal code) rejected their inputs."""
    first = min(codes)
    names = {r: _refused_class(c).__name__ for r, c in codes.items()}
    return _refused_class(codes[first])(
        f"rank(s) {sorted(codes)} rejected their inputs before the dispatch ({names}); rank {rank} raises too, so "
        f"that no rank waits in a collective for them. What was wrong is in rank {first}'s own {names[first]}."
    )


def raise_for_peers(rows: list[list[int]], *, refused: int, bad_map: int, rank: int) -> None:
    """Raise on every rank (this is ``rank``) what the rows of all ranks (headers, or capacity mode's flags)
    say in columns ``refused`` (a refusal code: the refusing ranks' error class) and ``bad_map`` (how many
    map entries are neither -1 nor a local id: InvalidIdsError)."""
    codes = {r: row[refused] for r, row in enumerate(rows) if row[refused]}
    if codes:
        raise refusal_error(codes, rank)
    bad_maps = {r: row[bad_map] for r, row in enumerate(rows) if row[bad_map]}
    if bad_maps:
        raise InvalidIdsError(
            f"expert_map entries must be -1 (another rank's expert) or a local id in [0, E_local) of their "
            f"rank; rank(s) {sorted(bad_maps)} passed {bad_maps} other entries (seen from rank {rank})"
        )


def bad_map_entries(placement: ExpertPlacement) -> int | torch.Tensor:
    """Entries of this rank's map that are neither -1 nor a local id: 0 without a map, else an int64
    scalar on the map's device (counted there: no host sync)."""
    emap = placement.expert_map
    if emap is None:
        return 0
    return ((emap != -1) & ((emap < 0) | (emap >= placement.num_local_experts))).sum().long()


class Agreement:
    """Checks one stage's calls against the other ranks' (one per All2AllPrepareFinalize).

    The agreed :class:`Placement` is kept with a private copy of the map this rank agreed with
    (the caller's tensor is the caller's: it may be rewritten in place, by a numpy view or
    ``.data`` without a version bump, or be a new tensor at a freed one's address). Every call
    compares the map with that copy on the device and sends the answer in its header, so the
    ranks agree again whenever any rank's map changed, with no host read beyond the header's.

    Args:
        group: the process group; ``timeout_s``: the longest wait of each exchange (None: the
            group's own timeout); ``dispatch``: this stage's :class:`Dispatch`.

    ``layer`` is the :class:`Layer` of the last check that passed (None before, after a failure,
    or when the stage sets it to None to make the next check exchange headers again).
    """

    def __init__(self, group, *, timeout_s: float | None = None, dispatch: Dispatch = Dispatch()):
        self.group, self.timeout_s, self.dispatch = group, timeout_s, dispatch
        self.layer: Layer | None = None
        self._placement: Placement | None = None
        self._agreed_with: tuple | None = None  # (E_global, E_local, copy of this rank's map or None)

    def changed(self, placement: ExpertPlacement) -> int | torch.Tensor:
        """1 when this rank's placement is not the one it last agreed with, else 0: an int, or an int64
        scalar on the map's device (compared there: no host sync)."""
        agreed, emap = self._agreed_with, placement.expert_map
        if agreed is None or agreed[:2] != (placement.global_num_experts, placement.num_local_experts):
            return 1
        if emap is None or agreed[2] is None:
            return int((emap is None) != (agreed[2] is None))
        if agreed[2].device != emap.device:
            return 1
        return (emap.reshape(-1).long() != agreed[2]).any().long()

    def _header(self, refused: int, layer: list[int], per_rank: tuple, device) -> list[list[int]]:
        """Every rank's header (the columns in the module docstring): ``layer`` holds this rank's codes of
        dtype, K, E_global, E_local, topk and quant; ``per_rank`` has map, map changed, bad map entries."""
        d = self.dispatch
        dispatch = [MODES.index(d.mode), d.capacity or 0, CHECKS.index(d.check)]
        mine = torch.tensor([_VERSION, refused, *layer, *dispatch, 0, 0, 0], dtype=torch.int64, device=device)
        for column, value in zip((HAS_MAP, CHANGED, BAD_MAP), per_rank, strict=True):
            mine[column] = value  # a device scalar is copied there: still no host read
        return torch.stack(self._gather(mine, "the agreement header")).cpu().tolist()  # the host sync of this check

    def refuse(self, error: BaseException, device) -> None:
        """Join the header exchange saying "my inputs were rejected" (with ``error``'s class), so
        that the other ranks' :meth:`check` raises instead of waiting for this rank."""
        self._header(refusal_code(error), [0] * 6, (0, 0, 0), device)

    def check(
        self, hidden: torch.Tensor, topk: int, quant: QuantScheme, placement: ExpertPlacement, *, reuse: bool = False
    ) -> Placement:
        """Exchange headers, raise on any disagreement (or a peer's refusal), return the agreed placement.
        With ``reuse``, a call whose layer is the one last agreed on exchanges nothing."""
        E, E_local = placement.global_num_experts, placement.num_local_experts
        layer = Layer(hidden.dtype, hidden.shape[1], E, E_local, topk, quant, self.dispatch)
        if reuse and layer == self.layer:
            return self._placement
        self.layer = None
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        codes = [_DTYPES.get(hidden.dtype, 0), hidden.shape[1], E, E_local, topk, _QUANT[quant]]
        per_rank = (int(placement.expert_map is not None), self.changed(placement), bad_map_entries(placement))
        rows = self._header(0, codes, per_rank, hidden.device)
        raise_for_peers(rows, refused=REFUSED, bad_map=BAD_MAP, rank=rank)
        for col, field in _AGREED.items():
            values = {r: _NAMES.get(col, {}).get(row[col], row[col]) for r, row in enumerate(rows)}
            if len(set(values.values())) > 1:
                raise InvalidInputError(_disagreement(field, values, rank))
        if E > torch.iinfo(WIRE_IDS).max:  # the same E on every rank: every rank raises
            raise InvalidInputError(f"global_num_experts={E} does not fit the int32 ids of the all-to-all")
        unmapped = [r for r, row in enumerate(rows) if row[HAS_MAP] == 0]
        if world > 1 and unmapped:
            raise InvalidInputError(
                f"rank(s) {unmapped} of {world} got no expert_map (seen from rank {rank}); on every rank r pass "
                f"expert_map=moekit.routing.contiguous_expert_map({E}, {world}, r)"
            )
        if self._placement is None or any(row[CHANGED] for row in rows):  # every rank sees the same rows
            self._placement, self._agreed_with = None, None
            self._placement = self._gather_placement(placement, rows, world, hidden.device)
            emap = placement.expert_map
            copy = None if emap is None else emap.detach().reshape(-1).to(torch.int64, copy=True)
            self._agreed_with = (E, E_local, copy)
        self.layer = layer
        return self._placement

    def _gather_placement(self, placement: ExpertPlacement, rows, world: int, device) -> Placement:
        E = placement.global_num_experts
        # No map: one rank (checked above), which owns every expert.
        emap = torch.arange(E, device=device) if placement.expert_map is None else placement.expert_map
        maps = torch.stack(self._gather(emap.to(device=device, dtype=torch.int64).reshape(-1), "the expert maps")).cpu()
        owned = maps >= 0
        problems = []
        per_expert = owned.sum(0)
        bad = (per_expert != 1).nonzero().flatten().tolist()[:8]
        if bad:
            problems.append(f"experts {bad} have {per_expert[bad].tolist()} owners (each needs exactly one)")
        for r in range(world):
            local, count = sorted(maps[r][owned[r]].tolist()), rows[r][E_LOCAL]
            if local != list(range(count)):
                problems.append(f"rank {r}'s map gives local ids {local[:8]} for its {count} experts (w1 rows)")
        if problems:
            raise InvalidInputError("the ranks' expert maps do not form one placement: " + "; ".join(problems))
        owner = owned.int().argmax(0)  # exactly one owner per expert
        local = maps.gather(0, owner.view(1, E)).view(E)
        by_position = torch.argsort(owner * E + local)
        position = torch.argsort(by_position)  # the inverse permutation
        sizes = tuple(owned.sum(1).tolist())
        return Placement(owner.to(device), local.to(device), sizes, position.to(device), by_position.to(device))

    def _gather(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        return all_gather(t, what=what, group=self.group, timeout_s=self.timeout_s)


def _disagreement(field: str, shown: dict[int, object], rank: int) -> str:
    common = Counter(shown.values()).most_common(1)[0][0]  # ties: the first seen, in rank order
    odd = [r for r, v in shown.items() if v != common]
    return (
        f"the ranks disagree about the MoE layer's {field}: rank(s) {odd} have "
        f"{', '.join(str(shown[r]) for r in odd)} where the others have {common} (seen from rank {rank}: "
        f"{shown}). Every rank must call forward with the same dtype, K, E_global, topk and quant scheme, "
        "through stages built alike (mode, max_tokens_per_rank, check)."
    )
