"""A mutation run over moekit's core: plant one small bug at a time and see whether a test catches it.

::

    python -m tools.mutation                  # every mutant (about 15 minutes on 2 cores)
    python -m tools.mutation --only count     # the mutants whose name contains "count"
    python -m tools.mutation --list           # the table, without running it
    make mutation                             # the same run, from a fresh .venv

Each mutant names a file, one exact piece of its text, what replaces it, and the tests that
should catch it. The run copies the repository's tracked files to a temporary folder once,
checks that the tests pass there unmutated, then for each mutant writes the change, runs its
tests (``pytest -x``) and puts the file back. A mutant is **caught** when its tests fail,
**survived** when they pass. A survivor is a test gap, unless the table says why the change is
equivalent (``equivalent=...``: the mutant cannot change any result, and the reason is written
down). The exit status is 1 when a mutant survived that is not marked equivalent, or when a
mutant's text is no longer in its file (the table must follow the code; ``tests/tools``
checks that without running anything).

moekit's own tool; mutants are hand-written to the issue's list (the gaps a mutation run found in
December 2026) and to the core's contracts, not generated.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = ("-q", "-x", "-p", "no:cacheprovider", "-m", "not gpu")


@dataclass(frozen=True)
class Mutant:
    """One planted bug: ``old`` (exactly once in ``path``) becomes ``new``; ``tests`` should fail."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    equivalent: str = ""  # why no test can catch it, when that is the case


VALIDATE, COUNT, ALIGN = "moekit/validate.py", "moekit/kernels/count.py", "moekit/kernels/align.py"
PLAN, MK, WS = "moekit/plan.py", "moekit/modular_kernel.py", "moekit/workspace.py"
AGREE, CAP, A2A = "moekit/prepare_finalize/agreement.py", "moekit/prepare_finalize/capacity.py", "moekit/prepare_finalize/all2all.py"
T_VALIDATE, T_MK, T_COUNT, T_ALIGN = "tests/test_validate.py", "tests/test_modular_kernel.py", "tests/kernels/test_count.py", "tests/kernels/test_align.py"
T_PLAN, T_AGREE, T_A2A = "tests/test_plan.py", "tests/prepare_finalize/test_agreement.py", "tests/prepare_finalize/test_all2all.py"
T_CAP, T_BATCHED = "tests/prepare_finalize/test_capacity.py", "tests/prepare_finalize/test_batched.py"

MUTANTS = (
    # The door: values and ranges.
    Mutant("map entry == E_local accepted", VALIDATE, "(expert_map >= num_local)", "(expert_map > num_local)", (T_MK, T_VALIDATE)),
    Mutant("negative map entries accepted", VALIDATE, "((expert_map < 0) | (expert_map >= num_local))", "(expert_map >= num_local)", (T_MK, T_VALIDATE)),
    Mutant("map values never read", VALIDATE, "    if expert_map is not None and values:\n", "    if False:\n", (T_MK, T_VALIDATE)),
    Mutant("zero scale accepted", VALIDATE, "torch.isfinite(scale) & (scale > 0)", "torch.isfinite(scale) & (scale >= 0)", (T_MK,)),
    Mutant("NaN scale accepted", VALIDATE, "torch.isfinite(scale) & (scale > 0)", "(scale > 0) | (scale != scale)", (T_MK,)),
    Mutant("id == E accepted at the door", VALIDATE, "high >= global_num_experts", "high > global_num_experts", (T_VALIDATE, T_MK)),
    Mutant("ids below -1 accepted", VALIDATE, "if low < -1 or", "if low < -2 or", (T_VALIDATE, T_MK)),
    Mutant("one expert more than the limit", VALIDATE, "    if value > MAX_EXPERTS:", "    if value > MAX_EXPERTS + 1:", (T_VALIDATE, T_COUNT)),
    Mutant("unsigned ids accepted", VALIDATE, "    if topk_ids.dtype not in _SIGNED_INT:", "    if topk_ids.dtype not in _SIGNED_INT + _UNSIGNED_INT:", (T_VALIDATE, T_COUNT)),
    Mutant("w2 shape not checked", VALIDATE, "    if w2.shape != (E, K, N // 2):", "    if w2.shape[0] != E:", (T_VALIDATE,)),
    Mutant("odd N accepted", VALIDATE, "    if N % 2 or N == 0:", "    if N == 0:", (T_VALIDATE,)),
    # The count kernel.
    Mutant("count: id == limit counted", COUNT, "ok = (ids >= 0) & (ids < id_limit)", "ok = (ids >= 0) & (ids <= id_limit)", (T_COUNT,)),
    Mutant("count: map entry == num_local counted", COUNT, "ok = ok & (local >= 0) & (local < num_local)", "ok = ok & (local >= 0) & (local <= num_local)", (T_COUNT,)),
    Mutant("count: several programs store instead of add", COUNT, "    if SOLO:  # the only program", "    if True:  # the only program", (T_COUNT,)),
    Mutant("count: last tile skipped", COUNT, "    for t in range(pid, num_tiles, step):", "    for t in range(pid, num_tiles - 1, step):", (T_COUNT,)),
    Mutant("count: scan reads one tile", COUNT, "    for t in range(tl.cdiv(numel, BLOCK)):", "    for t in range(1):", (T_COUNT,)),
    # The align.
    Mutant("align: id == E reads the map", ALIGN, "valid = live & (g >= 0) & (g < E)", "valid = live & (g >= 0) & (g <= E)", (T_ALIGN,)),
    Mutant("align: remote experts kept local", ALIGN, "local = valid & (entry >= 0) & (entry < num_local)", "local = valid & (entry >= -1) & (entry < num_local)", (T_ALIGN,)),
    Mutant("align: unstable order in a tile", ALIGN, "(offs[None, :] < offs[:, None])", "(offs[None, :] > offs[:, None])", (T_ALIGN,)),
    Mutant("align: padding not rounded up", ALIGN, "padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M", "padded = totals // BLOCK_M * BLOCK_M", (T_ALIGN,)),
    Mutant("align: scan misses the carry", ALIGN, "        carry += tl.sum(c, axis=0)\n", "", (T_ALIGN,)),
    Mutant("align: bound one block short", ALIGN, "    bound = numel + min(numel, num_buckets) * (block_m - 1)", "    bound = numel + min(numel, num_buckets - 1) * (block_m - 1)", (T_ALIGN,),
           equivalent="the bound is rounded up to whole blocks, and the rows needed are a multiple of block_m at most block_m - 1 above the shorter bound, so the rounded bound never changes"),
    # The plan and the loop.
    Mutant("plan: last chunk dropped", PLAN, "tuple(kind(i, s, min(s + C, M)) for i, s in enumerate(range(0, M, C)))", "tuple(kind(i, s, min(s + C, M)) for i, s in enumerate(range(0, M - 1, C)))", (T_PLAN, T_MK)),
    Mutant("plan: per-token a2 not sliced", PLAN, "    return scale[start:end]", "    return scale", (T_PLAN, T_MK)),
    Mutant("plan: C >= M becomes C > M", PLAN, "    if C is None or C >= M:", "    if C is None or C > M:", (T_PLAN,),
           equivalent="with C == M, range(0, M, C) yields the one chunk (0, M): the same tuple either way"),
    Mutant("loop: whole-batch counts for every chunk (bug 2)", MK, "        if whole is None or single:\n            return whole\n", "        return whole\n", (T_MK,)),
    Mutant("loop: one chunk's counts not prepare's", MK, "        if plan.single and whole_meta is not None:", "        if False:", (T_MK,),
           equivalent="a single chunk's recount equals prepare's counts; only the launch count differs, and no CPU test counts launches on that path"),
    Mutant("loop: guard never refuses", MK, "        if self.guard and not same_layout(own, declared):", "        if False:", (T_MK, "tests/test_modular_kernel_policies.py")),
    Mutant("workspace: no growth", WS, "        if need > self._buffer.numel():", "        if self._buffer.numel() == 0:", ("tests/test_workspace.py", T_MK)),
    # Expert parallelism.
    Mutant("agreement: a changed map not seen", AGREE, "        return (emap.reshape(-1).long() != agreed[2]).any().long()", "        return 0", (T_A2A,)),
    Mutant("agreement: bad map entries not counted", AGREE, "    return ((emap != -1) & ((emap < 0) | (emap >= placement.num_local_experts))).sum().long()", "    return 0", (T_AGREE, T_A2A)),
    Mutant("agreement: placement never gathered again", AGREE, "if self._placement is None or any(row[CHANGED] for row in rows):", "if self._placement is None:", (T_A2A,)),
    Mutant("capacity: changed maps not flagged", CAP, "    flags[:, CHANGED], flags[:, BAD_MAP] = map_flags\n", "    flags[:, BAD_MAP] = map_flags[1]\n", (T_A2A,)),
    Mutant("capacity: overflow not flagged", CAP, "flags[:, OVERFLOW] = int(M > C)", "flags[:, OVERFLOW] = int(M > C + 1)", (T_CAP, T_A2A)),
    Mutant("all2all: no second agreement", A2A, "            if changed and again:", "            if False:", (T_A2A,)),
    Mutant("batched: one token over max_tokens passes", "moekit/prepare_finalize/batched.py", "        if worst <= self.max_tokens:", "        if worst <= self.max_tokens + 1:", (T_BATCHED,)),
    # Kernels of the finalize and the activation.
    Mutant("reduce: last slot dropped", "moekit/kernels/reduce.py", "    for j in tl.static_range(TOPK):", "    for j in tl.static_range(TOPK - 1):", ("tests/kernels/test_reduce.py",)),
    Mutant("activation: gate and up swapped", "moekit/kernels/activation.py", "    y = gate / (1.0 + tl.exp(-gate)) * up\n", "    y = up / (1.0 + tl.exp(-up)) * gate\n", ("tests/kernels/test_activation.py",)),
)


def check_table(root: Path = ROOT) -> list[str]:
    """Problems of the table against the tree: a mutant whose text is not exactly once in its file."""
    problems = []
    for m in MUTANTS:
        path = root / m.path
        found = path.read_text().count(m.old) if path.is_file() else -1
        if found != 1:
            problems.append(f"{m.name}: its text is {'missing' if found <= 0 else f'there {found} times'} in {m.path}")
        missing = [t for t in m.tests if not (root / t).is_file()]
        if missing:
            problems.append(f"{m.name}: no test file {missing}")
    names = [m.name for m in MUTANTS]
    problems += [f"two mutants named {n!r}" for n in sorted({n for n in names if names.count(n) > 1})]
    return problems


def copy_tree(into: Path) -> Path:
    """The files git tracks (and untracked ones it does not ignore), copied under ``into``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            dst = into / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return into


def run_tests(tree: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[bool, float]:
    """(passed, seconds) of pytest on ``tests`` inside ``tree`` (the copy's moekit imported first)."""
    env = dict(os.environ, PYTHONPATH=str(tree), MOEKIT_DEVICE="cpu", PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", *PYTEST, *tests], cwd=tree, env=env,
                              capture_output=True, timeout=timeout_s)  # fmt: skip
        passed = done.returncode == 0
    except subprocess.TimeoutExpired:
        passed = False  # a mutant that hangs the tests is caught
    return passed, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.mutation", description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the mutants whose name contains this text")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests")
    args = ap.parse_args(argv)
    problems = check_table()
    if problems:
        print("the mutant table does not fit the tree:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    chosen = [m for m in MUTANTS if args.only in m.name]
    if not chosen:
        print(f"no mutant's name contains {args.only!r}", file=sys.stderr)
        return 1
    if args.list:
        for m in chosen:
            print(f"{m.name:48s} {m.path}  ->  {' '.join(m.tests)}" + (f"  [equivalent: {m.equivalent}]" if m.equivalent else ""))
        return 0
    survivors, verdicts = [], {"caught": 0, "survived (equivalent)": 0, "SURVIVED": 0}
    with tempfile.TemporaryDirectory(prefix="moekit-mutation-") as tmp:
        tree = copy_tree(Path(tmp))
        every = tuple(sorted({t for m in chosen for t in m.tests}))
        passed, seconds = run_tests(tree, every, args.timeout * 4)
        if not passed:
            print(f"the tests fail without any mutant ({' '.join(every)}): fix them first", file=sys.stderr)
            return 1
        print(f"unmutated: {len(every)} test files pass ({seconds:.0f} s)")
        for i, m in enumerate(chosen, 1):
            path = tree / m.path
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new, 1))
            try:
                passed, seconds = run_tests(tree, m.tests, args.timeout)
            finally:
                path.write_text(original)
            verdict = "SURVIVED" if passed else "caught"
            if passed and m.equivalent:
                verdict = "survived (equivalent)"
            elif passed:
                survivors.append(m)
            verdicts[verdict] += 1
            print(f"[{i:2d}/{len(chosen)}] {verdict:22s} {m.name}  ({seconds:.0f} s)", flush=True)
    print(f"\n{len(chosen)} mutants: {verdicts['caught']} caught, {len(survivors)} survived, "
          f"{verdicts['survived (equivalent)']} survived as marked equivalent")  # fmt: skip
    for m in survivors:
        print(f"  survived: {m.name} ({m.path}; tests {' '.join(m.tests)})")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
