"""Expert parallelism end to end: every rank runs one MoE forward through an all-to-all.

One host (spawns the ranks itself; gloo on CPU, NCCL when there is a GPU per rank)::

    python -m moekit.ep --world-size 2 --M 64 --E 16 --topk 2 --chunk-size 16 --experts triton

Per-rank token counts may differ (``--M 64,0`` gives rank 1 no tokens). Under torchrun, leave
out ``--world-size``; each process joins the group from the environment::

    torchrun --nproc-per-node 2 -m moekit.ep --M 64 --E 16 --topk 2 --chunk-size 16

Every rank builds the same global problem from the seed (all E experts' weights, all ranks'
tokens), keeps its tokens and its ``E / W`` experts, runs ``ModularKernel`` with
:class:`~moekit.prepare_finalize.all2all.All2AllPrepareFinalize`, and compares its output with
the one-process fp32 reference over the full weights. :func:`run_rank` is importable so that
notebooks and tests can hand it to :func:`moekit.distributed.launch`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import moekit
from moekit.errors import InvalidInputError, MoekitError
from moekit.quant import dequantize_fp8_block, dequantize_fp8_per_token_group, quantize_fp8_block
from moekit.quant import quantize_fp8_per_token_group as quantize_acts
from moekit.reference import moe_reference
from moekit.routing import contiguous_expert_map, skewed_router
from moekit.testing import assert_close
from moekit.types import QuantScheme


@dataclass(frozen=True)
class EPConfig:
    """One expert-parallel problem. ``Ms[r]`` is rank r's token count (its length is W).

    ``quant`` is "none" or "fp8_block" (DeepGemm-family experts need fp8_block, with K and N
    multiples of 128). ``empty_slots`` sets every 5th token's last slot to -1. ``skew`` shapes
    the router (0 = uniform).
    """

    Ms: tuple[int, ...]
    E: int = 16
    topk: int = 2
    K: int = 128
    N: int = 256
    chunk_size: int | None = None
    experts: str = "triton"
    quant: str = "none"
    metadata_policy: str = "per_chunk"
    dtype: str = "bfloat16"
    skew: float = 1.0
    empty_slots: bool = True
    seed: int = 0

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(self.quant)


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


def global_problem(config: EPConfig) -> dict:
    """The whole problem on the CPU, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(config.seed)
    E, K, N, M = config.E, config.K, config.N, sum(config.Ms)
    dtype = getattr(torch, config.dtype)
    w1 = (torch.randn(E, N, K, generator=g) / K**0.5).to(dtype)
    w2 = (torch.randn(E, K, N // 2, generator=g) / (N // 2) ** 0.5).to(dtype)
    hidden = torch.randn(M, K, generator=g).to(dtype)
    weights, ids = skewed_router(M, E, config.topk, skew=config.skew, seed=config.seed + 1, device="cpu")
    if config.empty_slots and M:
        ids[::5, -1] = -1
    p = {"hidden": hidden, "w1": w1, "w2": w2, "topk_weights": weights, "topk_ids": ids.contiguous()}
    if config.scheme is QuantScheme.FP8_BLOCK:
        (p["w1"], p["w1_scale"]), (p["w2"], p["w2_scale"]) = quantize_fp8_block(w1), quantize_fp8_block(w2)
    return p


def reference_output(config: EPConfig, p: dict, start: int, end: int, *, device=None) -> torch.Tensor:
    """fp32 reference (on the CPU) for tokens ``[start, end)`` over all E experts.

    fp8 runs are compared on dequantized weights and quantized-then-dequantized activations.
    ``device`` only says where to compute it (a GPU is much faster at benchmark sizes).
    """
    on = (lambda t: t.to(device)) if device is not None else (lambda t: t)
    hidden, w1, w2 = on(p["hidden"][start:end]), on(p["w1"]), on(p["w2"])
    if config.scheme is QuantScheme.FP8_BLOCK:
        hidden = dequantize_fp8_per_token_group(*quantize_acts(hidden))
        w1, w2 = dequantize_fp8_block(w1, on(p["w1_scale"])), dequantize_fp8_block(w2, on(p["w2_scale"]))
    ids, weights = on(p["topk_ids"][start:end]), on(p["topk_weights"][start:end])
    return moe_reference(hidden, w1, w2, weights, ids).cpu()


def run_rank(rank: int, world_size: int, config: EPConfig, *, gather: bool = True) -> RankResult:
    """Run ``config`` on this rank (the process group must be up); see the module docstring.

    A moekit error raised by the forward (for example StaleMetadataError under
    ``metadata_policy="whole_batch"``) is caught and reported in ``RankResult.error``. Only do
    that when every rank fails the same way, or the others wait in the combine.
    """
    from moekit.distributed import gather_traces
    from moekit.experts import experts_class
    from moekit.modular_kernel import ModularKernel
    from moekit.prepare_finalize.all2all import All2AllPrepareFinalize

    if len(config.Ms) != world_size or config.E % world_size:
        raise InvalidInputError(f"need len(Ms) == world_size={world_size}, E divisible by it; got {config}")
    device = moekit.device.get_device()
    p = global_problem(config)
    start, end = sum(config.Ms[:rank]), sum(config.Ms[: rank + 1])
    El = config.E // world_size
    mine = slice(rank * El, (rank + 1) * El)
    kernel = ModularKernel(
        All2AllPrepareFinalize(),
        experts_class(config.experts)(quant=config.scheme),
        chunk_size=config.chunk_size,
        metadata_policy=config.metadata_policy,
    )
    scales = {k: p[k][mine].to(device) for k in ("w1_scale", "w2_scale") if k in p}
    error, out = None, None
    try:
        out = kernel(
            p["hidden"][start:end].to(device), p["w1"][mine].to(device), p["w2"][mine].to(device),
            p["topk_weights"][start:end].to(device), p["topk_ids"][start:end].to(device),
            expert_map=contiguous_expert_map(config.E, world_size, rank, device=device),
            global_num_experts=config.E, **scales,
        )
    except MoekitError as e:
        error = f"{type(e).__name__}: {e}"
    trace = kernel.last_trace
    ref = reference_output(config, p, start, end, device=device)
    err, close = float("nan"), False
    if out is not None:
        err = float((out.float().cpu() - ref).abs().max()) if out.numel() else 0.0
        try:
            fp8 = config.scheme is QuantScheme.FP8_BLOCK
            assert_close(out, ref, dtype=torch.float8_e4m3fn if fp8 else out.dtype)
            close = True
        except AssertionError:
            close = False
    counts = trace.counts_matrix()
    handle = kernel.prepare_finalize.last_handle  # None when the forward failed before dispatch
    recv = list(handle.recv_splits) if handle is not None else []
    per_expert = handle.recv_counts.sum(0).tolist() if handle is not None else []
    result = RankResult(rank, end - start, sum(recv), out, ref, err, close, counts, trace.backends, per_expert)
    result.error = error
    result.received_from = recv
    if error is None and gather and world_size > 1:
        gathered = gather_traces(trace)
        result.all_counts = gathered if rank == 0 else []
    else:
        result.all_counts = [counts]
    return result


def run_cases(rank: int, world_size: int, configs: list[EPConfig]) -> list[RankResult]:
    """:func:`run_rank` for each config in turn, in one process group (tests batch cases this way)."""
    return [run_rank(rank, world_size, c, gather=False) for c in configs]


def format_results(results: list[RankResult]) -> str:
    """Per-rank, per-chunk counts and errors, as the CLI prints them."""
    lines = []
    for r in results:
        status = r.error or f"max |err| {r.max_abs_err:.3g} ({'ok' if r.close else 'MISMATCH'})"
        lines.append(f"rank {r.rank}: M={r.M} tokens, received {r.received} (token, slot) rows "
                     f"(from each rank: {r.received_from}); {status}")
        for i, row in enumerate(r.counts.tolist()):
            lines.append(f"  chunk {i} [{r.backends[i] if i < len(r.backends) else '?'}]: {row}")
    return "\n".join(lines)


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m moekit.ep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=None, help="ranks to spawn (omit under torchrun)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    ap.add_argument("--M", default="64", help="tokens per rank: one int, or one per rank (64,0)")
    ap.add_argument("--E", type=int, default=16, help="global experts")
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--N", type=int, default=256, help="w1 rows (2 x intermediate)")
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--experts", default="triton", choices=("triton", "triton_or_deep_gemm", "deep_gemm"))
    ap.add_argument("--quant", default=None, choices=("none", "fp8_block"), help="default: fp8 unless triton")
    ap.add_argument("--metadata-policy", default="per_chunk", choices=("per_chunk", "whole_batch"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds, for the run and each collective")
    return ap.parse_args(argv)


def _config(args, world_size: int) -> EPConfig:
    Ms = [int(m) for m in str(args.M).split(",")]
    Ms = Ms * world_size if len(Ms) == 1 else Ms
    quant = args.quant or ("none" if args.experts == "triton" else "fp8_block")
    return EPConfig(tuple(Ms), E=args.E, topk=args.topk, K=args.K, N=args.N, chunk_size=args.chunk_size,
                    experts=args.experts, quant=quant, metadata_policy=args.metadata_policy, seed=args.seed)


def main(argv=None) -> int:
    """CLI entry (see the module docstring). Exit status 1 when any rank mismatches or fails."""
    from moekit.distributed import init_from_env, launch

    args = _parse(argv)
    if args.world_size is None and "RANK" not in os.environ:  # neither torchrun nor --world-size
        args.world_size = 1
    if args.world_size is None:  # torchrun
        rank, world_size = init_from_env(backend=args.backend, timeout_s=args.timeout)
        result = run_rank(rank, world_size, _config(args, world_size))
        results: list = [None] * world_size
        dist.all_gather_object(results, _summary(result))
        dist.destroy_process_group()
        if rank != 0:
            return 0 if all(r.close for r in results) else 1
    else:
        config = _config(args, args.world_size)
        results = launch(run_rank, args.world_size, backend=args.backend, args=(config,),
                         timeout_s=args.timeout)
    print(format_results(results))
    return 0 if all(r.close for r in results) else 1


def _summary(r: RankResult) -> RankResult:
    return RankResult(r.rank, r.M, r.received, None, r.reference[:0], r.max_abs_err, r.close, r.counts,
                      r.backends, r.tokens_meta, r.received_from, r.error)


if __name__ == "__main__":
    sys.exit(main())
