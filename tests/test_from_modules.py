"""``fusedkv_torch.FusedKVMaterializer.from_modules`` on the attention modules a serving stack holds.

transformers' own Qwen3 (K-norm), Llama (llama3 RoPE, no K-norm) and Qwen2 (K/V biases)
attention modules, with the model's rotary embedding, give transformers' K and V; a
hand-built module shaped as vLLM's (a fused ``qkv_proj`` with ``q_size``/``kv_size``, a
``rotary_emb`` with its own ``cos_sin_cache``) gives the NumPy reference on its weights.
Modules it cannot read are refused naming the attribute and the layer.
"""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fusedkv_torch  # noqa: E402
from backends import host  # noqa: E402
from interop.core.materializer import LayerKV, RopeConfig, projection_reference, rope_cos_sin_cache  # noqa: E402
from interop.testing import TOLERANCES, MaterializerCase, assert_bit_exact, assert_close  # noqa: E402
from test_from_pretrained import (FAMILIES, TINY, TOKENS, _assert_k_matches_transformers,  # noqa: E402
                                  _transformers_kv)

HIDDEN, HEADS, HEAD_DIM = 64, 2, 16
# Where the materializer runs: the GPU where there is one (the kernel interpreted on the CPU otherwise).
DEVICE = "cuda" if torch.cuda.is_available() and not fusedkv_torch.kernel._launcher.interpreted else "cpu"


def _model(family: str):
    prefix, extra = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**TINY, **extra)
    torch.manual_seed(9)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).float()
    with torch.no_grad():  # norm weights of one and biases of zero would hide one not read
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "k_norm"):
                layer.self_attn.k_norm.weight.normal_(1.0, 0.25)
            for projection in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                if projection.bias is not None:
                    projection.bias.normal_(0.0, 0.5)
    return model


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32), rng.integers(0, 512, TOKENS).astype(np.int32)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_attention_modules_give_transformers_k_and_v(family):
    model = _model(family)
    attentions = [layer.self_attn for layer in model.model.layers]
    hidden, positions = _inputs()
    k_expected, v_expected, normed = _transformers_kv(attentions, model.model.rotary_emb, hidden, positions)
    model.to(DEVICE)
    materializer = fusedkv_torch.FusedKVMaterializer.from_modules(attentions, model.model.rotary_emb)
    k, v = materializer.materialize(torch.from_numpy(hidden).to(DEVICE), torch.from_numpy(positions))
    rope = RopeConfig.from_hf_config(model.config.to_dict(), max_position=TINY["max_position_embeddings"])
    assert materializer.config.normed == (family == "qwen3-k-norm")
    assert materializer.config.biased == (family == "qwen2-bias")
    assert not materializer.kv_proj_weight.requires_grad
    _assert_k_matches_transformers(k, k_expected, normed, positions, rope)
    assert_close(v, v_expected.astype(np.float32), name="v")


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float, name: str = "variance_epsilon"):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + torch.randn(size) / 4)
        setattr(self, name, eps)


class RotaryEmbedding(torch.nn.Module):
    """vLLM's rotary embedding as the materializer reads it: its table and two attributes."""

    def __init__(self, rotary_dim: int, neox: bool, max_position: int = 256, base: float = 1e4):
        super().__init__()
        self.head_size, self.rotary_dim, self.is_neox_style = HEAD_DIM, rotary_dim, neox
        self.register_buffer("cos_sin_cache", torch.from_numpy(rope_cos_sin_cache(max_position, rotary_dim, base)))


class FusedQKVAttention(torch.nn.Module):
    """An attention module shaped as vLLM's and sglang's: one qkv_proj, q_size, kv_size."""

    def __init__(self, rotary_emb, *, q_heads: int = 4, bias: bool = False, eps_name: str = "variance_epsilon"):
        super().__init__()
        self.head_dim, self.q_size, self.kv_size = HEAD_DIM, q_heads * HEAD_DIM, HEADS * HEAD_DIM
        self.qkv_proj = torch.nn.Linear(HIDDEN, self.q_size + 2 * self.kv_size, bias=bias)
        self.k_norm = RMSNorm(HEAD_DIM, 1e-6, eps_name)
        self.rotary_emb = rotary_emb


def _reference_case(attentions, rope: RopeConfig, hidden, positions) -> MaterializerCase:
    """The layers the test built, as LayerKV of NumPy arrays: the K and V rows of each fused projection."""
    layers = []
    for attention in attentions:
        rows = slice(attention.q_size, attention.q_size + 2 * attention.kv_size)
        bias = attention.qkv_proj.bias
        layers.append(LayerKV(attention.qkv_proj.weight.detach().numpy()[rows],
                              attention.k_norm.weight.detach().numpy(), 1e-6, HEADS, HEAD_DIM, rope,
                              kv_proj_bias=None if bias is None else bias.detach().numpy()[rows]))
    return MaterializerCase(tuple(layers), hidden, positions)


@pytest.mark.parametrize("rotary_dim, neox, bias, eps_name", [(16, True, False, "variance_epsilon"),
                                                              (8, False, True, "eps")])
def test_a_vllm_shaped_module_gives_the_reference_on_its_weights(rotary_dim, neox, bias, eps_name):
    torch.manual_seed(3)
    rotary_emb = RotaryEmbedding(rotary_dim, neox)
    attentions = [FusedQKVAttention(rotary_emb, bias=bias, eps_name=eps_name) for _ in range(2)]
    hidden, positions = _inputs(seed=1)
    rope = RopeConfig(rotary_dim, 256, style="neox" if neox else "gptj")
    case = _reference_case(attentions, rope, hidden, positions)
    for attention in attentions:
        attention.to(DEVICE)
    materializer = fusedkv_torch.FusedKVMaterializer.from_modules(attentions)  # layer 0's rotary_emb
    kv = host(materializer.project(torch.from_numpy(hidden).to(DEVICE)))
    k, v = materializer.materialize(torch.from_numpy(hidden).to(DEVICE), torch.from_numpy(positions))
    assert_close(kv, projection_reference(case.layers, hidden), name="kv", tolerance=TOLERANCES["float32"])
    k_reference, v_reference = case.op_reference(kv)
    assert_close(k, k_reference)
    assert_bit_exact(v, v_reference)


def test_the_rotary_table_is_the_modules_own():
    rotary_emb = RotaryEmbedding(16, True, base=5e5)
    materializer = fusedkv_torch.FusedKVMaterializer.from_modules([FusedQKVAttention(rotary_emb)])
    assert torch.equal(materializer.cos_sin_cache, rotary_emb.cos_sin_cache)


def _without(module, name: str):
    setattr(module, name, None)
    return module


REFUSED = {
    # name: (the modules, the message).
    "no-projection": (lambda emb: [FusedQKVAttention(emb), _without(FusedQKVAttention(emb), "qkv_proj")],
                      "Invalid layers[1] for fused KV materialization: got test_from_modules.FusedQKVAttention "
                      "without k_proj, expected a fused qkv_proj (with q_size and kv_size) or k_proj and v_proj."),
    "no-q-size": (lambda emb: [_without(FusedQKVAttention(emb), "q_size")],
                  "Invalid layers[0] for fused KV materialization: got test_from_modules.FusedQKVAttention without "
                  "q_size, expected a fused qkv_proj (with q_size and kv_size) or k_proj and v_proj: the rows of the "
                  "fused projection."),
    "no-k-norm-epsilon": (lambda emb: [FusedQKVAttention(emb, eps_name="epsilon")],
                          "Invalid layers[0] for fused KV materialization: got test_from_modules.FusedQKVAttention "
                          "without k_norm.variance_epsilon or k_norm.eps, expected the K-norm's epsilon."),
    "no-head-dim": (lambda emb: [FusedQKVAttention(emb), FusedQKVAttention(emb),
                                 _without(FusedQKVAttention(emb), "head_dim")],
                    "Invalid layers[2] for fused KV materialization: got test_from_modules.FusedQKVAttention without "
                    "head_dim or head_size, expected the attention's head size."),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_module_that_cannot_be_read_is_refused_naming_the_attribute_and_the_layer(name):
    modules, message = REFUSED[name]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fusedkv_torch.FusedKVMaterializer.from_modules(modules(RotaryEmbedding(16, True)))


def test_a_rotary_embedding_it_cannot_read_is_refused():
    rotary_emb = RotaryEmbedding(16, True)
    del rotary_emb.is_neox_style
    with pytest.raises(ValueError, match=r"^Invalid rotary_emb for fused KV materialization: got "
                                         r"test_from_modules\.RotaryEmbedding with a cos_sin_cache and without "
                                         r"is_neox_style, expected both to read the table\.$"):
        fusedkv_torch.FusedKVMaterializer.from_modules([FusedQKVAttention(rotary_emb)])
    attention = _without(FusedQKVAttention(rotary_emb), "rotary_emb")
    with pytest.raises(ValueError, match=r"^Invalid rotary_emb for fused KV materialization: got None and "
                                         r"layers\[0\] \(test_from_modules\.FusedQKVAttention\) has no rotary_emb, "
                                         r"expected the model's rotary embedding\.$"):
        fusedkv_torch.FusedKVMaterializer.from_modules([attention])


def test_a_quantized_module_is_refused_naming_its_weight():
    attention = FusedQKVAttention(RotaryEmbedding(16, True))
    attention.qkv_proj.weight.data = attention.qkv_proj.weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^Invalid layers\[0\]\.qkv_proj\.weight for fused KV materialization: got "
                                         r"dtype float8_e4m3fn, expected an unquantized projection"):
        fusedkv_torch.FusedKVMaterializer.from_modules([attention])
