"""Expert parallelism end to end: every rank runs one MoE forward through an all-to-all.

One host (spawns the ranks itself; gloo on CPU, NCCL when there is a GPU per rank)::

    python -m moekit.ep --world-size 2 --M 64 --E 16 --topk 2 --chunk-size 16 --experts triton

Per-rank token counts may differ (``--M 64,0`` gives rank 1 no tokens). Under torchrun, leave
out ``--world-size``; each process joins the group from the environment::

    torchrun --nproc-per-node 2 -m moekit.ep --M 64 --E 16 --topk 2 --chunk-size 16

Every rank builds the same global problem from the seed (all E experts' weights, all ranks'
tokens, :func:`moekit.testing.make_problem`), keeps its tokens and its contiguous block of
experts (:meth:`moekit.testing.MoEProblem.shard`), runs ``ModularKernel`` with
:class:`~moekit.prepare_finalize.all2all.All2AllPrepareFinalize`, and compares its output with
the one-process fp32 reference over the full weights. :func:`run_rank` is importable so that
notebooks and tests can hand it to :func:`moekit.distributed.launch`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist

import moekit
from moekit.errors import InvalidInputError, MoekitError
from moekit.testing import MoEProblem, assert_close, make_problem
from moekit.types import QuantScheme


@dataclass(frozen=True)
class EPConfig:
    """One expert-parallel problem. ``Ms[r]`` is rank r's token count (its length is W).

    ``quant`` is a :class:`~moekit.QuantScheme` (DeepGemm-family experts need FP8_BLOCK, with K
    and N multiples of 128). ``empty_every`` makes every n-th token's last slot -1 (None: no
    empty slots). ``skew`` shapes the router (0 = uniform).
    """

    Ms: tuple[int, ...]
    E: int = 16
    topk: int = 2
    K: int = 128
    N: int = 256
    chunk_size: int | None = None
    experts: str = "triton"
    quant: QuantScheme = QuantScheme.NONE
    metadata_policy: str = "per_chunk"
    dtype: torch.dtype = torch.bfloat16
    skew: float = 1.0
    empty_every: int | None = None
    seed: int = 0
    dispatch: str = "exact"  # All2AllPrepareFinalize's mode; "capacity" sizes its blocks by max(Ms)
    chunk_by: str = "tokens"
    timeout_s: float | None = None  # every exchange's longest wait (None: the group's timeout)


@dataclass
class RankResult:
    """What one rank reports. ``error`` holds a caught moekit error (e.g. StaleMetadataError)."""

    rank: int
    M: int
    received: int
    output: torch.Tensor | None
    reference: torch.Tensor
    max_abs_err: float
    close: bool
    counts: torch.Tensor  # int64 [num_chunks, E_local]: tokens per (chunk, local expert)
    backends: list[str]
    tokens_meta: list[int]  # what prepare returned: rows received per local expert
    received_from: list[int] = field(default_factory=list)  # rows received from each source rank
    error: str | None = None
    all_counts: list[torch.Tensor] = field(default_factory=list)  # every rank's counts, on rank 0


# The EPConfig fields that make_problem takes by the same names.
_PROBLEM_FIELDS = ("E", "topk", "K", "N", "dtype", "quant", "skew", "empty_every", "seed")


def global_problem(config: EPConfig) -> MoEProblem:
    """The whole problem (all ranks' tokens, all E experts) on the CPU, identical on every rank."""
    return make_problem(sum(config.Ms), **{name: getattr(config, name) for name in _PROBLEM_FIELDS}, device="cpu")


def run_rank(rank: int, world_size: int, config: EPConfig, *, gather: bool = True) -> RankResult:
    """Run ``config`` on this rank (the process group must be up); see the module docstring.

    A moekit error raised by the forward (for example StaleMetadataError under
    ``metadata_policy="whole_batch"``, or a named error that every rank raises when one rank's
    inputs are bad) is caught and reported in ``RankResult.error``; the counts are then those of
    the chunks that ran (none when the forward failed at its door).
    """
    from moekit.api import experts_class
    from moekit.distributed import gather_traces
    from moekit.modular_kernel import ModularKernel
    from moekit.prepare_finalize.all2all import All2AllPrepareFinalize
    from moekit.validate import check_flag

    check_flag(gather, "gather")  # before any collective, the same on every rank
    if len(config.Ms) != world_size:
        raise InvalidInputError(f"need one token count per rank (len(Ms) == world_size={world_size}); got {config}")
    device = moekit.device.get_device()
    p = global_problem(config)
    mine = slice(sum(config.Ms[:rank]), sum(config.Ms[: rank + 1]))
    local = replace(  # this rank's tokens and its block of experts
        p.shard(rank, world_size), hidden=p.hidden[mine], topk_weights=p.topk_weights[mine], topk_ids=p.topk_ids[mine]
    )
    inputs = [t.to(device) for t in local.inputs()]
    options = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in local.options().items()}
    capacity = dict(mode="capacity", max_tokens_per_rank=max(*config.Ms, 1)) if config.dispatch == "capacity" else {}
    error, out, kernel = None, None, None
    try:  # a bad configuration fails alike on every rank, before any exchange
        kernel = ModularKernel(
            All2AllPrepareFinalize(timeout_s=config.timeout_s, **capacity),
            experts_class(config.experts)(quant=config.quant),
            chunk_size=config.chunk_size,
            chunk_by=config.chunk_by,
            metadata_policy=config.metadata_policy,
        )
        out = kernel(*inputs, **options)
    except MoekitError as e:
        error = f"{type(e).__name__}: {e}"
    trace = kernel.last_trace if kernel is not None else None
    ref = p.reference(rows=mine)
    err, close = float("nan"), False
    if out is not None:
        err = float((out.float().cpu() - ref).abs().max()) if out.numel() else 0.0
        with contextlib.suppress(AssertionError):
            assert_close(out, ref, dtype=p.dtype)  # fp8's tolerance for fp8 block quantization
            close = True
    # No trace when the door refused the call (a fresh kernel: nothing from an earlier call).
    counts = trace.counts_matrix() if trace is not None else torch.zeros((0, local.w1.shape[0]), dtype=torch.int64)
    backends = trace.backends if trace is not None else []
    handle = kernel.prepare_finalize.last_handle if kernel is not None else None  # None: failed before dispatch
    recv = list(handle.recv_splits) if handle is not None else []
    per_expert = handle.recv_counts.sum(0).tolist() if handle is not None else []
    all_counts = [counts]
    if error is None and gather and world_size > 1:
        gathered = gather_traces(trace, timeout_s=config.timeout_s)
        all_counts = gathered if rank == 0 else []
    return RankResult(
        rank, config.Ms[rank], sum(recv), out, ref, err, close, counts, backends, per_expert, recv, error, all_counts
    )


def run_cases(rank: int, world_size: int, configs: list[EPConfig]) -> list[RankResult]:
    """:func:`run_rank` for each config in turn, in one process group (tests batch cases this way)."""
    return [run_rank(rank, world_size, c, gather=False) for c in configs]


def format_results(results: list[RankResult]) -> str:
    """Per-rank, per-chunk counts and errors, as the CLI prints them."""
    lines = []
    for r in results:
        status = r.error or f"max |err| {r.max_abs_err:.3g} ({'ok' if r.close else 'MISMATCH'})"
        lines.append(
            f"rank {r.rank}: M={r.M} tokens, received {r.received} (token, slot) rows "
            f"(from each rank: {r.received_from}); {status}"
        )
        for i, row in enumerate(r.counts.tolist()):
            lines.append(f"  chunk {i} [{r.backends[i] if i < len(r.backends) else '?'}]: {row}")
    return "\n".join(lines)


def _number(kind, *, low: float, even: bool = False):
    """An argparse ``type``: ``kind(text)`` >= ``low`` (and even), else a usage error (exit status 2)."""
    what = ("an even int" if even else "an int" if kind is int else "a number") + f" >= {low:g}"

    def parse(text: str):
        with contextlib.suppress(ValueError):  # not a number: the same usage error
            value = kind(text)
            if value >= low and not (even and value % 2) and math.isfinite(value):  # NaN is not >= low
                return value
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")

    return parse


def _token_counts(text: str) -> tuple[int, ...]:
    count = _number(int, low=0)
    try:
        return tuple(count(m) for m in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected one int >= 0, or one per rank (64,0), got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m moekit.ep", description=__doc__.split("\n\n")[0])
    positive, seconds = _number(int, low=1), _number(float, low=0.001)
    ap.add_argument("--world-size", type=positive, default=None, help="ranks to spawn (omit under torchrun)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    ap.add_argument("--M", type=_token_counts, default=(64,), help="tokens per rank: one int, or one per rank (64,0)")
    ap.add_argument("--E", type=positive, default=16, help="global experts")
    ap.add_argument("--topk", type=positive, default=2)
    ap.add_argument("--K", type=positive, default=128)
    ap.add_argument("--N", type=_number(int, low=2, even=True), default=256, help="w1 rows (2 x intermediate)")
    ap.add_argument("--chunk-size", type=positive, default=None)
    ap.add_argument("--experts", default="triton", choices=("triton", "triton_or_deep_gemm", "deep_gemm"))
    ap.add_argument("--quant", default=None, choices=("none", "fp8_block"), help="default: fp8 unless triton")
    ap.add_argument("--metadata-policy", default="per_chunk", choices=("per_chunk", "whole_batch"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", dest="timeout_s", type=seconds, default=300.0, help="seconds (the run, each exchange)")
    return ap


def _config(ap: argparse.ArgumentParser, args, world_size: int) -> EPConfig:
    Ms = args.M * world_size if len(args.M) == 1 else args.M
    if len(Ms) != world_size:
        ap.error(f"argument --M: expected one token count or {world_size} (one per rank), got {len(Ms)}")
    if args.topk > args.E:
        ap.error(f"--topk {args.topk} is more than --E {args.E} experts")
    quant = QuantScheme(args.quant or ("none" if args.experts == "triton" else "fp8_block"))
    named = {f.name for f in fields(EPConfig)} - {"Ms", "quant"}  # the options named as the fields
    return EPConfig(tuple(Ms), quant=quant, **{k: v for k, v in vars(args).items() if k in named})


def main(argv=None) -> int:
    """CLI entry (see the module docstring). Exit status 1 when any rank mismatches or fails, 2 on bad usage."""
    from moekit.distributed import gather_objects, init_from_env, launch, torchrun_env

    ap = _parser()
    args = ap.parse_args(argv)
    try:
        under_torchrun = args.world_size is None and torchrun_env() is not None
    except InvalidInputError as e:
        ap.error(str(e))
    try:
        if under_torchrun:
            rank, world_size = init_from_env(backend=args.backend, timeout_s=args.timeout_s)
            result = run_rank(rank, world_size, _config(ap, args, world_size))
            results = gather_objects(_summary(result), timeout_s=args.timeout_s)
            dist.destroy_process_group()
            if rank != 0:
                return 0 if all(r.close for r in results) else 1
        else:
            world_size = args.world_size or 1
            config = _config(ap, args, world_size)
            results = launch(run_rank, world_size, backend=args.backend, args=(config,), timeout_s=args.timeout_s)
    except MoekitError as e:  # a rank failed outside the forward (its traceback is in the message)
        print(f"python -m moekit.ep: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(format_results(results))
    return 0 if all(r.close for r in results) else 1


def _summary(r: RankResult) -> RankResult:
    """What rank 0 prints of ``r``: no tensors beyond the counts."""
    return replace(r, output=None, reference=r.reference[:0], all_counts=[])


if __name__ == "__main__":
    sys.exit(main())
