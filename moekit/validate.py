"""Checks at the public boundary. Each raises a named error saying what was expected and what came."""

from __future__ import annotations

import torch

from moekit.errors import InvalidIdsError, InvalidInputError

_SIGNED_INT = (torch.int8, torch.int16, torch.int32, torch.int64)


def _desc(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def check_ids(topk_ids: torch.Tensor, *, name: str = "topk_ids", rank: int | None = 2) -> None:
    """``topk_ids`` must be a contiguous signed-integer tensor (-1 marks an empty slot)."""
    if not isinstance(topk_ids, torch.Tensor):
        raise InvalidIdsError(f"{name} must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype not in _SIGNED_INT:
        unsigned = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)
        kind = "unsigned" if topk_ids.dtype in unsigned else "non-integer"
        raise InvalidIdsError(
            f"{name} must be a signed integer tensor (int32 or int64; -1 marks an empty slot), "
            f"got {kind} {topk_ids.dtype}"
        )
    if rank is not None and topk_ids.dim() != rank:
        layout = "[M, topk]" if rank == 2 else "[num_global_experts]" if name == "expert_map" else ""
        raise InvalidIdsError(f"{name} must be {rank}-D {layout}, got shape {tuple(topk_ids.shape)}".replace(" ,", ","))
    if not topk_ids.is_contiguous():
        raise InvalidIdsError(
            f"{name} must be contiguous (got strides {topk_ids.stride()} for shape {tuple(topk_ids.shape)}); "
            "call .contiguous() first"
        )


def check_expert_map(expert_map: torch.Tensor | None, *, num_local_experts: int, device: torch.device) -> None:
    """A map is a 1-D signed-integer tensor with values in [-1, num_local_experts)."""
    if expert_map is None:
        return
    check_ids(expert_map, name="expert_map", rank=1)
    if expert_map.device != torch.device(device) and not (
        expert_map.device.type == torch.device(device).type == "cuda" and torch.device(device).index is None
    ):
        raise InvalidIdsError(f"expert_map is on {expert_map.device}, topk_ids on {device}")


def check_float(t: torch.Tensor, name: str, *, dims: int, allow_fp8: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise InvalidInputError(f"{name} must be {dims}-D, got {_desc(t)}")
    ok = t.is_floating_point() and (allow_fp8 or t.dtype != torch.float8_e4m3fn)
    if not ok:
        raise InvalidInputError(f"{name} must be a float tensor, got {_desc(t)}")


def check_moe_inputs(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """Shapes of a whole MoE call: hidden [M, K], w1 [E, N, K], w2 [E, K, N/2], topk [M, topk]."""
    check_float(hidden, "hidden", dims=2)
    check_float(w1, "w1", dims=3, allow_fp8=True)
    check_float(w2, "w2", dims=3, allow_fp8=True)
    check_float(topk_weights, "topk_weights", dims=2)
    check_ids(topk_ids)
    M, K = hidden.shape
    E, N, K1 = w1.shape
    if K1 != K:
        raise InvalidInputError(f"w1 must be [E, N, K={K}] to match hidden [M, K], got {tuple(w1.shape)}")
    if N % 2:
        raise InvalidInputError(f"w1 must have an even N (gate rows then up rows), got N={N}")
    if tuple(w2.shape) != (E, K, N // 2):
        raise InvalidInputError(f"w2 must be [E, K, N/2] = {(E, K, N // 2)}, got {tuple(w2.shape)}")
    if topk_ids.shape[0] != M or topk_weights.shape != topk_ids.shape:
        raise InvalidInputError(
            f"topk_ids and topk_weights must both be [M={M}, topk], got {tuple(topk_ids.shape)} "
            f"and {tuple(topk_weights.shape)}"
        )
    devices = {t.device.type for t in (hidden, w1, w2, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise InvalidInputError(f"all tensors must be on one device, got {sorted(devices)}")
