"""fp8 block-quantized transformers experts through moekit: the PR's check in miniature.

A tiny random Qwen3-MoE-like model (hidden 128, intermediate 128, 8 experts, 2 layers), its
experts quantized to transformers' fine-grained fp8 format by ``to_fp8_experts``; the oracle is
``fp8_reference_forward`` (fp32 torch rounding what moekit rounds).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.finegrained_fp8")

import moekit  # noqa: E402
import moekit.integrations.transformers as moekit_hf  # noqa: E402
from moekit.errors import UnsupportedModelError  # noqa: E402
from moekit.integrations.hf_fp8 import (  # noqa: E402
    check_fp8_module,
    is_fp8_experts,
    register_fp8_reference,
    to_fp8_experts,
)
from moekit.quant import FP8, FP8_GROUP, dequantize_fp8_block  # noqa: E402
from moekit.testing import NORM_TOLERANCE, assert_close, expect_raises  # noqa: E402

pytestmark = pytest.mark.hf
DEVICE = moekit.device.get_device()
CONFIG = dict(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              num_experts=8, moe_intermediate_size=128, head_dim=32, norm_topk_prob=True)  # fmt: skip
CHUNKS = {"moekit-fp8": None, "moekit-fp8-c64": 64, "moekit-fp8-c1": 1, "moekit-fp8-c128": 128}
ORACLE_CHECKED = ("moekit-fp8", "moekit-fp8-c64", "moekit-fp8-c1")  # c128: in the switch test below


@pytest.fixture(scope="module")
def models():
    for name, C in CHUNKS.items():
        moekit_hf.register(chunk_size=C, name=name)
    register_fp8_reference()
    cfg = transformers.AutoConfig.for_model("qwen3_moe", **CONFIG)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(DEVICE).eval()
    fp8 = to_fp8_experts(copy.deepcopy(base))
    return base, fp8


def _norm_error(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _dequantized_copy_weights(fp8_model: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """Write the dequantized weights of ``fp8_model``'s FP8Experts into the matching experts of
    ``model`` (same architecture, unquantized): the same fp8-rounded values in ``model``'s dtype.
    Returns ``model``."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, m in fp8_model.named_modules():
            if is_fp8_experts(m):
                target = modules[name]
                for proj in ("gate_up_proj", "down_proj"):
                    w = dequantize_fp8_block(getattr(m, proj), getattr(m, f"{proj}_scale_inv"))
                    getattr(target, proj).copy_(w.to(getattr(target, proj).dtype))
    return model


def test_to_fp8_experts_builds_transformers_fp8_modules(models):
    base, fp8 = models
    experts = [m for m in fp8.modules() if is_fp8_experts(m)]
    assert len(experts) == 2 and all(m.gate_up_proj.dtype == FP8 for m in experts)
    assert moekit_hf.check_model(fp8) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    # The dequantized copy holds the same fp8-rounded values.
    ref = _dequantized_copy_weights(fp8, copy.deepcopy(base))
    w = ref.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(w, base.model.layers[0].mlp.experts.gate_up_proj)
    assert_close(w, base.model.layers[0].mlp.experts.gate_up_proj, dtype=FP8)


@pytest.mark.parametrize("impl", ORACLE_CHECKED)
def test_every_layer_and_the_logits_match_the_fp8_oracle(models, impl):
    _, fp8 = models
    _check_against_the_oracle(fp8, impl, torch.randint(3, 128, (1, 8 if CHUNKS[impl] == 1 else 130), device=DEVICE))


def _record_experts_calls(model, into: dict) -> list:
    """Hooks that keep each fp8 experts layer's first (inputs, output) in ``into``, by name."""
    return [m.register_forward_hook(lambda m, a, o, n=n: into.setdefault(n, (a, o.clone())) and None)
            for n, m in model.named_modules() if is_fp8_experts(m)]  # fmt: skip


def _same_inputs(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


def _check_against_the_oracle(fp8, impl: str, ids: torch.Tensor) -> None:
    """Every fp8 experts layer on the oracle's own inputs, and the logits, for ``impl``."""
    seen, ran = {}, {}
    hooks = _record_experts_calls(fp8, seen)
    fp8.set_experts_implementation("fp8-reference")
    with torch.no_grad():
        want = fp8(ids).logits
    for h in hooks:
        h.remove()
    fp8.set_experts_implementation(impl)
    modules = dict(fp8.named_modules())
    hooks = _record_experts_calls(fp8, ran)
    with torch.no_grad():
        got = fp8(ids).logits
        for h in hooks:
            h.remove()
        for name, (args, out) in seen.items():  # each layer on the oracle's own inputs
            # A layer that met exactly the oracle's inputs in the forward above (the first one: nothing
            # of moekit's ran before it) has its answer to them already; the others run on them here.
            mine, answer = ran[name]
            assert_close(answer if _same_inputs(mine, args) else modules[name](*args), out, dtype=FP8)
    # Two layers of attention carry fp8's rounding flips on: the logits agree in norm.
    assert _norm_error(got, want) <= NORM_TOLERANCE[FP8]
    for trace in moekit_hf.traces(fp8).values():
        assert trace.M == ids.numel() and int(trace.counts_matrix().sum()) == ids.numel() * 2


def test_a_prefill_crosses_the_deep_gemm_switch_inside_the_model(models):
    """130 prompt tokens in chunks of 128: chunk 0 takes DeepGEMM's layout, chunk 1 Triton; both
    give the oracle's answer."""
    _, fp8 = models
    _check_against_the_oracle(fp8, "moekit-fp8-c128", torch.randint(3, 128, (1, 130), device=DEVICE))
    for trace in moekit_hf.traces(fp8).values():
        assert [b.split("[")[0] for b in trace.backends] == ["deep_gemm", "triton"]


def test_greedy_generation_is_the_same_with_chunks_of_64(models):
    """The PR's VLLM_FUSED_MOE_CHUNK_SIZE=64 run: greedy tokens with and without chunking agree;
    where they part, the unchunked run's top two logits were within fp8's rounding (a tie)."""
    _, fp8 = models
    ids = torch.randint(3, 128, (1, 130), device=DEVICE)
    runs = {}
    for impl in ("moekit-fp8", "moekit-fp8-c64"):
        fp8.set_experts_implementation(impl)
        with torch.no_grad():
            runs[impl] = fp8.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                      do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    a, b = (runs[k].sequences[0, ids.shape[1] :] for k in runs)
    assert a.shape == (8,)
    if not torch.equal(a, b):
        step = int((a != b).nonzero()[0])
        top2 = runs["moekit-fp8"].logits[step][0].float().topk(2).values
        scale = float(runs["moekit-fp8"].logits[step][0].float().abs().max())
        assert float(top2[0] - top2[1]) <= 0.06 * scale, f"generation parted at step {step} without a tie"


def test_the_fp8_oracle_and_moekit_skip_transformers_empty_marker(models):
    # Issue 25's test holes: the oracle indexing the weights with id E went unnoticed (no test had E).
    from moekit.errors import InvalidIdsError

    _, fp8 = models
    module = fp8.model.layers[0].mlp.experts
    torch.manual_seed(3)
    hidden, weights = torch.randn(6, 128, device=DEVICE), torch.rand(6, 2, device=DEVICE)
    marked = torch.tensor([[0, 8], [8, 3], [5, 6], [8, 8], [7, 1], [2, 8]], device=DEVICE)  # 8 = E: empty
    dropped = torch.where(marked == 8, 0, weights)
    fp8.set_experts_implementation("fp8-reference")
    with torch.no_grad():
        want = module(hidden, marked % 8, dropped)
        assert_close(module(hidden, marked, weights), want, dtype=torch.float32)
        assert not want[3].any()  # a token whose every slot is empty gets nothing
        with expect_raises(InvalidIdsError, match=r"or 8 \(transformers' empty-slot marker\), got \[1000, 1000"):
            module(hidden, torch.where(marked == 8, 1000, marked), weights)
        fp8.set_experts_implementation("moekit-fp8")
        assert_close(module(hidden, marked, weights), want, dtype=FP8)


def _fp8_module(**overrides):
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    cfg = transformers.AutoConfig.for_model("qwen3_moe", **{**CONFIG, **overrides.pop("config", {})})
    cls = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS,
                                     has_bias=False, has_gate=overrides.pop("has_gate", True))  # fmt: skip
    m = cls(config=cfg, **{"block_size": (FP8_GROUP, FP8_GROUP), "activation_scheme": "dynamic", **overrides})
    for p in m.parameters():
        p.data = torch.zeros_like(p.data) if p.is_floating_point() else p.data
    return m


@pytest.mark.parametrize("overrides, reason", [
    (dict(block_size=(64, 64)), "blocks of .64, 64."),
    (dict(block_size=None), "one scale per tensor"),
    (dict(activation_scheme="static"), "static scales"),
    (dict(scale_fmt="ue8m0"), "UE8M0"),
    (dict(config=dict(swiglu_limit=7.0)), "clamps or scales its SwiGLU"),
    (dict(config=dict(hidden_act="gelu")), "not SiLU"),
    (dict(config=dict(hidden_size=64, head_dim=16)), "hidden size 64 and intermediate size 128 must be"),
    # Issue 25's test holes: a check of the hidden size alone let these through (or named their scales).
    (dict(config=dict(moe_intermediate_size=64)), "hidden size 128 and intermediate size 64 must be multiples of 128"),
    (dict(config=dict(moe_intermediate_size=192)), "and intermediate size 192 must be multiples of 128"),
    (dict(has_gate=False), "not gated"),
])  # fmt: skip
def test_fp8_variants_moekit_cannot_run_are_refused_with_the_reason(overrides, reason):
    try:
        module = _fp8_module(**overrides)
    except (TypeError, RuntimeError, AttributeError) as e:  # this transformers cannot build the variant
        pytest.skip(f"transformers builds no such FP8Experts here: {e}")
    with expect_raises(UnsupportedModelError, match=reason):
        check_fp8_module(module)


def test_register_rejects_an_unquantized_fp8_experts_choice():
    from moekit.errors import InvalidInputError
    from moekit.experts import TritonExperts

    with expect_raises(InvalidInputError, match="fp8_experts must be one of"):
        moekit_hf.register(fp8_experts="deep_gemm_only", name="moekit-bad")
    with expect_raises(InvalidInputError, match="fp8_experts must run QuantScheme.FP8_BLOCK"):
        moekit_hf.register(fp8_experts=TritonExperts(), name="moekit-bad2")
    assert moekit.QuantScheme.FP8_BLOCK  # (the scheme the default factory passes)
