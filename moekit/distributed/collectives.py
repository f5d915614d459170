"""``gather_objects``, ``gather_traces``: collectives with a timeout (every rank's value, on every rank); ``to_cpu``."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch
import torch.distributed as dist


def to_cpu(obj: Any) -> Any:
    """Tensors to the CPU, recursively through lists, tuples, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        return dataclasses.replace(obj, **{name: to_cpu(getattr(obj, name)) for name in fields})
    return obj


def gather_objects(obj: Any, *, group=None, timeout_s: float | None = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), on every rank, in rank order: ``all_gather_object`` with a timeout.

    Two exchanges (the sizes, then the padded bytes), each waiting at most ``timeout_s`` seconds
    (None: the group's own timeout), then DistributedError. A collective: every rank must call it.
    """
    from moekit.distributed.process_group import check_timeout
    from moekit.prepare_finalize.agreement import wait

    check_timeout(timeout_s, none_means="the group's own timeout")  # on every rank, before any exchange
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    world = dist.get_world_size(group)
    data = torch.frombuffer(bytearray(pickle.dumps(to_cpu(obj))), dtype=torch.uint8).to(device)

    def gather(t: torch.Tensor, what: str) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(world)]
        work = dist.all_gather(out, t, group=group, async_op=True)
        wait(work, timeout_s=timeout_s, what=f"all_gather of {what}", group=group)
        return out

    sizes = [int(n) for n in gather(torch.tensor([data.numel()], dtype=torch.int64, device=device), "object sizes")]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    return [pickle.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(gather(padded, "objects"), sizes, strict=True)]


def gather_traces(trace, *, group=None, timeout_s: float | None = None) -> list[torch.Tensor]:
    """Every rank's per-chunk tokens-per-expert matrix, gathered to every rank.

    Args:
        trace: this rank's :class:`moekit.trace.Trace` (``ModularKernel.last_trace``).
        group: the process group (default: the world).
        timeout_s: the longest wait of each exchange (None: the group's own timeout).

    Returns:
        ``[counts of rank 0, counts of rank 1, ...]``, each int64 ``[num_chunks, E_local]`` on the
        CPU (``num_chunks`` differs between ranks: it follows the rows each rank received). A
        collective: every rank must call it.
    """
    return gather_objects(trace.counts_matrix(), group=group, timeout_s=timeout_s)
