"""What the ranks of an all-to-all must agree on before any token moves, checked on every rank.

Ranks that disagree about the layer (a dtype of the same size, another K, another E, a placement
in which an expert has no owner or two) would otherwise exchange bytes that mean different things
on each side, or split sizes that do not match: garbage, or gloo aborting the process. So every
dispatch starts with one small, fixed-size exchange: each rank's header

    [version, dtype, K, E_global, E_local, topk, quant, placement hash]

gathered to every rank. Every rank compares all headers and, on any difference, raises the same
named error naming which rank disagrees about what. When the tuple of placement hashes is new,
the ranks also gather their expert maps and check that every expert has exactly one owner; the
agreed :class:`Placement` is cached for that tuple. All ranks see the same headers, so they
always take the same branch: nobody is left waiting in a collective the others skipped.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.errors import InvalidInputError
from moekit.types import ExpertPlacement, QuantScheme

_VERSION = 1
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_FIELDS = ("header version", "hidden dtype", "K", "global_num_experts", "local experts (w1 rows)", "topk",
           "quant scheme", "expert placement")  # fmt: skip
_QUANT = {QuantScheme.NONE: 0, QuantScheme.FP8_BLOCK: 1}


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


def _map_hash(placement: ExpertPlacement) -> int:
    emap = placement.expert_map
    if emap is None:
        return 0
    data = emap.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return zlib.crc32(data) & 0x7FFFFFFF


class Agreement:
    """Checks one stage's calls against the other ranks' (one per All2AllPrepareFinalize)."""

    def __init__(self, group):
        self.group = group
        self._hash_seen: tuple | None = None  # (map identity) -> hash, to avoid a host read per call
        self._hash = 0
        self._placements: dict[tuple[int, ...], Placement] = {}

    def local_hash(self, placement: ExpertPlacement) -> int:
        """A hash of this rank's expert map (recomputed only when the map tensor changes)."""
        emap = placement.expert_map
        seen = None if emap is None else (emap.data_ptr(), emap._version, emap.numel(), str(emap.device))
        if seen != self._hash_seen or emap is None:
            self._hash, self._hash_seen = _map_hash(placement), seen
        return self._hash

    def check(self, hidden: torch.Tensor, topk: int, quant: QuantScheme, placement: ExpertPlacement) -> Placement:
        """Exchange headers, raise on any disagreement, return the agreed placement."""
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        mine = [_VERSION, _DTYPES.get(hidden.dtype, 0), hidden.shape[1], placement.global_num_experts,
                placement.num_local_experts, topk, _QUANT[quant], self.local_hash(placement)]  # fmt: skip
        headers = _gather(torch.tensor(mine, dtype=torch.int64, device=hidden.device), world, self.group)
        rows = headers.cpu().tolist()  # the host sync of this check
        for i, field in enumerate(_FIELDS[:4] + _FIELDS[5:7]):
            col = i if i < 4 else i + 1
            values = {r: row[col] for r, row in enumerate(rows)}
            if len(set(values.values())) > 1:
                raise InvalidInputError(_disagreement(field, values, rank))
        key = tuple(row[7] for row in rows) + tuple(row[4] for row in rows)
        if key not in self._placements:
            self._placements[key] = self._gather_placement(placement, rows, world, hidden.device)
        return self._placements[key]

    def _gather_placement(self, placement: ExpertPlacement, rows, world: int, device) -> Placement:
        E = placement.global_num_experts
        emap = placement.expert_map
        if emap is None:
            if world > 1:
                raise InvalidInputError(
                    f"rank {dist.get_rank(self.group)} of {world} got no expert_map; pass "
                    f"expert_map=moekit.routing.contiguous_expert_map({E}, {world}, rank)"
                )
            emap = torch.arange(E, device=device)
        maps = _gather(emap.to(device=device, dtype=torch.int64).reshape(-1), world, self.group).view(world, E).cpu()
        owned = maps >= 0
        problems = []
        per_expert = owned.sum(0)
        if bool((per_expert != 1).any()):
            bad = (per_expert != 1).nonzero().flatten().tolist()[:8]
            problems.append(f"experts {bad} have {per_expert[bad].tolist()} owners (each needs exactly one)")
        for r in range(world):
            local = sorted(maps[r][owned[r]].tolist())
            if local != list(range(rows[r][4])):
                problems.append(f"rank {r}'s map gives local ids {local[:8]} for its {rows[r][4]} experts (w1 rows)")
        if problems:
            raise InvalidInputError("the ranks' expert maps do not form one placement: " + "; ".join(problems))
        owner = owned.int().argmax(0)  # exactly one owner per expert
        local = maps.gather(0, owner.view(1, E)).view(E)
        by_position = torch.argsort(owner * E + local)
        position = torch.empty_like(by_position)
        position[by_position] = torch.arange(E)
        sizes = tuple(owned.sum(1).tolist())
        return Placement(owner.to(device), local.to(device), sizes, position.to(device), by_position.to(device))


def _gather(t: torch.Tensor, world: int, group) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous(), group=group)
    return torch.stack(out)


def _disagreement(field: str, values: dict[int, int], rank: int) -> str:
    names = {v: k for k, v in _DTYPES.items()} if field == "hidden dtype" else None
    shown = {r: (str(names.get(v, v)).removeprefix("torch.") if names else v) for r, v in values.items()}
    counts: dict = {}
    for v in shown.values():
        counts[v] = counts.get(v, 0) + 1
    common = max(counts, key=counts.get)
    odd = [r for r, v in shown.items() if v != common]
    return (
        f"the ranks disagree about the MoE layer's {field}: rank(s) {odd} have "
        f"{', '.join(str(shown[r]) for r in odd)} where the others have {common} (seen from rank {rank}: "
        f"{shown}). Every rank must call forward with the same dtype, K, E_global, topk and quant scheme."
    )
