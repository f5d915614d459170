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

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit import errors
from moekit.errors import DistributedError, InvalidIdsError, InvalidInputError
from moekit.types import ExpertPlacement, QuantScheme

_VERSION = 3
WIRE_IDS = torch.int32  # the dtype expert ids travel in (E_global must fit)
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_QUANT = {QuantScheme.NONE: 0, QuantScheme.FP8_BLOCK: 1}
_MODES, _CHECKS = ("exact", "capacity"), ("sync", "deferred")
REFUSED, E_LOCAL, HAS_MAP, CHANGED, BAD_MAP = 1, 5, 11, 12, 13  # columns that are per rank, not compared
# The compared columns and what to call them in a message.
_AGREED = {0: "header version", 2: "hidden dtype", 3: "K", 4: "global_num_experts", 6: "topk", 7: "quant scheme",
           8: "dispatch mode", 9: "max_tokens_per_rank", 10: "capacity check"}  # fmt: skip
_NAMES = {2: {v: str(k).removeprefix("torch.") for k, v in _DTYPES.items()}, 7: {v: k.value for k, v in _QUANT.items()},
          8: dict(enumerate(_MODES)), 10: dict(enumerate(_CHECKS))}  # fmt: skip
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
    """The code that tells the peers which named error a rank raised at its door (1-based)."""
    for cls in type(error).__mro__:
        if cls in _REFUSALS:
            return _REFUSALS.index(cls) + 1
    return _REFUSALS.index(errors.MoekitError) + 1


def refusal_error(codes: dict[int, int], rank: int) -> errors.MoekitError:
    """The error a rank raises when ranks ``codes`` (rank -> refusal code) rejected their inputs."""
    first = min(codes)
    cls = _REFUSALS[codes[first] - 1] if 0 < codes[first] <= len(_REFUSALS) else DistributedError
    names = {r: (_REFUSALS[c - 1] if 0 < c <= len(_REFUSALS) else DistributedError).__name__ for r, c in codes.items()}
    return cls(
        f"rank(s) {sorted(codes)} rejected their inputs before the dispatch ({names}); rank {rank} raises too, so "
        f"that no rank waits in a collective for them. What was wrong is in rank {first}'s own {names[first]}."
    )


def wait(work, *, timeout_s: float | None, what: str, group) -> None:
    """Wait for an async collective, at most ``timeout_s`` seconds (None: the group's own timeout)."""
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise DistributedError(
            f"{what} failed or timed out on rank {dist.get_rank(group)} (timeout_s={timeout_s}): {e}. Every rank "
            "must call forward, including ranks with no tokens. After a timeout the group's collectives are out "
            "of step (with NCCL the communicator is unusable): destroy the process group and start a new one."
        ) from e


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
    """

    def __init__(self, group, *, timeout_s: float | None = None, dispatch: Dispatch = Dispatch()):
        self.group, self.timeout_s, self.dispatch = group, timeout_s, dispatch
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

    def _header(self, refused: int, fields: list, device) -> list[list[int]]:
        d = self.dispatch
        dispatch = [_MODES.index(d.mode), d.capacity or 0, _CHECKS.index(d.check)]
        per_rank = fields[6:] if fields[6:] else [0, 0, 0]  # has map, changed, bad map entries
        mine = torch.tensor([_VERSION, refused, *fields[:6], *dispatch, 0, 0, 0], dtype=torch.int64, device=device)
        for column, value in zip((HAS_MAP, CHANGED, BAD_MAP), per_rank, strict=True):
            mine[column] = value  # a device scalar is copied there: still no host read
        world = dist.get_world_size(self.group)
        headers = self._gather(mine, world, "the agreement header")
        return headers.cpu().tolist()  # the host sync of this check

    def refuse(self, error: BaseException, device) -> None:
        """Join the header exchange saying "my inputs were rejected" (with ``error``'s class), so
        that the other ranks' :meth:`check` raises instead of waiting for this rank."""
        self._header(refusal_code(error), [0] * 6, device)

    def check(self, hidden: torch.Tensor, topk: int, quant: QuantScheme, placement: ExpertPlacement) -> Placement:
        """Exchange headers, raise on any disagreement (or a peer's refusal), return the agreed placement."""
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        fields = [
            _DTYPES.get(hidden.dtype, 0),
            hidden.shape[1],
            placement.global_num_experts,
            placement.num_local_experts,
            topk,
            _QUANT[quant],
            int(placement.expert_map is not None),
            self.changed(placement),
            bad_map_entries(placement),
        ]
        rows = self._header(0, fields, hidden.device)
        refused = {r: row[REFUSED] for r, row in enumerate(rows) if row[REFUSED]}
        if refused:
            raise refusal_error(refused, rank)
        for col, field in _AGREED.items():
            values = {r: _NAMES.get(col, {}).get(row[col], row[col]) for r, row in enumerate(rows)}
            if len(set(values.values())) > 1:
                raise InvalidInputError(_disagreement(field, values, rank))
        E = placement.global_num_experts
        if E > torch.iinfo(WIRE_IDS).max:  # the same E on every rank: every rank raises
            raise InvalidInputError(f"global_num_experts={E} does not fit the int32 ids of the all-to-all")
        bad_maps = {r: row[BAD_MAP] for r, row in enumerate(rows) if row[BAD_MAP]}
        if bad_maps:
            raise InvalidIdsError(
                f"expert_map entries must be -1 (another rank's expert) or a local id in [0, E_local) of their "
                f"rank; rank(s) {sorted(bad_maps)} passed {bad_maps} other entries (seen from rank {rank})"
            )
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
            self._agreed_with = (placement.global_num_experts, placement.num_local_experts, copy)
        return self._placement

    def _gather_placement(self, placement: ExpertPlacement, rows, world: int, device) -> Placement:
        E = placement.global_num_experts
        emap = placement.expert_map
        if emap is None:  # one rank (checked above): it owns every expert
            emap = torch.arange(E, device=device)
        maps = self._gather(emap.to(device=device, dtype=torch.int64).reshape(-1), world, "the expert maps")
        maps = maps.view(world, E).cpu()
        owned = maps >= 0
        problems = []
        per_expert = owned.sum(0)
        if bool((per_expert != 1).any()):
            bad = (per_expert != 1).nonzero().flatten().tolist()[:8]
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
        position = torch.empty_like(by_position)
        position[by_position] = torch.arange(E)
        sizes = tuple(owned.sum(1).tolist())
        return Placement(owner.to(device), local.to(device), sizes, position.to(device), by_position.to(device))

    def _gather(self, t: torch.Tensor, world: int, what: str) -> torch.Tensor:
        out = [torch.empty_like(t) for _ in range(world)]
        work = dist.all_gather(out, t.contiguous(), group=self.group, async_op=True)
        wait(work, timeout_s=self.timeout_s, what=f"all_gather of {what}", group=self.group)
        return torch.stack(out)


def _disagreement(field: str, shown: dict[int, object], rank: int) -> str:
    counts: dict = {}
    for v in shown.values():
        counts[v] = counts.get(v, 0) + 1
    common = max(counts, key=counts.get)
    odd = [r for r, v in shown.items() if v != common]
    return (
        f"the ranks disagree about the MoE layer's {field}: rank(s) {odd} have "
        f"{', '.join(str(shown[r]) for r in odd)} where the others have {common} (seen from rank {rank}: "
        f"{shown}). Every rank must call forward with the same dtype, K, E_global, topk and quant scheme, "
        "through stages built alike (mode, max_tokens_per_rank, check)."
    )
