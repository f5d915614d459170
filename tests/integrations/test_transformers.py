"""moekit as a transformers experts implementation: tiny random models, moekit vs eager.

Sizes are tiny on purpose (hidden 64, 2 layers, 8 experts): the kernels run in Triton's
interpreter on CPU.
"""

from __future__ import annotations

import importlib
import math
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit  # noqa: E402
import moekit.integrations.transformers as moekit_hf  # noqa: E402
from moekit.errors import (  # noqa: E402
    ChunkSizeError,
    InvalidIdsError,
    InvalidInputError,
    OptionalDependencyError,
    UnsupportedModelError,
)
from moekit.experts.triton import TritonExperts  # noqa: E402
from moekit.testing import assert_close, expect_raises  # noqa: E402

pytestmark = pytest.mark.hf
DEVICE = moekit.device.get_device()  # the kernels' device: the models and their inputs go there

TINY = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
FAMILIES = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "olmoe": dict(num_experts=8, intermediate_size=32),
    "mixtral": dict(num_local_experts=8, intermediate_size=32, head_dim=16),
    "deepseek_v3": dict(
        n_routed_experts=8, moe_intermediate_size=32, intermediate_size=64, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16,
    ),
}
CHUNKS = {"moekit": None, "moekit-c16": 16, "moekit-c1": 1}

# Families whose experts moekit must refuse, and the reason it must give.
REFUSED = {
    "deepseek_v4": "own gating",
    "diffusion_gemma": "activation is GELUTanh",
    "gemma4": "activation is GELUTanh",
    "glm5_next": "own gating",
    "gpt_oss": "biases.*interleaves.*transposed",
    "hy_v4": "own gating",
    "minimax_m3_vl": "own gating",
    "nemotron_h": "not gated",
    "openai_privacy_filter": "biases.*transposed",
}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    for name, chunk_size in CHUNKS.items():
        moekit_hf.register(chunk_size=chunk_size, name=name)


def tiny_model(family: str, dtype=torch.float32, **overrides):
    cfg = transformers.AutoConfig.for_model(family, **{**TINY, **FAMILIES.get(family, {}), **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", dtype=dtype)
    return model.to(DEVICE).eval()


def logits(model, impl: str, ids: torch.Tensor) -> torch.Tensor:
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_eager(family, dtype):
    model = tiny_model(family, dtype)
    layers = moekit_hf.check_model(model)
    topk = model.config.num_experts_per_tok
    for impl, C in CHUNKS.items():
        ids = torch.randint(3, 128, (1, 5) if C == 1 else (2, 10), device=DEVICE)  # C=1: small M
        expected = logits(model, "eager", ids)
        assert_close(logits(model, impl, ids), expected, dtype=dtype)
        traces = moekit_hf.traces(model)
        assert list(traces) == layers
        M = ids.numel()
        for trace in traces.values():
            assert trace.M == M and len(trace) == (1 if C is None else math.ceil(M / C))
            counts = trace.counts_matrix()
            assert counts.shape[1] == 8 and int(counts.sum()) == M * topk


def test_greedy_generation_same_with_and_without_chunking():
    # Two prompts, so that under C=1 every decode step (M=2) is chunked too, not just the prompt.
    model = tiny_model("qwen3_moe", num_hidden_layers=1)
    ids = torch.randint(3, 128, (2, 4), device=DEVICE)
    out = {}
    for impl in ("eager", "moekit", "moekit-c1"):
        model.set_experts_implementation(impl)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 min_new_tokens=8, do_sample=False)
        out[impl] = gen[:, ids.shape[1]:]
    assert out["moekit"].shape == (2, 8)
    assert torch.equal(out["moekit-c1"], out["moekit"])
    assert torch.equal(out["moekit"], out["eager"])
    assert len(moekit_hf.traces(model)["model.layers.0.mlp.experts"]) == 2  # last step: M=2, C=1


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU (CUDA graphs)")
def test_on_a_gpu_each_layer_replays_a_graph_unless_told_not_to():
    model = tiny_model("qwen3_moe", torch.bfloat16, num_hidden_layers=1)
    moekit_hf.register(name="moekit-plain", replay=False)
    ids = torch.randint(3, 128, (1, 3), device=DEVICE)  # M=3 replays the graph of 4 rows
    want = logits(model, "moekit-plain", ids)
    layer = model.model.layers[0].mlp.experts.__dict__["_moekit"]
    assert layer.call is layer.kernel
    modes = []
    for _ in range(2):
        assert_close(logits(model, "moekit", ids), want, dtype=torch.bfloat16)
        layer = model.model.layers[0].mlp.experts.__dict__["_moekit"]
        modes.append(layer.call.last_mode)
    assert modes == ["captured", "replayed"]


def test_unsupported_models_are_refused_by_name():
    gpt_oss = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(
            "gpt_oss", **{**TINY, "num_local_experts": 8, "intermediate_size": 32, "head_dim": 16}
        ),
        experts_implementation="moekit",
    )
    first = r"^model\.layers\.0\.mlp\.experts \(GptOssExperts\) cannot run.*biases"  # the first layer, by name
    with expect_raises(UnsupportedModelError, match=first):
        moekit_hf.check_model(gpt_oss)
    with expect_raises(UnsupportedModelError, match=r"GptOssExperts.*interleaves"), torch.no_grad():
        gpt_oss(torch.randint(3, 128, (1, 4)))
    gelu = tiny_model("qwen3_moe", hidden_act="gelu")
    gelu.set_experts_implementation("moekit")
    with expect_raises(UnsupportedModelError, match="activation is GELUActivation"), torch.no_grad():
        gelu(torch.randint(3, 128, (1, 4), device=DEVICE))
    dense = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **TINY))
    with expect_raises(UnsupportedModelError, match="no transformers experts module"):
        moekit_hf.check_model(dense)


def _experts_classes() -> list[tuple[str, str]]:
    """Every (model dir, class) decorated with @use_experts_implementation in this transformers."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    found = []
    decorated = re.compile(r"^@use_experts_implementation(?:\(.*\))?\nclass (\w+)\(", re.M)
    for path in sorted(root.glob("*/modeling_*.py")):
        for m in decorated.finditer(path.read_text()):
            found.append((path.parent.name, m.group(1)))
    return found


def _tiny_experts(family: str, cls_name: str) -> torch.nn.Module:
    """Build one experts module of ``family`` with 8 experts, H=64, I=32 (trying its configs)."""
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    configs = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    cls = getattr(modeling, cls_name)
    errors = []
    own = [c for c in vars(configs).values() if isinstance(c, type) and c.__module__ == configs.__name__]
    for config_cls in sorted(own, key=lambda c: "Text" not in c.__name__):  # MoE lives in the text model
        cfg = config_cls()
        for key, value in dict(hidden_size=64, intermediate_size=32, moe_intermediate_size=32, num_experts=8,
                               num_local_experts=8, n_routed_experts=8, moe_num_experts=8).items():
            try:
                setattr(cfg, key, value)
            except Exception:  # read-only on this config
                pass
        torch.manual_seed(0)
        try:
            module = cls(cfg)
        except Exception:  # some take the intermediate size apart (Ernie 4.5 VL: text and vision)
            try:
                module = cls(cfg, intermediate_size=32)
            except Exception as e:  # not this family's experts config
                errors.append(f"{config_cls.__name__}: {e}")
                continue
        for p in module.parameters():
            p.data = torch.randn_like(p) / 8
        return module.to(DEVICE)
    raise AssertionError(f"could not build {cls_name}: {errors}")


@pytest.mark.parametrize(("family", "cls_name"), _experts_classes())
def test_every_experts_class_matches_eager_or_is_refused(family, cls_name):
    module = _tiny_experts(family, cls_name)
    if family in REFUSED:
        with expect_raises(UnsupportedModelError, match=REFUSED[family]):
            moekit_hf.check_module(module)
        return
    hidden = torch.randn(8, 64, device=DEVICE)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(8)]).to(DEVICE)
    weights = torch.rand(8, 2, device=DEVICE)
    with torch.no_grad():
        module.config._experts_implementation = "eager"
        expected = module(hidden, ids, weights)
        module.config._experts_implementation = "moekit-c16"
        assert_close(module(hidden, ids, weights), expected, dtype=torch.float32)


def test_only_E_marks_an_empty_slot_and_other_ids_are_named():
    # Issue 25, item 3: the `< E` test meant for transformers' marker E also swallowed 1000.
    module = _tiny_experts("qwen3_moe", "Qwen3MoeExperts")
    hidden, weights = torch.randn(4, 64, device=DEVICE), torch.rand(4, 2, device=DEVICE)
    marked = torch.tensor([[0, 8], [8, 3], [5, 6], [8, 8]], device=DEVICE)  # 8 = E: an empty slot
    with torch.no_grad():
        module.config._experts_implementation = "eager"  # its one_hot refuses id E: drop those slots by weight
        expected = module(hidden, marked % 8, torch.where(marked == 8, 0, weights))
        module.config._experts_implementation = "moekit"
        assert_close(module(hidden, marked, weights), expected, dtype=torch.float32)
        for bad in (1000, 9, -2):
            ids = marked.clone()
            ids[2, 1] = bad
            if DEVICE.type == "cpu":
                with expect_raises(InvalidIdsError, match=rf"\[0, 8\) or 8 .*got \[{bad}\] at slots \[\[2, 1\]\]"):
                    module(hidden, ids, weights)
            else:  # no host read on a GPU: the token of a bad slot comes out NaN
                out = module(hidden, ids, weights)
                assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()


def test_registering_again_rebuilds_each_layer_kernel():
    module = _tiny_experts("mixtral", "MixtralExperts")
    module.config._experts_implementation = "moekit-again"
    hidden, ids = torch.randn(8, 64, device=DEVICE), torch.tensor([[0, 1], [2, 3]] * 4, device=DEVICE)
    weights = torch.rand(8, 2, device=DEVICE)
    for C in (4, 2):
        moekit_hf.register(chunk_size=C, name="moekit-again")
        with torch.no_grad():
            module(hidden, ids, weights)
        (trace,) = moekit_hf.traces(module).values()
        assert len(trace) == 8 // C and trace.counts_matrix().sum(0)[:4].tolist() == [8 // 2] * 4


def test_register_validates_and_names_the_extra(monkeypatch):
    with expect_raises(InvalidInputError, match="experts must be one of"):
        moekit_hf.register(experts="cutlass")
    with expect_raises(InvalidInputError, match="new experts implementation name"):
        moekit_hf.register(name="grouped_mm")
    with expect_raises(ChunkSizeError):
        moekit_hf.register(chunk_size=0, name="moekit-bad")
    # Issue 25, item 15: both were TypeErrors from ModularKernel's signature.
    with expect_raises(InvalidInputError, match=r"on to ModularKernel, got \['bogus_option'\]"):
        moekit_hf.register(bogus_option=1, name="moekit-bad")
    with expect_raises(InvalidInputError, match=r"got \['pool'\]; the workspace pool is the integration's"):
        moekit_hf.register(pool=None, name="moekit-bad")
    with expect_raises(InvalidInputError, match="guard must be True or False"):
        moekit_hf.register(guard="no", name="moekit-bad")
    with expect_raises(InvalidInputError, match="replay must be True or False"):
        moekit_hf.register(replay="no", name="moekit-bad")
    assert moekit_hf.register(experts=TritonExperts(), name="moekit-instance") == "moekit-instance"
    assert moekit_hf.register(experts=TritonExperts, name="moekit-factory") == "moekit-factory"
    for mod in [m for m in sys.modules if m.split(".")[0] == "transformers"]:
        monkeypatch.setitem(sys.modules, mod, None)  # as if it were not installed
    with expect_raises(OptionalDependencyError, match=re.escape("pip install 'moekit[hf]'")):
        moekit_hf.register()


def test_fp8_experts_are_refused_and_training_warns():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

    module = _tiny_experts("qwen3_moe", "Qwen3MoeExperts")
    with expect_raises(UnsupportedModelError, match="fp8"):
        ALL_FP8_EXPERTS_FUNCTIONS.get_interface("moekit", None)(module, None, None, None)
    module.config._experts_implementation = "moekit"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = module(torch.randn(4, 64, device=DEVICE), torch.tensor([[0, 1]] * 4, device=DEVICE),
                     torch.rand(4, 2, device=DEVICE))
    assert not out.requires_grad
    assert any("inference-only" in str(w.message) for w in caught)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_model_copies_after_a_moekit_forward(how):
    # Issue 25, item 12: after one forward every layer holds a kernel and the shared pool (an RLock).
    import copy
    import io
    import pickle

    def saved(model):
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    model = tiny_model("qwen3_moe")
    ids = torch.randint(3, 128, (1, 6), device=DEVICE)
    expected = logits(model, "moekit-c16", ids)
    assert moekit_hf.traces(model)
    copy_of = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)), "torch.save": saved}[how](
        model)  # fmt: skip
    assert torch.equal(logits(copy_of, "moekit-c16", ids), expected)
    assert list(moekit_hf.traces(copy_of)) == list(moekit_hf.traces(model))
    assert torch.equal(logits(model, "moekit-c16", ids), expected)  # the original runs on


def test_import_moekit_does_not_import_transformers():
    code = "import sys, moekit, moekit.integrations.transformers; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not moekit.device.interpreting(), reason="only the CPU interpreter cares about import order")
def test_transformers_imported_before_moekit_is_named():
    # transformers imports Triton; Triton imported before moekit set TRITON_INTERPRET breaks the kernels.
    code = (
        "from transformers import AutoModelForCausalLM\n"
        "import moekit.integrations.transformers as m\n"
        "from moekit.errors import BackendUnavailableError\n"
        "try:\n    m.register()\nexcept BackendUnavailableError as e:\n    assert 'import moekit' in str(e)\n"
        "else:\n    raise SystemExit('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
