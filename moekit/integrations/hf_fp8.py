"""fp8 block-quantized transformers experts (the fine-grained fp8 format) through moekit.

transformers' FineGrainedFP8 keeps a quantized MoE layer as ``FP8Experts``: ``gate_up_proj``
fp8 e4m3 ``[E, 2I, H]`` with ``gate_up_proj_scale_inv`` float32 ``[E, 2I/128, H/128]`` (a weight
is ``q * scale_inv`` of its 128 x 128 block), ``down_proj`` ``[E, H, I]`` with its own scales, and
activations quantized per token in groups of 128 when the layer runs (``activation_scheme=
"dynamic"``). That is moekit's ``QuantScheme.FP8_BLOCK``, scales included, so the tensors pass
to the modular kernel as they are.

- :func:`check_fp8_module` refuses, with the reason, what moekit cannot run exactly;
- :func:`to_fp8_experts` turns a bf16/fp32 model's experts into ``FP8Experts`` holding moekit's
  block quantization of the same weights. transformers' own quantizer needs a GPU (on a CPU it
  refuses to quantize, and loads a pre-quantized checkpoint dequantized to bf16); this builds the
  fp8 modules directly, on any device, for tests, notebooks and CPU experiments.
"""

from __future__ import annotations

import torch

from moekit.errors import OptionalDependencyError, UnsupportedModelError
from moekit.integrations.hf_checks import check_module, check_routing_ids, gating_problems, is_experts, refuse
from moekit.quant import FP8, FP8_GROUP

BLOCK = (FP8_GROUP, FP8_GROUP)
FP8_RUNS = (  # what moekit runs, said to an fp8 module it refuses
    "moekit runs fine-grained fp8 experts: fp8 e4m3 weights, float32 128x128 block scales, dynamic 1x128 "
    "activation scales, SiLU gating, no biases."
)


def is_fp8_experts(module: torch.nn.Module) -> bool:
    """True for transformers' FP8Experts (or a class derived from it)."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:
        return False
    return isinstance(module, FP8Experts)


def check_fp8_module(module: torch.nn.Module, *, name: str | None = None) -> None:
    """Raise UnsupportedModelError unless moekit computes exactly what ``module`` computes:
    gated SiLU experts, no biases, fp8 e4m3 weights with float32 128 x 128 block scales, dynamic
    1 x 128 activation scales, and H and I multiples of 128 (moekit's fp8 kernels' tiles)."""
    reasons = []
    block = tuple(module.block_size) if getattr(module, "block_size", None) is not None else None
    if block != BLOCK:
        reasons.append(f"its weights are quantized in blocks of {block or 'one scale per tensor'}, not 128 x 128")
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        reasons.append("its activations use static scales (activation_scheme='static'); moekit quantizes per token")
    clamped = getattr(module, "swiglu_alpha", None) is not None or getattr(module, "limit", None) is not None
    own_gate = "it clamps or scales its SwiGLU (swiglu_alpha / swiglu_limit)" if clamped else None
    reasons += gating_problems(module, own_gate=own_gate)
    if not reasons:
        reasons += _fp8_weight_problems(module)
    refuse(module, reasons, name=name, path="moekit's fp8 path", runs=FP8_RUNS)


def _fp8_weight_problems(module) -> list[str]:
    w1, w2 = module.gate_up_proj, getattr(module, "down_proj", None)
    s1, s2 = getattr(module, "gate_up_proj_scale_inv", None), getattr(module, "down_proj_scale_inv", None)
    if not all(isinstance(t, torch.Tensor) for t in (w1, w2, s1, s2)):
        return ["it lacks gate_up_proj/down_proj and their *_scale_inv tensors"]
    if w1.dtype != FP8 or w2.dtype != FP8:
        return [f"its weights are {w1.dtype}/{w2.dtype}, not float8_e4m3fn (fp4 or int8 experts)"]
    if s1.dtype != torch.float32 or s2.dtype != torch.float32:
        return [f"its block scales are {s1.dtype}, not float32 (UE8M0 scales, scale_fmt='ue8m0')"]
    E, N, K = w1.shape
    if N % 2 or tuple(w2.shape) != (E, K, N // 2):
        return [f"gate_up_proj {tuple(w1.shape)}, down_proj {tuple(w2.shape)} are not [E, 2I, H], [E, H, I]"]
    if K % FP8_GROUP or (N // 2) % FP8_GROUP:
        return [f"hidden size {K} and intermediate size {N // 2} must be multiples of {FP8_GROUP}"]
    want1, want2 = (E, N // FP8_GROUP, K // FP8_GROUP), (E, K // FP8_GROUP, N // 2 // FP8_GROUP)
    if tuple(s1.shape) != want1 or tuple(s2.shape) != want2:
        return [f"its scales are {tuple(s1.shape)} / {tuple(s2.shape)}, expected {want1} / {want2}"]
    return []


def to_fp8_experts(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every experts module of ``model`` (in place) by transformers' ``FP8Experts``
    holding the fp8 e4m3 block quantization (128 x 128, float32 scales) of its weights; returns
    ``model``. The modules dispatch through transformers' fp8 experts interface, so
    ``experts_implementation`` picks their forward ("moekit", "grouped_mm", ...) as for a
    checkpoint quantized by transformers.

    Raises:
        OptionalDependencyError: transformers has no fine-grained fp8 integration.
        UnsupportedModelError: an experts module is not gated SiLU without biases, or its sizes
            are not multiples of 128.
    """
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
        from transformers.integrations.moe import use_experts_implementation
    except ImportError as e:
        raise OptionalDependencyError(f"to_fp8_experts needs transformers>=5 with finegrained_fp8 ({e})") from e
    from moekit.quant import quantize_fp8_block

    fp8_class = use_experts_implementation(
        experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS, has_bias=False, has_gate=True
    )
    targets = [(n, m) for n, m in model.named_modules() if is_experts(m) and not is_fp8_experts(m)]
    for name, module in targets:
        check_module(module, name=name)
        config = getattr(module, "config", None) or model.config.get_text_config()
        new = fp8_class(config=config, block_size=BLOCK, activation_scheme="dynamic")
        with torch.no_grad():
            for proj in ("gate_up_proj", "down_proj"):
                q, scale = quantize_fp8_block(getattr(module, proj).detach().float())
                setattr(new, proj, torch.nn.Parameter(q, requires_grad=False))
                setattr(new, f"{proj}_scale_inv", torch.nn.Parameter(scale.float(), requires_grad=False))
        check_fp8_module(new, name=name)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model


def fp8_reference_forward(module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """An FP8Experts forward in fp32 torch that rounds what moekit's fp8 path rounds: the
    activations quantized per token in 1 x 128 groups, the dequantized block weights, and the
    intermediate (silu(gate) * up) quantized the same way before GEMM2. The oracle of the fp8 path
    (register it with :func:`register_fp8_reference`).

    Id ``E`` (transformers' marker of an empty slot: an expert on another rank) and -1 add nothing;
    any other id outside ``[0, E)`` raises InvalidIdsError, as moekit does on the CPU.
    """
    from moekit.quant import dequantize_fp8_block, dequantize_fp8_per_token_group, quantize_fp8_per_token_group
    from moekit.reference import silu_and_mul

    def fake_quant(x):
        return dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(x.float()))

    E = module.gate_up_proj.shape[0]
    check_routing_ids(top_k_index, E)
    w1 = dequantize_fp8_block(module.gate_up_proj, module.gate_up_proj_scale_inv)
    w2 = dequantize_fp8_block(module.down_proj, module.down_proj_scale_inv)
    x = fake_quant(hidden_states)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in top_k_index.unique().tolist():
        if e in (E, -1):  # an empty slot: E is transformers' marker (remote experts), -1 moekit's
            continue
        token, slot = (top_k_index == e).nonzero(as_tuple=True)
        act = fake_quant(silu_and_mul(x[token] @ w1[e].t()))
        out.index_add_(0, token, (act @ w2[e].t()) * top_k_weights[token, slot, None].float())
    return out.to(hidden_states.dtype)


def register_fp8_reference(name: str = "fp8-reference") -> str:
    """Register :func:`fp8_reference_forward` as an fp8 ``experts_implementation``; returns ``name``."""
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface

    FP8ExpertsInterface.register(name, fp8_reference_forward)
    from transformers.integrations import moe

    if moe.ALL_EXPERTS_FUNCTIONS.get(name) is None:  # the name must be valid for unquantized experts too
        moe.ExpertsInterface.register(name, _not_fp8)
    return name


def _not_fp8(module, *args, **kwargs):
    raise UnsupportedModelError(f"{type(module).__name__} is not fp8; 'fp8-reference' runs fp8 experts only")
