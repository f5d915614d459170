"""Which transformers experts modules moekit can run, and why not the others.

moekit computes ``down_proj[e] @ (silu(g) * u)`` with ``[g; u] = gate_up_proj[e] @ x``: all gate
rows, then all up rows, no biases. A transformers experts module qualifies when it has exactly
that layout and math; these checks read what ``@use_experts_implementation`` records on the
module (``has_gate``, ``has_bias``, ``is_concatenated``, ``is_transposed``), whether its class
overrides the gating (``_apply_gate``), and what its ``act_fn`` computes.

The fp8 checks (:mod:`moekit.integrations.hf_fp8`) build on these; a whole model is checked by
:func:`moekit.integrations.transformers.check_model`, which picks the check for each module.
:func:`check_routing_ids` checks what a forward is handed: transformers' expert ids.
"""

from __future__ import annotations

import torch

from moekit.errors import InvalidIdsError, UnsupportedModelError

RUNS = (  # what moekit runs, said to a module it refuses
    "moekit computes down_proj @ (silu(gate) * up) with gate_up_proj [E, 2I, H] = gate rows then up rows, "
    "and no biases. Use experts_implementation='eager' or 'grouped_mm' for this model."
)


def check_routing_ids(top_k_index: torch.Tensor, E: int) -> None:
    """Raise InvalidIdsError for an id that is neither an expert of ``[0, E)`` nor an empty slot
    (``E``, transformers' marker (``RouterParallel``), or moekit's -1), naming it. Reads the ids
    back: a host sync on a GPU."""
    bad = (top_k_index > E) | (top_k_index < -1)
    if bad.any():
        raise InvalidIdsError(
            f"top_k_index must hold expert ids in [0, {E}) or {E} (transformers' empty-slot marker), got "
            f"{top_k_index[bad][:4].tolist()} at slots {bad.nonzero()[:4].tolist()}"
        )


def check_module(module: torch.nn.Module, *, name: str | None = None) -> None:
    """Raise UnsupportedModelError unless ``module`` computes ``down(silu(gate) * up)`` exactly."""
    gate_fn = getattr(type(module), "_apply_gate", None)
    own = gate_fn is not None and gate_fn.__module__ != "transformers.integrations.moe"  # not the default
    why = f"it has its own gating ({type(module).__name__}._apply_gate, e.g. a clamped SwiGLU)"
    reasons = gating_problems(module, own_gate=why if own else None)
    if not reasons:
        reasons += _weight_problems(module.gate_up_proj, getattr(module, "down_proj", None))
    refuse(module, reasons, name=name, path="moekit", runs=RUNS)


def gating_problems(module: torch.nn.Module, *, own_gate: str | None = None) -> list[str]:
    """Why ``module`` is not gated SiLU experts without biases, gate rows stacked before up rows (the
    flags that ``@use_experts_implementation`` records); ``own_gate``: why its gating is its own, if it is."""
    act = getattr(module, "act_fn", None)
    act_name = type(act).__name__ if isinstance(act, torch.nn.Module) else getattr(act, "__name__", repr(act))
    gated = getattr(module, "has_gate", True) and hasattr(module, "gate_up_proj")
    reasons = [] if gated else [f"its experts are not gated (up_proj, then {act_name}; no gate_up_proj)"]
    if getattr(module, "has_bias", False) or any(n.endswith("_bias") for n, _ in module.named_parameters()):
        reasons.append("its experts add biases to gate_up_proj/down_proj")
    if not getattr(module, "is_concatenated", True):
        reasons.append("its gate_up_proj interleaves gate and up rows (g0, u0, g1, u1, ...)")
    if getattr(module, "is_transposed", False):
        reasons.append("its weights are stored transposed (gate_up_proj [E, H, 2I])")
    if own_gate:
        reasons.append(own_gate)
    elif gated and not is_silu(act):
        reasons.append(f"its activation is {act_name}, not SiLU")
    return reasons


def refuse(module: torch.nn.Module, reasons: list[str], *, name: str | None, path: str, runs: str) -> None:
    """Raise UnsupportedModelError when there are ``reasons``: ``module`` (``name``) cannot run
    through ``path`` because of each of them; ``runs`` says what that path does run."""
    if reasons:
        where = f"{name} ({type(module).__name__})" if name else type(module).__name__
        raise UnsupportedModelError(f"{where} cannot run through {path}: " + "; ".join(reasons) + f". {runs}")


def is_experts(module: torch.nn.Module) -> bool:
    """True for a module whose class is decorated with ``@use_experts_implementation``."""
    # What @use_experts_implementation sets on every experts module it wraps.
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated"))


def is_silu(act) -> bool:
    if not callable(act):
        return False
    probe = torch.linspace(-8.0, 8.0, 65)
    try:
        with torch.no_grad():
            got = act(probe)
    except Exception:  # an activation with parameters on another device, or not elementwise
        return False
    return isinstance(got, torch.Tensor) and torch.allclose(got, torch.nn.functional.silu(probe), atol=1e-6)


def _weight_problems(w1, w2) -> list[str]:
    if not isinstance(w1, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return ["it has no gate_up_proj/down_proj tensors"]
    if not all(w.dim() == 3 and w.is_floating_point() and w.element_size() >= 2 for w in (w1, w2)):
        return [
            f"its weights are {w1.dtype} {tuple(w1.shape)} / {w2.dtype} {tuple(w2.shape)}, "
            "expected unquantized 3-D float tensors"
        ]
    E, N, K = w1.shape
    if N % 2 or tuple(w2.shape) != (E, K, N // 2):
        return [f"gate_up_proj {tuple(w1.shape)}, down_proj {tuple(w2.shape)} are not [E, 2I, H], [E, H, I]"]
    return []
