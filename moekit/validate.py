"""Checks at the public boundary. Each raises a named error saying what was expected and what came.

The public entry points (``ModularKernel.forward``, ``moekit.fused_moe``,
``moekit.count_expert_num_tokens``) call these once per call; the layers below them (experts,
kernel launchers) trust what they are handed.
"""

from __future__ import annotations

import functools
import weakref

import torch

from moekit.device import interpreting
from moekit.errors import InvalidIdsError, InvalidInputError, QuantizationError
from moekit.quant import FP8
from moekit.types import ExpertPlacement

MAX_IDS = 2**31 - 2**20  # ids per kernel call: int32 offsets, with room for a tile past the end and the padding
# Experts (global or local) per layer. The count and align kernels keep one bin per expert in a program
# (a histogram, the bucket totals) and Triton caps a tensor at 2**20 elements; 4096 (Switch-C had 2048,
# DeepSeek-V3 256) keeps every kernel's per-program tensors small on a GPU and is tested at the limit.
MAX_EXPERTS = 4096
_SIGNED_INT = (torch.int8, torch.int16, torch.int32, torch.int64)
_UNSIGNED_INT = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)


def _desc(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def check_positive_int(
    value, name: str, *, error: type[Exception] = InvalidInputError, allow_zero: bool = False
) -> int:
    """``value`` must be an int (not a bool) > 0 (or >= 0 with ``allow_zero``); returns it."""
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        want = "a non-negative int" if allow_zero else "a positive int"
        raise error(f"{name} must be {want}, got {value!r}")
    return value


def check_num_experts(value, name: str) -> int:
    """``value`` must be an int in ``[1, MAX_EXPERTS]`` (the kernels bin experts in one program); returns it.

    ``count_expert_num_tokens(ids, 2**40)`` once tried to allocate 4 TiB of counts before failing.
    """
    check_positive_int(value, name)
    if value > MAX_EXPERTS:
        raise InvalidInputError(f"{name} must be at most {MAX_EXPERTS} (the kernels bin every expert), got {value}")
    return value


def check_flag(value, name: str) -> bool:
    """``value`` must be a bool (``"no"`` is truthy: a string flag would silently switch it on)."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {value!r}")
    return value


def check_ids(topk_ids: torch.Tensor, *, name: str = "topk_ids", rank: int | None = 2) -> None:
    """``topk_ids`` must be a contiguous signed-integer tensor (-1 marks an empty slot)."""
    if not isinstance(topk_ids, torch.Tensor):
        raise InvalidIdsError(f"{name} must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype not in _SIGNED_INT:
        kind = "unsigned" if topk_ids.dtype in _UNSIGNED_INT else "non-integer"
        raise InvalidIdsError(
            f"{name} must be a signed integer tensor (int32 or int64; -1 marks an empty slot), "
            f"got {kind} {topk_ids.dtype}"
        )
    if rank is not None and topk_ids.dim() != rank:
        layout = " [M, topk]" if rank == 2 else " [global_num_experts]" if name == "expert_map" else ""
        raise InvalidIdsError(f"{name} must be {rank}-D{layout}, got shape {tuple(topk_ids.shape)}")
    if not topk_ids.is_contiguous():
        raise InvalidIdsError(
            f"{name} must be contiguous (got strides {topk_ids.stride()} for shape {tuple(topk_ids.shape)}); "
            "call .contiguous() first"
        )


def check_numel(topk_ids: torch.Tensor) -> None:
    """At most :data:`MAX_IDS` ids (the kernels index them with int32 offsets)."""
    if topk_ids.numel() > MAX_IDS:
        raise InvalidInputError(f"at most {MAX_IDS} ids per call (int32 offsets), got {topk_ids.numel()}")


def check_kernel_device(t: torch.Tensor, name: str) -> None:
    """``t`` must live where moekit's kernels run: the CPU under the interpreter, else a CUDA GPU."""
    kind = t.device.type
    if interpreting() and kind != "cpu":
        raise InvalidInputError(f"{name} is on {t.device}, but Triton interprets on the CPU here; move it to the CPU")
    if not interpreting() and kind != "cuda":
        where = "the CPU" if kind == "cpu" else str(t.device)
        raise InvalidInputError(f"{name} is on {where}, but Triton compiles for CUDA here; move it to the GPU")


def _same_device(a: torch.device, b: torch.device) -> bool:
    a, b = torch.device(a), torch.device(b)
    return a == b or (a.type == b.type == "cuda" and (a.index is None or b.index is None))


def check_expert_map(expert_map: torch.Tensor | None, *, device: torch.device) -> None:
    """A map is a contiguous 1-D signed-integer tensor on the ids' device."""
    if expert_map is None:
        return
    check_ids(expert_map, name="expert_map", rank=1)
    if not _same_device(expert_map.device, device):
        raise InvalidIdsError(f"expert_map is on {expert_map.device}, topk_ids on {device}")


def check_id_range(topk_ids: torch.Tensor, global_num_experts: int) -> None:
    """Ids must be -1 (an empty slot) or in ``[0, global_num_experts)``.

    Checked only where it costs no host sync: ids on the CPU. On a GPU an id outside that range
    is treated as an empty slot by every kernel (nothing is read out of bounds), so a caller's
    bug there gives zeros for that slot rather than an error.
    """
    if topk_ids.device.type != "cpu" or topk_ids.numel() == 0:
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < -1 or high >= global_num_experts:
        raise InvalidIdsError(
            f"topk_ids must be -1 (empty slot) or in [0, global_num_experts={global_num_experts}), "
            f"got values in [{low}, {high}]"
        )


def check_float(t: torch.Tensor, name: str, *, dims: int, allow_fp8: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise InvalidInputError(f"{name} must be {dims}-D, got {_desc(t)}")
    ok = t.is_floating_point() and (allow_fp8 or t.dtype != FP8)
    if not ok:
        raise InvalidInputError(f"{name} must be a float tensor, got {_desc(t)}")


def check_moe_inputs(
    hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    """Shapes of a whole MoE call: hidden [M, K], w1 [E, N, K], w2 [E, K, N/2], topk [M, topk]."""
    check_float(hidden, "hidden", dims=2)
    check_float(w1, "w1", dims=3, allow_fp8=True)
    check_float(w2, "w2", dims=3, allow_fp8=True)
    check_float(topk_weights, "topk_weights", dims=2)
    check_ids(topk_ids)
    (M, K), (E, N, K1), ids_shape = hidden.shape, w1.shape, topk_ids.shape
    if K1 != K:
        raise InvalidInputError(f"w1 must be [E, N, K={K}] to match hidden [M, K], got {tuple(w1.shape)}")
    if N % 2 or N == 0:
        raise InvalidInputError(f"w1 must have an even N > 0 (gate rows then up rows), got N={N}")
    if E == 0:
        raise InvalidInputError(f"w1 must hold at least one expert, got {tuple(w1.shape)}")
    if w2.shape != (E, K, N // 2):
        raise InvalidInputError(f"w2 must be [E, K, N/2] = {(E, K, N // 2)}, got {tuple(w2.shape)}")
    if ids_shape[0] != M or topk_weights.shape != ids_shape or ids_shape[1] == 0:
        raise InvalidInputError(
            f"topk_ids and topk_weights must both be [M={M}, topk > 0], got {tuple(ids_shape)} "
            f"and {tuple(topk_weights.shape)}"
        )
    where = (hidden.get_device(), hidden.is_meta)  # get_device: -1 on the CPU (and meta), else the index
    if any((t.get_device(), t.is_meta) != where for t in (w1, w2, topk_weights, topk_ids)):
        tensors = {"hidden": hidden, "w1": w1, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids}
        got = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise InvalidInputError(f"all tensors must be on one device, got {got}")
    if torch.is_grad_enabled() and (
        hidden.requires_grad or w1.requires_grad or w2.requires_grad or topk_weights.requires_grad
    ):
        raise InvalidInputError(
            "moekit's MoE layer is inference-only: no gradient flows through its kernels, but an input "
            "requires grad; run it under torch.no_grad() or torch.inference_mode()"
        )
    if w1.dtype != FP8 and w1.dtype != hidden.dtype:
        raise InvalidInputError(
            f"unquantized weights must have hidden's dtype ({hidden.dtype}), got w1 {w1.dtype}; "
            "fp8 weights (float8_e4m3fn) are the only other choice"
        )
    if w2.dtype != w1.dtype:
        raise InvalidInputError(f"w1 and w2 must share a dtype, got {w1.dtype} and {w2.dtype}")


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CUDA tensor read while this stream captures a CUDA graph (no read-back then)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_map_values(expert_map: torch.Tensor, num_local: int) -> None:
    """Every map entry is -1 (another rank's expert) or a local id in ``[0, num_local)``: compared in the
    map's own dtype, so an int64 ``2**32 + 1`` is refused, not wrapped to local expert 1.

    Read on every call (on a GPU, a small read-back): the caller owns the tensor and may have written
    it since, in ways no version counter sees (a numpy view, ``.data``, a new tensor at a freed one's
    address), so no earlier answer is trusted. Inside a CUDA graph capture nothing can be read (and a
    replay runs no host code): there the values are the caller's to keep right."""
    if capturing(expert_map):
        return
    bad = (expert_map != -1) & ((expert_map < 0) | (expert_map >= num_local))
    if expert_map.numel() and bool(bad.any()):
        where = bad.nonzero().flatten()[:4].tolist()
        values = expert_map.flatten()[where].tolist()
        raise InvalidIdsError(
            f"expert_map entries must be -1 (another rank's expert) or a local id in [0, {num_local}), got "
            f"{values} at global ids {where}"
        )


_OWNED_SCALES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> what owned_scale made


def check_scale_values(scale: torch.Tensor, name: str) -> None:
    """A static scale divides activations: every value must be finite and > 0 (0 zeroes the layer,
    NaN poisons it). Read on every call, as :func:`check_map_values` says why, unless
    :func:`owned_scale` made it."""
    if capturing(scale) or _OWNED_SCALES.get(id(scale)) is scale:  # by identity: == on tensors is elementwise
        return
    ok = torch.isfinite(scale) & (scale > 0)
    if scale.numel() and not bool(ok.all()):
        bad = scale.flatten()[~ok.flatten()][:4].tolist()
        raise QuantizationError(f"{name} values must be finite and > 0, got {bad}")


def owned_placement(expert_map: torch.Tensor, num_local_experts: int) -> ExpertPlacement:
    """A placement moekit owns: a private copy of ``expert_map``, its values checked once, here.

    Pass it as ``expert_map=`` to a forward (``ModularKernel``, ``moekit.fused_moe``, ``GraphedKernel``):
    nobody else holds the copy, so no forward reads its values again, where a map passed as a tensor
    is read on every call (on a GPU a read-back that waits for the queue). After a rebalance, make a
    new one. Raises what a forward would raise for that map.
    """
    check_ids(expert_map, name="expert_map", rank=1)
    check_num_experts(num_local_experts, "num_local_experts")
    copy = expert_map.detach().clone()  # checked after the copy: a later write to the caller's cannot reach it
    check_map_values(copy, num_local_experts)
    return ExpertPlacement(check_num_experts(copy.numel(), "global_num_experts"), num_local_experts, copy, owned=True)


def owned_scale(scale: torch.Tensor) -> torch.Tensor:
    """A static scale moekit owns (for ``a2_scale=``): a private copy of ``scale``, its values checked
    once, here, so no forward (``ModularKernel``, ``moekit.fused_moe``, ``GraphedKernel``'s replays)
    reads it back, where a scale passed as a caller's tensor is read on every call (on a GPU a
    read-back that waits for the queue). The copy is moekit's: to change the scale, make a new
    one (a write into the copy is not checked again). Raises what a forward would raise."""
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        raise QuantizationError(f"a scale must be a floating-point tensor, got {type(scale).__name__}")
    copy = scale.detach().clone()  # checked after the copy: a later write to the caller's cannot reach it
    check_scale_values(copy, "a2_scale")
    _OWNED_SCALES[id(copy)] = copy
    return copy


def check_owned(placement: ExpertPlacement, w1: torch.Tensor, global_num_experts, device) -> ExpertPlacement:
    """An :func:`owned_placement` passed as ``expert_map``: it must describe this call (w1's experts, the
    same E, the ids' device); its values were checked when it was made."""
    emap = placement.expert_map
    if not placement.owned:
        raise InvalidInputError("an ExpertPlacement passed as expert_map must come from moekit.owned_placement")
    if placement.num_local_experts != w1.shape[0] or global_num_experts not in (None, placement.global_num_experts):
        raise InvalidInputError(
            f"the owned placement holds {placement.num_local_experts} of {placement.global_num_experts} experts, "
            f"but w1 holds {w1.shape[0]} and global_num_experts={global_num_experts}"
        )
    check_expert_map(emap, device=device)
    return placement


@functools.lru_cache(maxsize=256)
def _placement(E_global: int, E_local: int) -> ExpertPlacement:
    return ExpertPlacement(E_global, E_local, None)


def check_placement(
    w1: torch.Tensor, expert_map: torch.Tensor | None, global_num_experts, device: torch.device, *, values: bool = True
) -> ExpertPlacement:
    """Which experts this call holds: E_local from w1, E_global from the argument or the map; the map's
    values are read too unless ``values=False`` (an all-to-all checks them on the device, in the
    exchange that already syncs: :mod:`moekit.prepare_finalize.agreement`)."""
    E_local = w1.shape[0]
    if isinstance(expert_map, ExpertPlacement):
        return check_owned(expert_map, w1, global_num_experts, device)
    if expert_map is None and type(global_num_experts) is int and E_local <= global_num_experts <= MAX_EXPERTS:
        return _placement(global_num_experts, E_local)
    if expert_map is None and global_num_experts is None:
        return _placement(E_local, E_local)
    check_expert_map(expert_map, device=device)
    E_global = global_num_experts
    if E_global is None:
        E_global = expert_map.numel() if expert_map is not None else E_local
    check_num_experts(E_global, "global_num_experts")
    if expert_map is not None and expert_map.numel() != E_global:
        raise InvalidInputError(f"expert_map has {expert_map.numel()} entries but global_num_experts={E_global}")
    if E_global < E_local:
        raise InvalidInputError(f"global_num_experts={E_global} < local experts {E_local} (w1 holds {E_local})")
    if expert_map is not None and values:
        check_map_values(expert_map, E_local)
    return ExpertPlacement(E_global, E_local, expert_map)
