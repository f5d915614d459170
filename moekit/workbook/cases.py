"""Cases for the workbook's checks, drawn from the whole space each exercise's text allows.

A check draws its cases from a :class:`Sampler`; ``Sampler(seed)`` draws the same cases again,
so the seed that a failed check prints replays it. The edges are always among the draws: case
``i`` takes the ``i``-th ids dtype and expert map in turn, every batch holds each kind of id
that must not count (:meth:`Sampler.batch`), and each check adds its own pinned edges (empty
input, E = 1, whole tiles and one id past them, int16 ids of an expert past int16's limit,
E_local = NUM_BINS - 1 past int8's range). A case prints as its sizes (:class:`Routing`),
never as a tensor.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass

import torch
import triton

from moekit.routing import contiguous_expert_map, expert_blocks

ID_DTYPES = (torch.int16, torch.int32, torch.int64)  # every ids dtype moekit's kernels take
MAPS = ("none", "contiguous", "strided", "random")  # expert maps: none, and three ways to place experts
BLOCKS = (16, 32, 64, 128, 256)  # the ids' tile sizes the checks launch kernels with
HOT = 36_000  # pairs of one expert: past int16's limit, and past int8's in every lane of a 256-id tile
HOT_INT16 = {"hot": HOT, "E": 3, "dtype": torch.int16}  # an edge: counts past int16's limit, of int16 ids


def fresh_seed() -> int:
    """A seed for a check run that was given none."""
    return secrets.randbelow(2**31)


def num_bins(n: int) -> int:
    """The histogram's bins for ids below ``n``: a power of two above n, at least 32."""
    return max(32, triton.next_power_of_2(n + 1))


@dataclass(frozen=True)
class Routing:
    """The sizes of one batch of router decisions (what a failed case prints)."""

    M: int
    topk: int
    E: int  # global experts: ids outside [0, E) are empty slots (-1) or ids no expert has
    dtype: torch.dtype
    map: str = "none"  # one of MAPS
    ep: int = 1  # ranks the experts are placed on (with a map)
    rank: int = 0
    hot: int = 0  # pairs sent to one local expert, on purpose

    @property
    def num_local(self) -> int:
        if self.map == "strided":
            return len(range(self.rank, self.E, self.ep))
        return self.E if self.map == "none" else expert_blocks(self.E, self.ep)[self.rank]

    def __str__(self) -> str:
        where = "" if self.map == "none" else f", {self.map} map of rank {self.rank} of {self.ep}"
        hot = f", {self.hot} pairs to one expert" if self.hot else ""
        return f"{self.M}x{self.topk} {str(self.dtype)[6:]} ids, E={self.E}{where}{hot}"


@dataclass(frozen=True)
class Batch:
    """One draw of a :class:`Routing`'s values."""

    routing: Routing
    ids: torch.Tensor  # [M, topk] global ids
    expert_map: torch.Tensor | None  # [E]: local id, or -1 for another rank's expert
    num_local: int


class Sampler:
    """Seeded draws for one run of a check; ``case`` names the case the check is on, and
    ``cases`` counts the cases it began (:meth:`new_case`)."""

    def __init__(self, seed: int):
        self.seed, self.rng, self.case, self.cases = seed, random.Random(seed), "its first case", 0

    def new_case(self, case: str) -> None:
        """The check is now on ``case`` (what a failure names)."""
        self.case, self.cases = case, self.cases + 1

    def tensor(self, *shape: int) -> torch.Tensor:
        """Fresh ``randn`` values (never zeros), seeded from this run."""
        return torch.randn(*shape, generator=torch.Generator().manual_seed(self.rng.getrandbits(31)))

    def routing(self, i: int, *, max_experts: int = 512, **pinned) -> Routing:
        """The ``i``-th draw over the whole space: ids dtype and map in turn, the rest at random;
        ``pinned`` fields as given (``hot`` sizes M to hold it)."""
        r, kind, hot = self.rng, pinned.pop("map", MAPS[i % len(MAPS)]), pinned.pop("hot", 0)
        E = min(r.choice((2, r.randint(3, 64), r.randint(3, 64), r.randint(65, 512))), max_experts)
        E = pinned.pop("E", max(E, 4) if kind == "strided" else E)
        topk = pinned.pop("topk", r.randint(1, 8))
        ep = 1 if kind == "none" else r.randint(1, min(E, 8))
        ep = min(max(ep, 2), max(E // 2, 1)) if kind == "strided" else ep  # 2+ experts on each of 2+ ranks
        M = -(-hot * 5 // 4 // topk) if hot else r.choice((r.randint(8, 64), r.randint(65, 600)))  # (M=1: an edge)
        dtype = ID_DTYPES[i % len(ID_DTYPES)]
        drawn = dict(M=M, topk=topk, E=E, dtype=dtype, map=kind, ep=ep, rank=r.randrange(ep), hot=hot)
        return Routing(**{**drawn, **pinned})

    def routings(self, extra: int, *edges: dict, **pinned) -> list[Routing]:
        """``edges`` (pinned fields each), ``extra`` draws (4 or more take every ids dtype and
        map), then the last again (new values, same sizes: an answer kept from an earlier call
        fails there)."""
        drawn = [self.routing(self.rng.randrange(12), **{**edge, **pinned}) for edge in edges]
        drawn += [self.routing(i, **pinned) for i in range(extra)]
        return [*drawn, drawn[-1]]

    def expert_map(self, rt: Routing) -> torch.Tensor | None:
        """``rt``'s map (None without one): the local id of each of its rank's experts, else -1."""
        if rt.map == "none":
            return None
        g = torch.arange(rt.E)
        if rt.map == "contiguous":
            return contiguous_expert_map(rt.E, rt.ep, rt.rank).to(rt.dtype)
        if rt.map == "strided":
            return torch.where(g % rt.ep == rt.rank, g // rt.ep, -1).to(rt.dtype)
        local = torch.full((rt.E,), -1, dtype=rt.dtype)
        local[self.rng.sample(range(rt.E), rt.num_local)] = torch.arange(rt.num_local, dtype=rt.dtype)
        return local

    def batch(self, rt: Routing, *, block: int = 16, wrap_bits: int | None = None) -> Batch:
        """Fresh values for ``rt``: experts take 0, 1 or about a multiple of ``block`` pairs, one
        local expert takes ``rt.hot``, an eighth of the slots (at least 5, at most half; one of
        two or three ids) are ids that must not count, each kind in turn: a local expert plus 2**8,
        2**16 or 2**32 (int16, int32 or int64 ids; at most ``2**wrap_bits``, none for 0), which a
        cast to a narrower int turns into that expert (with int16 ids and E > 256 it may be another
        valid expert), -1, past E and past its bins. By default 2**32 only with an
        expert map: without one, a torch bincount of the raw ids would allocate 32 GiB (with one,
        such code gathers the map first and fails by name). A kernel on a GPU that gathers there
        faults: the kernel checks draw it in the interpreter only. The rest are uniform, and the
        last id is a local expert's (a loop that stops a tile early misses it)."""
        r, E, n = self.rng, rt.E, rt.M * rt.topk
        emap = self.expert_map(rt)
        local = list(range(E)) if emap is None else (emap >= 0).nonzero().flatten().tolist()
        flat = [r.choice(local)] * rt.hot
        for e in r.sample(range(E), E):
            if len(flat) >= n:
                break
            flat += [e] * r.choice((0, 1, block - 1, block, block + 1, 3 * block))
        bits = min(4 * rt.dtype.itemsize, wrap_bits if wrap_bits is not None else 16 if rt.map == "none" else 32)
        # the wrapped id first: a batch of two or three ids keeps it
        kinds = [2**bits + r.choice(local)] * (bits > 0) + [-1, E, E + 3, num_bins(E) + 1]
        bad = [kinds[j % len(kinds)] for j in range(min(n // 2, max(len(kinds), n // 8)))]
        flat = flat[: max(n - 1 - len(bad), 0)] + bad
        flat += [r.randrange(E) for _ in range(n - 1 - len(flat))]
        r.shuffle(flat)
        flat += [r.choice(local)] * bool(n)  # the last id counts
        return Batch(rt, torch.tensor(flat, dtype=torch.int64).view(rt.M, rt.topk).to(rt.dtype), emap, rt.num_local)

    def ranges(self, M: int) -> list[tuple[int, int]]:
        """Chunks of ``M`` rows: all of them, an empty one at the end and inside, and one at random."""
        s = self.rng.randrange(M) if M else 0
        return [(0, M), (M, M), (s, s), (s, self.rng.randint(s, M))]


__all__ = ["BLOCKS", "HOT", "HOT_INT16", "ID_DTYPES", "MAPS", "Batch", "Routing", "Sampler", "fresh_seed", "num_bins"]
