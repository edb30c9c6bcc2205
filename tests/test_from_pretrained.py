"""``FusedKVMaterializer.from_pretrained`` in both frameworks, on tiny checkpoints written here.

Decoders of the Llama (with llama3 RoPE scaling), Qwen2 (with K/V biases) and Qwen3 (with
a K-norm) families are saved by transformers itself, and a DFlash draft's layout is written
with safetensors; each loaded materializer is held to transformers' own attention modules
(``k_proj``, ``k_norm``, the model's rotary embedding, ``apply_rotary_pos_emb``,
``v_proj``) in fp32, and to the NumPy reference. Checkpoints it cannot serve are refused,
naming the key and the file, before anything reaches a device.
"""

import contextlib
import copy
import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from backends import host  # noqa: E402
from interop.core.arrays import numpy_dtype  # noqa: E402
from interop.core.checkpoint import read_checkpoint_layers  # noqa: E402
from interop.core.materializer import stacked_rope_tables  # noqa: E402
from interop.core.reference import rope_cos_sin_cache  # noqa: E402
from interop.core.rope import rope_frequencies  # noqa: E402
from interop.core.spec import device_name  # noqa: E402
from interop.core.materializer import LayerKV, RopeConfig  # noqa: E402
from interop.testing import (END_TO_END_TOLERANCE, FP8_GEMM_TOLERANCE, TOLERANCES, MaterializerCase,  # noqa: E402
                             assert_bit_exact, assert_close, ulp)

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
            intermediate_size=32, vocab_size=32, max_position_embeddings=4096)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=1024)
# name: (transformers class prefix, config kwargs beyond TINY).
FAMILIES = {
    "qwen3-k-norm": ("Qwen3", dict(rope_theta=1e6)),
    "llama-llama3-rope": ("Llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3)),
    "qwen2-bias": ("Qwen2", dict(rope_theta=1e6)),
}
TOKENS = 6
MAX_POSITION = 1024
ATTENTION = ("k_proj", "v_proj", "k_norm")


def _decoder_checkpoint(directory: pathlib.Path, family: str, **save_options):
    """A random tiny fp32 model of ``family`` saved by transformers; the model."""
    prefix, extra = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**TINY, **copy.deepcopy(extra))
    torch.manual_seed(26)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).float()
    with torch.no_grad():  # norm weights of one and biases of zero would hide one not read
        for layer in model.model.layers:
            attention = layer.self_attn
            if hasattr(attention, "k_norm"):
                attention.k_norm.weight.normal_(1.0, 0.25)
            for projection in (attention.k_proj, attention.v_proj):
                if projection.bias is not None:
                    projection.bias.normal_(0.0, 0.5)
    model.save_pretrained(directory, **save_options)
    return model


def _dflash_checkpoint(directory: pathlib.Path, *, seed: int = 0, tensors: dict | None = None, without=(),
                       **config_changes):
    """A DFlash draft of two layers written with safetensors (bf16), its config beside it;
    the tensors in fp32. ``tensors`` replaces some as written, ``without`` names tensors and
    config keys left out, ``config_changes`` changes the config."""
    rng = np.random.default_rng(seed)
    shapes = {"fc.weight": (64, 128), "hidden_norm.weight": (64,), "norm.weight": (64,)}
    for index in range(2):
        prefix = f"layers.{index}."
        shapes.update({f"{prefix}self_attn.q_proj.weight": (64, 64), f"{prefix}self_attn.k_proj.weight": (32, 64),
                       f"{prefix}self_attn.v_proj.weight": (32, 64), f"{prefix}self_attn.o_proj.weight": (64, 64),
                       f"{prefix}self_attn.q_norm.weight": (16,), f"{prefix}self_attn.k_norm.weight": (16,),
                       f"{prefix}mlp.down_proj.weight": (64, 32)})
    bf16 = numpy_dtype("bfloat16")
    values = {key: (1 + rng.standard_normal(shape) / 4 if key.endswith("norm.weight")
                    else rng.standard_normal(shape) / 8).astype(bf16) for key, shape in shapes.items()}
    values.update(tensors or {})
    values = {key: value for key, value in values.items() if key not in without}
    safetensors_numpy.save_file(values, str(directory / "model.safetensors"))
    config = dict(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=16,
                  dflash_config=dict(mask_token_id=31, target_layer_ids=[1, 3]), hidden_size=64,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                  intermediate_size=32, vocab_size=32, rms_norm_eps=1e-6, max_position_embeddings=4096,
                  rope_theta=1e6, rope_scaling=None, layer_types=["full_attention", "full_attention"],
                  attention_value_scale=[0.61, 0.71])
    config.update(config_changes)
    config = {key: value for key, value in config.items() if key not in without}
    (directory / "config.json").write_text(json.dumps(config))
    return {key: value.astype(np.float32) for key, value in values.items()}


FP8 = numpy_dtype("float8_e4m3fn")
FP8_LAYER_0 = {**{f"layers.0.self_attn.{name}_proj.weight": np.ones((32, 64), FP8) for name in "kv"},
               **{f"layers.0.self_attn.{name}_proj.weight_scale": np.ones((), np.float32) for name in "kv"}}


def compressed_tensors(*, type="float", strategy="channel", activations=None):
    """A compressed-tensors quantization_config of one group, as llm-compressor writes it."""
    activations = activations or dict(num_bits=8, type="float", strategy="token", dynamic=True)
    return dict(quant_method="compressed-tensors", format="float-quantized", ignore=["lm_head"],
                config_groups=dict(group_0=dict(targets=["Linear"], input_activations=activations,
                                                weights=dict(num_bits=8, type=type, strategy=strategy, dynamic=False,
                                                             symmetric=True))))


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((TOKENS, 64), dtype=np.float32),
            rng.integers(0, 512, TOKENS).astype(np.int32))


def _transformers_kv(attentions, rotary_embedding, hidden, positions, value_scales=None):
    """K and V of each attention module as transformers computes them, float64[n_layers, T, H, D],
    and K normalized but not rotated."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    states = torch.from_numpy(hidden)[None]
    cos, sin = rotary_embedding(states, torch.from_numpy(positions.astype(np.int64))[None])
    ks, vs, normed = [], [], []
    with torch.no_grad():
        for index, attention in enumerate(attentions):
            shape = (1, TOKENS, -1, attention.head_dim)
            k = attention.k_proj(states).view(shape)
            if hasattr(attention, "k_norm"):
                k = attention.k_norm(k)
            _, rotated = apply_rotary_pos_emb(k.transpose(1, 2), k.transpose(1, 2), cos, sin)
            v = attention.v_proj(states).view(shape)[0]
            if value_scales is not None:
                v = v * value_scales[index]
            ks.append(rotated[0].transpose(0, 1))
            vs.append(v)
            normed.append(k[0])
    return tuple(np.stack([t.double().numpy() for t in tensors]) for tensors in (ks, vs, normed))


def _assert_k_matches_transformers(k, expected, normed, positions, rope):
    """K within the fp32 tolerance of transformers', plus what its fp32 angles may move it by:
    each angle ``p * inv_freq`` off by up to 10 fp32 ulps (its inv_freq, the product), and
    cos/sin (theirs and our table's rounding) by 8 more, times the two |kn| a rotated dim takes."""
    inv_freq, attention_factor = rope_frequencies(rope.parameters, rope.max_position)
    angle_error = attention_factor * (10 * 2.0**-24 * positions[:, None] * inv_freq + 8 * 2.0**-24)
    half = rope.rotary_dim // 2
    partner = np.concatenate([normed[..., half:], normed[..., :half]], axis=-1)
    slack = (np.abs(normed) + np.abs(partner)) * np.tile(angle_error, 2)[None, :, None, :]
    tolerance = TOLERANCES["float32"]
    error = np.abs(host(k).astype(np.float64) - expected)
    bad = error > slack + tolerance.ulps * ulp(expected, "float32") + tolerance.atol
    assert not bad.any(), f"k: {bad.sum()} elements off transformers' K, worst {error.max():.3g}"


def _framework(backend, name: str):
    """``name``'s dtype of the backend's framework."""
    return getattr(torch if backend.name == "torch" else backend.jax.numpy, name)


def _exact_fp32_dots(backend):
    # XLA may run an fp32 dot on a GPU in TF32; the comparisons here are of fp32 GEMMs.
    return backend.jax.default_matmul_precision("highest") if backend.name == "jax" else contextlib.nullcontext()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_decoder_checkpoint_gives_transformers_k_and_v(backend, family, tmp_path):
    model = _decoder_checkpoint(tmp_path, family)
    hidden, positions = _inputs()
    materializer = backend.kernel.FusedKVMaterializer.from_pretrained(tmp_path, device=backend.device,
                                                                      max_position=MAX_POSITION)
    with _exact_fp32_dots(backend):
        ctx_hidden = backend.put(hidden)
        k, v = materializer.materialize(ctx_hidden, backend.put(positions))
        kv = host(materializer.project(ctx_hidden))
    layers = model.model.layers
    k_expected, v_expected, normed = _transformers_kv([layer.self_attn for layer in layers], model.model.rotary_emb,
                                                      hidden, positions)
    host_layers = read_checkpoint_layers(tmp_path, max_position=MAX_POSITION)
    assert device_name(materializer.kv_proj_weight) == device_name(materializer.cos_sin_cache) == backend.device_name
    assert materializer.config.normed == (family == "qwen3-k-norm")
    assert materializer.config.biased == (family == "qwen2-bias")
    _assert_k_matches_transformers(k, k_expected, normed, positions, host_layers[0].rope)
    assert_close(v, v_expected.astype(np.float32), name="v")
    # And the op's reference on the materializer's own GEMM: K in tolerance, V bit for bit.
    k_reference, v_reference = MaterializerCase(host_layers, hidden, positions).op_reference(kv)
    assert_close(k, k_reference)
    assert_bit_exact(v, v_reference)


def test_layers_picks_the_decoders_layers_in_the_order_given(tmp_path):
    model = _decoder_checkpoint(tmp_path, "qwen2-bias")
    picked = read_checkpoint_layers(tmp_path, layers=[1, 0])
    for layer, index in zip(picked, (1, 0)):
        attention = model.model.layers[index].self_attn
        expected = {"kv_proj_weight": torch.cat([attention.k_proj.weight, attention.v_proj.weight]),
                    "kv_proj_bias": torch.cat([attention.k_proj.bias, attention.v_proj.bias])}
        for field, tensor in expected.items():
            assert_bit_exact(getattr(layer, field), tensor.detach().numpy(), name=f"{field} of layer {index}")


def test_a_sharded_checkpoint_reads_each_tensor_from_its_shard(tmp_path):
    _decoder_checkpoint(tmp_path / "whole", "qwen3-k-norm")
    _decoder_checkpoint(tmp_path / "sharded", "qwen3-k-norm", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for whole, sharded in zip(read_checkpoint_layers(tmp_path / "whole"), read_checkpoint_layers(tmp_path / "sharded")):
        for field in ("kv_proj_weight", "k_norm_weight"):
            assert_bit_exact(getattr(sharded, field), getattr(whole, field), name=field)
        assert sharded.rope == whole.rope and sharded.rope.max_position == TINY["max_position_embeddings"]


def test_a_key_missing_from_a_sharded_checkpoints_index_is_refused_naming_the_index(tmp_path):
    _decoder_checkpoint(tmp_path, "qwen3-k-norm", max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    contents = json.loads(index.read_text())
    del contents["weight_map"]["model.layers.1.self_attn.v_proj.weight"]
    index.write_text(json.dumps(contents))
    with pytest.raises(ValueError) as refused:
        read_checkpoint_layers(tmp_path)
    assert str(refused.value) == (
        f"Invalid tensor 'model.layers.1.self_attn.v_proj.weight' in {index} for fused KV materialization: got no "
        "such tensor, expected one of shape (32, 64) = (num_key_value_heads*head_dim, hidden_size).")


def test_a_dflash_checkpoint_gives_transformers_k_and_scaled_v(backend, tmp_path):
    tensors = _dflash_checkpoint(tmp_path)
    config = transformers.Qwen3Config(**TINY, rope_theta=1e6)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    attentions = [Qwen3Attention(config, layer_idx=index).float() for index in range(2)]
    for index, attention in enumerate(attentions):  # fed the checkpoint's weights
        for name in ATTENTION:
            getattr(attention, name).weight.data = torch.from_numpy(tensors[f"layers.{index}.self_attn.{name}.weight"])
    hidden, positions = _inputs(seed=1)
    k_expected, v_expected, normed = _transformers_kv(attentions, Qwen3RotaryEmbedding(config), hidden, positions,
                                                      value_scales=(0.61, 0.71))
    fp32 = backend.kernel.FusedKVMaterializer.from_pretrained(tmp_path, dtype=_framework(backend, "float32"),
                                                              device=backend.device, max_position=MAX_POSITION)
    with _exact_fp32_dots(backend):
        k, v = fp32.materialize(backend.put(hidden), backend.put(positions))
    assert fp32.config.v_multiplied and fp32.config.normed and not fp32.config.biased
    _assert_k_matches_transformers(k, k_expected, normed, positions, read_checkpoint_layers(tmp_path)[0].rope)
    assert_close(v, v_expected.astype(np.float32), name="v")
    # The checkpoint's own dtype by default, against the fp32 NumPy path.
    bf16 = backend.kernel.FusedKVMaterializer.from_pretrained(tmp_path, device=backend.device,
                                                              max_position=MAX_POSITION)
    assert bf16.config.weight_dtype == "bfloat16"
    k, v = bf16.materialize(backend.put(hidden), backend.put(positions))
    k_reference, v_reference = MaterializerCase(read_checkpoint_layers(tmp_path, max_position=MAX_POSITION),
                                                hidden, positions).end_to_end_reference()
    assert_close(k, k_reference, tolerance=END_TO_END_TOLERANCE)
    assert_close(v, v_reference, name="v", tolerance=END_TO_END_TOLERANCE)


# name: (quantization_config, the scale tensors' suffix, their shape: None per row, else per tensor).
FP8_CHECKPOINTS = {
    "compressed-tensors-channel": (compressed_tensors(), "weight_scale", None),
    "compressed-tensors-tensor": (compressed_tensors(strategy="tensor", activations=None), "weight_scale", (1,)),
    "fp8-per-tensor": (dict(quant_method="fp8", activation_scheme="dynamic"), "weight_scale", ()),
    "fp8-weight-scale-inv": (dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=None),
                             "weight_scale_inv", ()),
    "fbgemm-fp8": (dict(quant_method="fbgemm_fp8", activation_scale_ub=1200.0), "weight_scale", None),
}


def _fp8_dflash_checkpoint(directory: pathlib.Path, name: str):
    """A DFlash draft whose K/V projections are float8_e4m3fn with the scales of checkpoint kind
    ``name``; the draft's layers as the test wrote them (fp8 codes, fp32 scales per row)."""
    quantization, suffix, scale_shape = FP8_CHECKPOINTS[name]
    rng = np.random.default_rng(7)
    tensors, layers = {}, []
    for index in range(2):
        codes, scales = [], []
        for projection in "kv":
            weight = rng.standard_normal((32, 64)).astype(np.float32) / 8
            amax = np.abs(weight).max(axis=1, keepdims=True) if scale_shape is None else np.abs(weight).max()
            scale = np.asarray(amax / 448, np.float32).reshape((32, 1) if scale_shape is None else scale_shape)
            code = (weight / scale.reshape(-1, 1)).astype(FP8)
            prefix = f"layers.{index}.self_attn.{projection}_proj"
            tensors.update({f"{prefix}.weight": code, f"{prefix}.{suffix}": scale})
            codes.append(code)
            scales.append(np.broadcast_to(scale.reshape(-1), (32,)))
        layers.append((np.concatenate(codes), np.concatenate(scales)))
    written = _dflash_checkpoint(directory, tensors=tensors, quantization_config=quantization)
    rope = RopeConfig(16, MAX_POSITION, 1e6)
    return tuple(LayerKV(weight, written[f"layers.{index}.self_attn.k_norm.weight"], 1e-6, 2, 16, rope, value_scale,
                         weight_scale=scale)
                 for index, ((weight, scale), value_scale) in enumerate(zip(layers, (0.61, 0.71))))


@pytest.mark.parametrize("name", FP8_CHECKPOINTS)
def test_an_fp8_checkpoint_gives_the_dequantize_then_gemm_reference(backend, name, tmp_path):
    layers = _fp8_dflash_checkpoint(tmp_path, name)
    hidden, positions = _inputs(seed=2)
    materializer = backend.kernel.FusedKVMaterializer.from_pretrained(tmp_path, device=backend.device,
                                                                      max_position=MAX_POSITION)
    assert (materializer.config.weight_dtype, materializer.config.kv_dtype) == ("float8_e4m3fn", "bfloat16")
    k, v = materializer.materialize(backend.put(hidden), backend.put(positions))
    # FP8 tensor cores (a GPU's) quantize the activations; elsewhere it is dequantize-then-GEMM.
    on_gpu = device_name(materializer.kv_proj_weight).startswith("cuda")
    tolerance = FP8_GEMM_TOLERANCE if on_gpu else END_TO_END_TOLERANCE
    k_expected, v_expected = MaterializerCase(layers, hidden, positions).end_to_end_reference()
    assert_close(k, k_expected, tolerance=tolerance)
    assert_close(v, v_expected, name="v", tolerance=tolerance)


def test_an_fp8_checkpoint_read_as_another_dtype_is_dequantized(tmp_path):
    layers = _fp8_dflash_checkpoint(tmp_path, "compressed-tensors-channel")
    read = read_checkpoint_layers(tmp_path, dtype="float32")
    for expected, layer in zip(layers, read):
        assert layer.weight_scale is None
        dequantized = expected.kv_proj_weight.astype(np.float32) * expected.weight_scale[:, None]
        assert_bit_exact(layer.kv_proj_weight, dequantized, name="dequantized weight")


def test_only_the_k_v_projections_biases_and_k_norms_are_read(tmp_path, monkeypatch):
    import safetensors

    _dflash_checkpoint(tmp_path)
    read = []
    opened = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = opened(*args, **kwargs)

        def __enter__(self):
            self.handle = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def get_tensor(self, key):
            read.append(key)
            return self.handle.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    read_checkpoint_layers(tmp_path)
    assert sorted(read) == sorted(f"layers.{index}.self_attn.{name}.weight" for index in range(2) for name in ATTENTION)


def test_layers_of_two_rope_types_get_a_table_each_and_transformers_k_per_type(backend, tmp_path):
    by_type = dict(full_attention=dict(rope_type="default", rope_theta=1e6),
                   sliding_attention=dict(rope_type="default", rope_theta=1e4))
    tensors = _dflash_checkpoint(tmp_path, rope_theta=None, rope_parameters=by_type,
                                 layer_types=["full_attention", "sliding_attention"])
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    hidden, positions = _inputs(seed=2)
    expected = []
    for index, theta in enumerate((1e6, 1e4)):  # each layer as transformers rotates its layer type
        config = transformers.Qwen3Config(**TINY, rope_theta=theta)
        attention = Qwen3Attention(config, layer_idx=index).float()
        for name in ATTENTION:
            getattr(attention, name).weight.data = torch.from_numpy(tensors[f"layers.{index}.self_attn.{name}.weight"])
        k_layer, v_layer, normed_layer = _transformers_kv([attention], Qwen3RotaryEmbedding(config), hidden,
                                                          positions, value_scales=((0.61, 0.71)[index],))
        expected.append((k_layer, v_layer, normed_layer))
    materializer = backend.kernel.FusedKVMaterializer.from_pretrained(
        tmp_path, dtype=_framework(backend, "float32"), device=backend.device, max_position=MAX_POSITION)
    assert host(materializer.layer_rope_table).tolist() == [0, 1]
    assert tuple(host(materializer.cos_sin_cache).shape) == (2, MAX_POSITION, 16)
    with _exact_fp32_dots(backend):
        k, v = materializer.materialize(backend.put(hidden), backend.put(positions))
    ropes = [layer.rope for layer in read_checkpoint_layers(tmp_path, max_position=MAX_POSITION)]
    for index, (k_layer, v_layer, normed_layer) in enumerate(expected):
        _assert_k_matches_transformers(host(k)[index:index + 1], k_layer, normed_layer, positions, ropes[index])
        assert_close(host(v)[index:index + 1], v_layer.astype(np.float32), name="v")


def test_a_sliding_window_rope_base_applies_to_the_sliding_layers(tmp_path):
    _dflash_checkpoint(tmp_path, swa_rope_theta=1e4, layer_types=["sliding_attention", "full_attention"])
    sliding, full = read_checkpoint_layers(tmp_path, max_position=64)
    np.testing.assert_array_equal(sliding.rope.cos_sin_cache(), rope_cos_sin_cache(64, 16, 1e4))
    np.testing.assert_array_equal(full.rope.cos_sin_cache(), rope_cos_sin_cache(64, 16, 1e6))
    tables, layer_rope_table = stacked_rope_tables((sliding, full))
    assert layer_rope_table.tolist() == [0, 1]
    np.testing.assert_array_equal(tables[1], rope_cos_sin_cache(64, 16, 1e6))


BF16 = numpy_dtype("bfloat16")
REFUSED = {
    # name: (DFlash checkpoint changes, from_pretrained options, message with {config} and {file}).
    "missing-tensor": (dict(without=("layers.1.self_attn.v_proj.weight",)), {},
                       "Invalid tensor 'layers.1.self_attn.v_proj.weight' in {file} for fused KV materialization: "
                       "got no such tensor, expected one of shape (32, 64) = (num_key_value_heads*head_dim, "
                       "hidden_size)."),
    "wrong-shape": (dict(tensors={"layers.0.self_attn.k_proj.weight": np.zeros((32, 48), BF16)}), {},
                    "Invalid tensor 'layers.0.self_attn.k_proj.weight' in {file} for fused KV materialization: got "
                    "shape (32, 48), expected (32, 64) = (num_key_value_heads*head_dim, hidden_size) from "
                    "config.json."),
    "k-norm-of-another-head-dim": (
        dict(tensors={"layers.0.self_attn.k_norm.weight": np.ones(32, BF16)}), {},
        "Invalid tensor 'layers.0.self_attn.k_norm.weight' in {file} for fused KV materialization: got shape "
        "(32,), expected (16,) = (head_dim,) from config.json."),
    "fp8-k-beside-bf16-v": (dict(tensors={"layers.0.self_attn.k_proj.weight": np.zeros((32, 64), FP8)}), {},
                            "Invalid tensor 'layers.0.self_attn.v_proj.weight' in {file} for fused KV "
                            "materialization: got dtype BF16, expected F8_E4M3 as 'layers.0.self_attn.k_proj.weight' "
                            "(K and V are one GEMM's weight)."),
    "fp8-without-scale": (dict(tensors={f"layers.0.self_attn.{name}_proj.weight": np.zeros((32, 64), FP8)
                                        for name in "kv"}), {},
                          "Invalid tensor 'layers.0.self_attn.k_proj.weight_scale' in {file} for fused KV "
                          "materialization: got no such tensor (nor 'layers.0.self_attn.k_proj.weight_scale_inv'), "
                          "expected the scale of the float8_e4m3fn 'layers.0.self_attn.k_proj.weight'."),
    "fp8-scale-of-another-shape": (
        dict(tensors={**FP8_LAYER_0, "layers.0.self_attn.v_proj.weight_scale": np.ones((2, 64), np.float32)}), {},
        "Invalid tensor 'layers.0.self_attn.v_proj.weight_scale' in {file} for fused KV materialization: got shape "
        "(2, 64), expected () or (1,) (per tensor), or (32,) or (32, 1) (per output row)."),
    "fp8-static-input-scale": (
        dict(tensors={**FP8_LAYER_0, "layers.0.self_attn.k_proj.input_scale": np.ones((), np.float32)}), {},
        "Invalid tensor 'layers.0.self_attn.k_proj.input_scale' in {file} for fused KV materialization: got a static "
        "activation scale, expected none (FP8 weights run with each token's activations quantized when it is "
        "computed)."),
    "integer-weights": (dict(tensors={"layers.0.self_attn.k_proj.weight": np.zeros((32, 64), np.int8)}), {},
                        "Invalid tensor 'layers.0.self_attn.k_proj.weight' in {file} for fused KV materialization: "
                        "got dtype I8, expected one of ('BF16', 'F16', 'F32', 'F8_E4M3')."),
    "fp8-block-wise-scales": (dict(quantization_config=dict(quant_method="fp8", weight_block_size=[128, 128])), {},
                              "Invalid config['quantization_config'] in {config} for fused KV materialization: got "
                              "weight_block_size [128, 128] (block-wise FP8 scales), expected None: FP8 weights with "
                              "a scale per tensor or per output row."),
    "fp8-static-activations": (dict(quantization_config=dict(quant_method="fp8", activation_scheme="static")), {},
                               "Invalid config['quantization_config'] in {config} for fused KV materialization: got "
                               "activation_scheme 'static' (static activation scales, input_scale), expected dynamic "
                               "activations: FP8 weights run with each token's activations quantized when it is "
                               "computed."),
    "gptq": (dict(quantization_config=dict(quant_method="gptq", bits=4, group_size=128)), {},
             "Invalid config['quantization_config'] in {config} for fused KV materialization: got quant_method 'gptq', "
             "expected unquantized weights, or FP8 weights of a quant_method in ('fp8', 'fbgemm_fp8', "
             "'compressed-tensors') (other quantization formats are not supported)."),
    "compressed-tensors-nvfp4": (dict(quantization_config=dict(quant_method="compressed-tensors",
                                                               format="nvfp4-pack-quantized")), {},
                                 "Invalid config['quantization_config'] in {config} for fused KV materialization: got "
                                 "compressed-tensors format 'nvfp4-pack-quantized', expected one of "
                                 "('float-quantized', 'naive-quantized'), float8 weights stored as they are."),
    "compressed-tensors-int8": (dict(quantization_config=compressed_tensors(type="int")), {},
                                "Invalid config['quantization_config'] in {config} for fused KV materialization: got "
                                "config_groups['group_0'] weights of type 'int', 8 bits, strategy 'channel', expected "
                                "float weights of 8 bits, strategy 'tensor' or 'channel'."),
    "compressed-tensors-block": (dict(quantization_config=compressed_tensors(strategy="block")), {},
                                 "Invalid config['quantization_config'] in {config} for fused KV materialization: got "
                                 "config_groups['group_0'] weights of type 'float', 8 bits, strategy 'block', "
                                 "expected float weights of 8 bits, strategy 'tensor' or 'channel'."),
    "compressed-tensors-static-activations": (
        dict(quantization_config=compressed_tensors(activations=dict(num_bits=8, type="float", strategy="tensor",
                                                                     dynamic=False))), {},
        "Invalid config['quantization_config'] in {config} for fused KV materialization: got config_groups['group_0'] "
        "input_activations with dynamic False (static activation scales, input_scale), expected dynamic activations: "
        "FP8 weights run with each token's activations quantized when it is computed."),
    "dynamic-rope": (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), {},
                     "Invalid rope_type in {config} for fused KV materialization: got 'dynamic', expected one of "
                     "('default', 'linear', 'yarn', 'llama3', 'longrope') (dynamic NTK scaling depends on the "
                     "sequence length at run time, so no table built ahead of time holds it)."),
    "unknown-family": (dict(without=("dflash_config",), model_type="gemma3"), {},
                       "Invalid config['model_type'] in {config} for fused KV materialization: got 'gemma3', "
                       "expected one of ('llama', 'qwen2', 'qwen3') or a DFlash draft's config (with dflash_config)."),
    "layer-out-of-range": (dict(), dict(layers=[0, 2]),
                           "Invalid layers[1] for fused KV materialization: got 2, expected an int in [0, 2) "
                           "(config['num_hidden_layers'] is 2)."),
    "int-dtype": (dict(), dict(dtype="int32"),
                  "Invalid dtype for fused KV materialization: got int32, expected one of ('bfloat16', "
                  "'float16', 'float32') (or None: the checkpoint's)."),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_checkpoint_that_cannot_be_served_is_refused_naming_the_key_and_the_file(backend, name, tmp_path):
    changes, options, message = REFUSED[name]
    _dflash_checkpoint(tmp_path, **changes)
    message = message.format(config=tmp_path / "config.json", file=tmp_path / "model.safetensors")
    with pytest.raises((ValueError, TypeError), match=backend.error_pattern(message)):
        backend.kernel.FusedKVMaterializer.from_pretrained(tmp_path, device=backend.device, **options)


def test_a_directory_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match=f"^Invalid path for fused KV materialization: got '{tmp_path}', which holds "
                                         "no config.json, expected a local checkpoint directory with config.json "
                                         r"and \*.safetensors.$"):
        read_checkpoint_layers(tmp_path)


def test_reading_a_checkpoint_without_safetensors_says_what_to_install(tmp_path, monkeypatch):
    import sys

    _dflash_checkpoint(tmp_path)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"^Reading a checkpoint needs the safetensors package \(pip install "
                                          r"safetensors\).$"):
        read_checkpoint_layers(tmp_path)
