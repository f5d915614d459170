"""Run Hugging Face transformers MoE models through moekit's chunked modular kernel.

transformers 5 keeps a MoE layer's experts as two stacked tensors, ``gate_up_proj [E, 2I, H]``
(all gate rows, then all up rows) and ``down_proj [E, H, I]``: moekit's ``w1 [E, N, K]`` and
``w2 [E, K, N/2]`` with K = H and N = 2I. Its experts classes dispatch their forward through
``transformers.integrations.moe.ExpertsInterface``, so registering a function under a name is
all it takes::

    import moekit.integrations.transformers as moekit_hf   # on a CPU: before transformers
    moekit_hf.register(chunk_size=16)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="moekit")
    model(input_ids)
    moekit_hf.traces(model)        # {"model.layers.0.mlp.experts": Trace, ...}

Every experts module gets its own ``ModularKernel(MarkerPrepareFinalize(...), experts, chunk_size=C)``
on its first forward (all layers share one workspace pool per device), after a check that the
module computes exactly ``down(silu(gate) * up)``: no biases, SiLU, gate rows before up rows, no
custom gating. Anything else raises :class:`~moekit.errors.UnsupportedModelError`. Routing ids
are transformers' (id E marks an empty slot); any other id outside the layer's experts is refused
on the CPU (:func:`moekit_routing`, before the kernel) and poisons its token with NaN on a GPU, without
a host sync (in the kernel's prepare, :class:`~moekit.integrations.hf_routing.MarkerPrepareFinalize`).

fp8 block-quantized models (transformers' fine-grained fp8: ``FP8Experts`` with 128 x 128 weight
scales and dynamic 1 x 128 activation scales, as ``Qwen/Qwen3-30B-A3B-FP8``) run through
``fp8_experts`` (default :class:`~moekit.experts.TritonOrDeepGemmExperts`, so a prefill of 128 or
more tokens per chunk takes DeepGEMM's layout and the rest Triton): see
:mod:`moekit.integrations.hf_fp8`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moekit.device import check_import_order
from moekit.errors import InvalidInputError, OptionalDependencyError, UnsupportedModelError
from moekit.experts.base import Experts
from moekit.integrations.hf_checks import check_module, check_routing_ids, is_experts
from moekit.integrations.hf_fp8 import check_fp8_module, is_fp8_experts
from moekit.validate import check_flag
from moekit.workspace import PoolRegistry

NAME = "moekit"
INSTALL_HINT = "pip install 'moekit[hf]'"
# The names of moekit.api.BY_NAME that each kind of layer may ask for.
_NAMES = {"experts": ("triton",), "fp8_experts": ("triton", "triton_or_deep_gemm")}
# What register() passes on to ModularKernel; the chunk size is its own argument, and the workspace
# pool is the integration's (one per device, shared by every layer).
KERNEL_OPTIONS = ("chunk_by", "guard", "metadata_policy", "trace_counts", "workspace_policy")
# Each layer replays graphs up to this many tokens (decode): its graphs keep a workspace of their own
# per layer, sized for these rows (moekit.fused_moe shares one for every layer and goes to 128).
REPLAY_MAX_TOKENS = 16


def _hf_moe():
    """``transformers.integrations.moe``, or OptionalDependencyError naming the extra."""
    try:
        from transformers.integrations import moe
    except ImportError as e:
        raise OptionalDependencyError(
            f"the transformers integration needs transformers>=5 (got: {e}); install it with {INSTALL_HINT}"
        ) from e
    if not hasattr(moe, "ExpertsInterface"):
        raise OptionalDependencyError(f"transformers has no ExpertsInterface (need >=5); run {INSTALL_HINT}")
    return moe


@dataclass
class Settings:
    """What one registered name runs: an experts factory, a chunk size, kernel options."""

    name: str
    make_experts: Callable[[], Experts]
    make_fp8_experts: Callable[[], Experts]
    chunk_size: int | None
    kernel_options: dict
    replay: bool = False
    pools: PoolRegistry = field(default_factory=PoolRegistry)  # one WorkspacePool per device, for every layer

    def build_kernel(self, device: torch.device, *, fp8: bool = False):
        """A new ModularKernel for one layer (fp8: for an FP8Experts layer), on this setting's
        shared pool for ``device``."""
        from moekit.integrations.hf_routing import MarkerPrepareFinalize
        from moekit.modular_kernel import ModularKernel
        from moekit.types import QuantScheme

        pool = self.pools.get(device)
        experts = self.make_fp8_experts() if fp8 else self.make_experts()
        if not isinstance(experts, Experts):
            raise InvalidInputError(f"the experts factory must return an Experts, got {type(experts).__name__}")
        if fp8 and experts.quant is not QuantScheme.FP8_BLOCK:
            raise InvalidInputError(f"fp8_experts must run QuantScheme.FP8_BLOCK, got {experts!r}")
        stage = MarkerPrepareFinalize(convert=device.type != "cpu")  # (on the CPU, moekit_routing converts)
        return ModularKernel(stage, experts, chunk_size=self.chunk_size, pool=pool, **self.kernel_options)


@dataclass
class _Layer:
    settings: Settings
    device: torch.device
    kernel: object  # ModularKernel
    call: object  # the kernel, or its GraphedKernel (settings.replay, on a GPU)


def register(
    *,
    experts: str | Experts | Callable[[], Experts] = "triton",
    chunk_size: int | None = None,
    name: str = NAME,
    fp8_experts: str | Experts | Callable[[], Experts] = "triton_or_deep_gemm",
    replay: bool = True,
    **kernel_options,
) -> str:
    """Register ``name`` in transformers' ExpertsInterface; return ``name``.

    Afterwards ``from_config(cfg, experts_implementation=name)`` (or ``from_pretrained``, or
    ``model.set_experts_implementation(name)``) runs every MoE layer through moekit.
    Registering the same name again replaces its settings; layers rebuild their kernel on their
    next forward.

    Args:
        experts: ``"triton"`` (:class:`~moekit.experts.TritonExperts`), an :class:`Experts`
            instance (shared by all layers), or a zero-argument factory called once per layer.
        chunk_size: tokens per chunk, or None for one chunk per forward.
        name: the implementation name; register several (``"moekit-c16"``) to compare settings.
        fp8_experts: what fp8 block-quantized layers (``FP8Experts``) run: ``"triton_or_deep_gemm"``
            (the default), ``"triton"``, or an fp8 :class:`Experts` instance or factory.
        replay: on a GPU, each layer replays a CUDA graph per signature up to
            :data:`REPLAY_MAX_TOKENS` tokens (:class:`moekit.hopper.graphed.GraphedKernel`, at most 8
            graphs a layer, with a workspace of their own for 16 rows: about 1 MB a layer at
            Qwen3-30B-A3B's sizes); :func:`traces` then shows each layer's last forward that ran
            eagerly (the first call of a shape). False: never.
        **kernel_options: passed to :class:`~moekit.ModularKernel`: ``trace_counts``,
            ``workspace_policy``, ``metadata_policy``, ``guard``, ``chunk_by`` (:data:`KERNEL_OPTIONS`;
            not ``pool``: every layer on a device shares the integration's pool).

    Raises:
        OptionalDependencyError: transformers is not installed (``pip install 'moekit[hf]'``).
        InvalidInputError, ChunkSizeError: bad ``experts``, ``chunk_size`` or options.
        BackendUnavailableError: on a CPU, Triton was imported before moekit (import moekit first).
    """
    unknown = sorted(set(kernel_options) - set(KERNEL_OPTIONS))
    if unknown:
        why = "; the workspace pool is the integration's (one per device, shared by every layer)"
        raise InvalidInputError(
            f"register() passes {KERNEL_OPTIONS} on to ModularKernel, got {unknown}{why if 'pool' in unknown else ''}"
        )
    moe = _hf_moe()
    check_import_order()
    taken = moe.ALL_EXPERTS_FUNCTIONS.get(name) if isinstance(name, str) else None
    if not isinstance(name, str) or not name or name == "eager" or (taken and not hasattr(taken, "_moekit")):
        raise InvalidInputError(
            f"name must be a new experts implementation name (not one of transformers' "
            f"{['eager', *moe.ALL_EXPERTS_FUNCTIONS]}), got {name!r}"
        )
    settings = Settings(
        name, _experts_factory(experts), _experts_factory(fp8_experts, fp8=True), chunk_size, dict(kernel_options)
    )
    settings.replay = check_flag(replay, "replay")
    settings.build_kernel(torch.device("cpu"))  # validates experts, chunk size and options now
    settings.build_kernel(torch.device("cpu"), fp8=True)
    settings.pools.clear()
    # transformers calls them as forward(module, hidden_states, top_k_index, top_k_weights)
    forward = functools.partial(_forward, settings)
    fp8_forward = functools.partial(_forward, settings, fp8=True)
    forward._moekit = fp8_forward._moekit = settings
    moe.ExpertsInterface.register(name, forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface

        FP8ExpertsInterface.register(name, fp8_forward)
    except ImportError:  # older transformers: no fp8 experts
        pass
    return name


def check_model(model: torch.nn.Module) -> list[str]:
    """Check every experts module of ``model`` now (rather than on first forward).

    Returns the names of the MoE layers moekit will run; raises UnsupportedModelError naming
    the first layer that it cannot run, and why.
    """
    experts = {n: m for n, m in model.named_modules() if is_experts(m)}
    if not experts:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no transformers experts module (a class decorated with "
            "@use_experts_implementation); there is nothing for moekit to run"
        )
    for n, m in experts.items():
        (check_fp8_module if is_fp8_experts(m) else check_module)(m, name=n)
    return list(experts)


def traces(model: torch.nn.Module) -> dict:
    """``{layer name: Trace}`` of the last moekit forward of every MoE layer of ``model``.

    Layers that have not run through moekit yet are left out.
    """
    out = {}
    for layer_name, module in model.named_modules():
        layer = module.__dict__.get("_moekit")
        if layer is not None and layer.kernel.last_trace is not None:
            out[layer_name] = layer.kernel.last_trace
    return out


# ------------------------------------------------------------------------------------------
def _forward(settings: Settings, module, hidden_states, top_k_index, top_k_weights, *, fp8: bool = False):
    layer = module.__dict__.get("_moekit")
    if layer is None or layer.settings is not settings or layer.device != hidden_states.device:
        check_fp8_module(module) if fp8 else check_module(module)
        device = hidden_states.device
        kernel = call = settings.build_kernel(device, fp8=fp8)
        if settings.replay and device.type == "cuda":
            from moekit.hopper.graphed import GraphedKernel

            call = GraphedKernel(kernel, max_graphs=8, max_tokens=REPLAY_MAX_TOKENS)
        layer = _Layer(settings, device, kernel, call)
        module.__dict__["_moekit"] = layer  # not a submodule or buffer: stays out of state_dict
    w1, w2 = module.gate_up_proj, module.down_proj
    if torch.is_grad_enabled() and (w1.requires_grad or hidden_states.requires_grad):
        warnings.warn(
            "moekit's experts are inference-only: no gradient flows through them. Run the model "
            "under torch.no_grad() or torch.inference_mode().",
            stacklevel=3,
        )
    with torch.no_grad():
        if layer.kernel.prepare_finalize.convert:  # in the layer's prepare (a GPU), inside a replayed graph too
            ids, weights = top_k_index.contiguous(), top_k_weights.contiguous()
        else:  # the CPU, whose door checks ids: checked and converted first
            ids, weights = moekit_routing(top_k_index, top_k_weights, w1.shape[0])
        if fp8:  # prepare quantizes the activations per 1x128 group, as transformers' dynamic scheme
            scales = dict(w1_scale=module.gate_up_proj_scale_inv, w2_scale=module.down_proj_scale_inv)
            out = layer.call(hidden_states.contiguous(), w1, w2, weights, ids, **scales)
        else:
            out = layer.call(hidden_states.to(w1.dtype).contiguous(), w1, w2, weights, ids)
    return out.to(hidden_states.dtype)


def moekit_routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, E: int):
    """transformers' routing ``[M, topk]`` in moekit's convention: ``(ids, weights)``, contiguous.

    transformers marks an empty slot (an expert on another rank, ``RouterParallel``) with id ``E``,
    the layer's expert count; moekit marks it -1. Only ``E`` itself is that marker: any other id
    outside ``[-1, E]`` is a bug in the router (or the checkpoint), never an empty slot.

    - ids on the CPU are checked here (reading them costs no sync): InvalidIdsError;
    - ids on a GPU are not read back (that would be a host sync per layer per forward, and no CUDA
      graph could hold it): the weight of such a slot becomes NaN, so that its token's output is NaN,
      never a plausible answer with that slot silently dropped.

    >>> moekit_routing(torch.tensor([[0, 4]]), torch.tensor([[0.5, 0.5]]), 4)[0].tolist()
    [[0, -1]]

    Raises:
        InvalidIdsError: (CPU) an id below -1 or above ``E``, named with its value.
    """
    if top_k_index.device.type == "cpu":
        check_routing_ids(top_k_index, E)
        return torch.where(top_k_index == E, -1, top_k_index).contiguous(), top_k_weights.contiguous()
    from moekit.integrations.hf_routing import launch_marker_to_moekit

    return launch_marker_to_moekit(top_k_index, top_k_weights, E)  # one launch, nothing read back


def _experts_factory(experts, *, fp8: bool = False) -> Callable[[], Experts]:
    if isinstance(experts, str):
        from moekit.api import experts_class
        from moekit.types import QuantScheme

        what = "fp8_experts" if fp8 else "experts"
        factory = experts_class(experts, among=_NAMES[what], what=what)
        return functools.partial(factory, quant=QuantScheme.FP8_BLOCK) if fp8 else factory
    if isinstance(experts, Experts):
        return lambda: experts
    if callable(experts):
        return experts
    raise InvalidInputError(f"experts must be a name, an Experts instance or a factory, got {type(experts).__name__}")
