"""FP8 drafter weights (float8_e4m3fn with a ``weight_scale`` per tensor or per output row)
in both materializers, against the NumPy reference.

Without FP8 tensor cores (a CPU, interpret mode) the GEMM is dequantize-then-GEMM, held to
the reference's own dequantize-then-GEMM. The tensor cores' GEMM (activations quantized per
token) is held to its emulation in NumPy (``fp8_activations=True``) and, under
FP8_GEMM_TOLERANCE, to dequantize-then-GEMM: on a GPU with FP8 tensor cores as it runs there
(tests named ``..._on_fp8_tensor_cores``, skipped elsewhere), and on the CPU with the same
formula forced (torch's ``_scaled_mm`` and jax's dot of FP8 operands both run there).
"""

import dataclasses

import numpy as np
import pytest

from backends import host
from interop.core.arrays import numpy_dtype
from interop.core.materializer import (LayerKV, MaterializerConfig, dequantized_weight, head_parallel_layers,
                                      projection_reference, quantize_per_token, validate_layers,
                                      weight_scale_rows)
from interop.core.spec import FusedKVConfig
from interop.testing import (END_TO_END_TOLERANCE, FP8_GEMM_TOLERANCE, TOLERANCES, MaterializerCase,
                             assert_bit_exact, assert_close, fp8_layers, random_case)

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

OP = FusedKVConfig(num_kv_heads=2, head_dim=16, rotary_dim=16)
ROWS = 2 * OP.kv_size
# name: the shape of each layer's weight_scale, as checkpoints of each kind store it.
GRANULARITIES = {"per-tensor-scalar": (), "per-tensor": (1,), "per-row": (ROWS,), "per-row-column": (ROWS, 1)}
FIELDS = ("kv_proj_weight", "kv_proj_bias", "k_norm_weight", "weight_scale")


def _case(granularity: str = "per-row-column", *, hidden: int = 64, kv_bias: bool = False) -> MaterializerCase:
    case = random_case(OP, n_layers=2, hidden=hidden, total_ctx=5, max_position=256, kv_bias=kv_bias, seed=3)
    shape = GRANULARITIES[granularity]
    layers = tuple(dataclasses.replace(layer, weight_scale=layer.weight_scale.reshape(shape))
                   for layer in fp8_layers(case.layers, per_row=len(shape) > 0 and shape[0] == ROWS))
    return MaterializerCase(layers, case.ctx_hidden, case.positions)


def _on(backend, layer: LayerKV) -> LayerKV:
    return dataclasses.replace(layer, **{field: None if getattr(layer, field) is None else
                                         backend.put(getattr(layer, field)) for field in FIELDS})


def _has_fp8_tensor_cores(backend) -> bool:
    """Whether the backend's device is a CUDA GPU of compute capability 8.9 or later."""
    if backend.name == "torch":
        torch = backend.torch
        return backend.device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    return backend.device.platform == "gpu" and float(getattr(backend.device, "compute_capability", 0)) >= 8.9


def _force_the_fp8_gemm(backend, monkeypatch) -> None:
    """Run the FP8 tensor cores' formula where the device has none (the CPU runs it too)."""
    if backend.name == "torch":
        import fusedkv_torch.materializer as module

        monkeypatch.setattr(module, "_has_fp8_tensor_cores", lambda device: True)
    else:
        import fusedkv_jax.materializer as module

        monkeypatch.setattr(module, "_fp8_gemm", lambda config, ctx_hidden: config.fp8_gemm_shapes)


def _assert_dequantize_then_gemm(backend, case: MaterializerCase) -> None:
    materializer = backend.kernel.FusedKVMaterializer([_on(backend, layer) for layer in case.layers])
    ctx_hidden, positions = backend.put(case.ctx_hidden), backend.put(case.positions)
    kv = host(materializer.project(ctx_hidden))
    # One rounding of the fp32 GEMM of the dequantized weights.
    assert_close(kv, projection_reference(case.layers, case.ctx_hidden).astype(kv.dtype), name="kv",
                 tolerance=TOLERANCES["bfloat16"])
    k, v = materializer.materialize(ctx_hidden, positions)
    k_reference, v_reference = case.op_reference(kv)
    assert_close(k, k_reference)
    assert_bit_exact(v, v_reference)
    k_expected, v_expected = case.end_to_end_reference()
    assert_close(k, k_expected, tolerance=END_TO_END_TOLERANCE)
    assert_close(v, v_expected, name="v", tolerance=END_TO_END_TOLERANCE)


def _assert_within_fp8_accumulation(kv, emulated, case: MaterializerCase) -> None:
    """``kv`` from the FP8 GEMM against its fp64 emulation: within one bf16 rounding plus an
    accumulation error of 2**-10 of the sum of the products' magnitudes. FP8 tensor cores add
    in fewer bits than fp32 (about 14 on Hopper, as the DeepSeek-V3 report measured), so a
    result that cancels may be off by many of its own ulps, never by a wrong scale's error."""
    codes, scale = quantize_per_token(case.ctx_hidden.astype(numpy_dtype("bfloat16")).astype(np.float32))
    magnitude = np.stack([np.abs(codes.astype(np.float64)) @ np.abs(host(layer.kv_proj_weight).astype(np.float64)).T
                          * scale * weight_scale_rows(layer) for layer in case.layers], axis=1)
    error = np.abs(kv.astype(np.float64) - emulated)
    bound = 2.0 ** -8 * np.abs(emulated) + 2.0 ** -10 * magnitude
    assert (error <= bound).all(), (f"kv: {(error > bound).sum()} of {error.size} elements beyond the FP8 GEMM's "
                                    f"bound; worst excess {(error - bound).max():.3g}")


def _assert_fp8_gemm(backend, case: MaterializerCase) -> None:
    """The tensor cores' GEMM: its emulation within one rounding, dequantize-then-GEMM within
    FP8_GEMM_TOLERANCE; the op on its output as on any kv."""
    materializer = backend.kernel.FusedKVMaterializer([_on(backend, layer) for layer in case.layers])
    ctx_hidden, positions = backend.put(case.ctx_hidden), backend.put(case.positions)
    kv = host(materializer.project(ctx_hidden))
    emulated = projection_reference(case.layers, case.ctx_hidden, fp8_activations=True)
    _assert_within_fp8_accumulation(kv, emulated, case)
    k, v = materializer.materialize(ctx_hidden, positions)
    k_reference, v_reference = case.op_reference(kv)
    assert_close(k, k_reference)
    assert_bit_exact(v, v_reference)
    k_dequantized, v_dequantized = case.end_to_end_reference()
    assert_close(k, k_dequantized, tolerance=FP8_GEMM_TOLERANCE)
    assert_close(v, v_dequantized, name="v", tolerance=FP8_GEMM_TOLERANCE)
    # And the quantization is not a no-op: the two references differ where the GEMM did.
    assert not np.array_equal(emulated, projection_reference(case.layers, case.ctx_hidden))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_weights_without_fp8_tensor_cores_run_dequantize_then_gemm(backend, granularity):
    if _has_fp8_tensor_cores(backend):
        pytest.skip("this device has FP8 tensor cores: test_fp8_weights_on_fp8_tensor_cores runs there")
    _assert_dequantize_then_gemm(backend, _case(granularity))


@pytest.mark.parametrize("granularity", ("per-tensor", "per-row"))
def test_fp8_weights_on_fp8_tensor_cores_match_dequantize_then_gemm_in_tolerance(backend, granularity):
    if not _has_fp8_tensor_cores(backend):
        pytest.skip("needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or later)")
    _assert_fp8_gemm(backend, _case(granularity, hidden=128, kv_bias=True))


@pytest.mark.parametrize("granularity", ("per-tensor-scalar", "per-row"))
def test_the_fp8_tensor_core_formula_forced_on_this_device_matches_its_emulation(backend, granularity, monkeypatch):
    _force_the_fp8_gemm(backend, monkeypatch)
    _assert_fp8_gemm(backend, _case(granularity, kv_bias=True))


def test_fp8_weights_with_a_bias_add_it_in_the_gemm(backend):
    if _has_fp8_tensor_cores(backend):
        pytest.skip("this device has FP8 tensor cores: test_fp8_weights_on_fp8_tensor_cores runs there")
    _assert_dequantize_then_gemm(backend, _case("per-row", kv_bias=True))


def test_sizes_fp8_tensor_cores_do_not_take_run_dequantize_then_gemm(backend, monkeypatch):
    _force_the_fp8_gemm(backend, monkeypatch)
    case = _case("per-row", hidden=40)  # not a multiple of 16
    assert not validate_layers(case.layers).fp8_gemm_shapes
    _assert_dequantize_then_gemm(backend, case)


def test_fp8_weights_give_bfloat16_results(backend):
    case = _case()
    materializer = backend.kernel.FusedKVMaterializer([_on(backend, layer) for layer in case.layers])
    config = materializer.config
    assert (config.weight_dtype, config.kv_dtype, config.fp8_weights) == ("float8_e4m3fn", "bfloat16", True)
    k, v = materializer.materialize(backend.put(case.ctx_hidden), backend.put(case.positions))
    assert host(k).dtype == host(v).dtype == numpy_dtype("bfloat16")


def test_an_unquantized_config_keeps_its_weights_dtype_for_kv():
    config = MaterializerConfig(OP, 2, 64, "float16", 256)
    assert (config.kv_dtype, config.fp8_weights, config.fp8_gemm_shapes) == ("float16", False, False)


REFUSED = {
    # name: (change to layer 1 (a function of the layer), message).
    "fp8-without-scale": (lambda layer: dataclasses.replace(layer, weight_scale=None),
                          "Invalid fused KV materializer layer 1: weight_scale got none, expected a weight_scale for "
                          "float8_e4m3fn weights."),
    "an-unquantized-layer-among-fp8-layers": (
        lambda layer: dataclasses.replace(layer, kv_proj_weight=layer.kv_proj_weight.astype(np.float32)),
        "Invalid fused KV materializer layer 1: kv_proj_weight dtype got float32, expected float8_e4m3fn as in layer "
        "0."),
    "scale-shape": (lambda layer: dataclasses.replace(layer, weight_scale=np.ones(3, np.float32)),
                    "Invalid fused KV materializer layer 1: weight_scale shape got (3,), expected () or (1,) (per "
                    "tensor), or (64,) or (64, 1) (per output row)."),
    "integer-scale": (lambda layer: dataclasses.replace(layer, weight_scale=np.ones(1, np.int32)),
                      "Invalid fused KV materializer layer 1: weight_scale dtype got int32, expected one of "
                      "('bfloat16', 'float16', 'float32', 'float64')."),
}


@pytest.mark.parametrize("name", REFUSED)
def test_an_fp8_layer_that_cannot_be_served_is_refused_naming_it(backend, name):
    change, message = REFUSED[name]
    layers = list(_case().layers)
    layers[1] = change(layers[1])
    with pytest.raises(ValueError, match=backend.error_pattern(message)):
        backend.kernel.FusedKVMaterializer([_on(backend, layer) for layer in layers])


def test_a_bias_of_fp8_weights_is_of_the_gemms_output_dtype():
    layers = [dataclasses.replace(layer, kv_proj_bias=np.zeros(ROWS, np.float32)) for layer in _case().layers]
    with pytest.raises(ValueError, match="^Invalid fused KV materializer layer 0: kv_proj_bias dtype got float32, "
                                         "expected bfloat16, the GEMM's output dtype for float8_e4m3fn weights.$"):
        validate_layers(layers)


def test_a_weight_scale_beside_unquantized_weights_is_refused():
    layers = [dataclasses.replace(layer, weight_scale=np.ones(1, np.float32))
              for layer in random_case(OP, n_layers=1, hidden=64, total_ctx=1).layers]
    with pytest.raises(ValueError, match="^Invalid fused KV materializer layer 0: weight_scale got an array, expected "
                                         "none for bfloat16 weights.$"):
        validate_layers(layers)


@pytest.mark.parametrize("dtype", ("int8", "uint8"))
def test_weights_of_another_quantized_format_are_refused_naming_it(backend, dtype):
    layers = [dataclasses.replace(layer, kv_proj_weight=np.zeros(layer.kv_proj_weight.shape, dtype), weight_scale=None)
              for layer in _case().layers]
    message = (f"Invalid layers[0].kv_proj_weight dtype for fused KV materialization: got {dtype}, expected one of "
               "('bfloat16', 'float16', 'float32', 'float8_e4m3fn') "
               f"({dtype} weights are not supported: quantized weights must be float8_e4m3fn with a weight_scale).")
    with pytest.raises(ValueError, match=backend.error_pattern(message)):
        backend.kernel.FusedKVMaterializer([_on(backend, layer) for layer in layers])


def test_a_weight_scale_of_another_framework_is_refused_naming_the_field():
    pytest.importorskip("torch")
    import fusedkv_torch
    from interop.exchange import to_torch

    layers = [dataclasses.replace(layer, kv_proj_weight=to_torch(layer.kv_proj_weight),
                                  k_norm_weight=to_torch(layer.k_norm_weight)) for layer in _case().layers]
    with pytest.raises(TypeError, match=r"^Invalid layers\[0\]\.weight_scale for fused KV materialization: got "
                                        r"numpy\.ndarray, expected a torch\.Tensor"):
        fusedkv_torch.FusedKVMaterializer(layers)


@pytest.mark.parametrize("granularity", ("per-row", "per-row-column", "per-tensor"))
def test_head_parallel_shares_take_the_rows_of_per_row_scales_and_keep_per_tensor_ones(granularity):
    layers = _case(granularity).layers
    for rank in range(2):
        rows = np.r_[rank * 16:(rank + 1) * 16, 32 + rank * 16:32 + (rank + 1) * 16]  # head rank's K, then V rows
        for layer, share in zip(layers, head_parallel_layers(layers, rank, 2)):
            assert_bit_exact(share.kv_proj_weight, layer.kv_proj_weight[rows], name="codes")
            dequantized = layer.kv_proj_weight.astype(np.float32) * np.broadcast_to(
                layer.weight_scale.reshape(-1, 1), (ROWS, 1))
            assert_bit_exact(share.kv_proj_weight.astype(np.float32) * share.weight_scale.reshape(-1, 1),
                             dequantized[rows], name=f"dequantized weights of rank {rank}")


def test_fp8_weights_under_autograd_run_dequantize_then_gemm_and_give_the_gradient_a_path():
    torch = pytest.importorskip("torch")
    import fusedkv_torch
    from interop.exchange import to_torch

    device = "cuda" if torch.cuda.is_available() and not fusedkv_torch.kernel._launcher.interpreted else "cpu"

    def put(array):
        return None if array is None else to_torch(array).to(device)

    case = _case("per-row", kv_bias=True)
    materializer = fusedkv_torch.FusedKVMaterializer([dataclasses.replace(
        layer, **{field: put(getattr(layer, field)) for field in FIELDS}) for layer in case.layers])
    ctx_hidden = put(case.ctx_hidden.astype(np.float32)).requires_grad_()
    k, v = materializer.materialize(ctx_hidden, put(case.positions))
    assert k.grad_fn is not None and v.grad_fn is not None
    k_expected, v_expected = case.end_to_end_reference()
    assert_close(k.detach(), k_expected, tolerance=END_TO_END_TOLERANCE)
    assert_close(v.detach(), v_expected, name="v", tolerance=END_TO_END_TOLERANCE)
    v.float().sum().backward()  # d(sum of V)/d(hidden): every layer's dequantized V rows, summed
    v_rows = sum(dequantized_weight(layer)[OP.kv_size:].astype(np.float64).sum(axis=0) for layer in case.layers)
    # The gradient passes the casts of hidden to bf16 and back: it is rounded to bf16, half an ulp.
    np.testing.assert_allclose(ctx_hidden.grad.cpu().numpy(), np.broadcast_to(v_rows, case.ctx_hidden.shape),
                               rtol=2.0 ** -8, atol=1e-6)


def test_jax_fp8_gemm_differentiates_as_dequantize_then_gemm_as_torch_does(monkeypatch):
    # Differentiated, the FP8 tensor cores' formula is replaced by dequantize-then-GEMM, forward
    # and backward (torch's materializer does the same): the quantization has no useful derivative.
    jax = pytest.importorskip("jax")
    import fusedkv_jax
    import fusedkv_jax.materializer as module

    case = _case(kv_bias=True)
    materializer = fusedkv_jax.FusedKVMaterializer(list(case.layers))
    ctx_hidden, positions = jax.numpy.asarray(case.ctx_hidden), jax.numpy.asarray(case.positions)
    probes = [np.random.default_rng(4 + i).standard_normal(OP.output_shape(2, 5)).astype(np.float32)
              for i in range(2)]

    def gradients():
        def loss(ctx_hidden):
            k, v = materializer.materialize(ctx_hidden, positions)
            return (k * probes[0]).sum() + (v * probes[1]).sum(), (k, v)
        return jax.grad(loss, has_aux=True)(ctx_hidden)

    dequantized = gradients()
    monkeypatch.setattr(module, "_fp8_gemm", lambda config, ctx_hidden: config.fp8_gemm_shapes)
    assert module._fp8_gemm(materializer.config, ctx_hidden)  # the tensor cores' formula, undifferentiated
    forced = gradients()
    for got, expected in zip(jax.tree.leaves(forced), jax.tree.leaves(dequantized)):
        assert_bit_exact(got, expected)
    kv_fp8 = host(materializer.project(ctx_hidden))  # undifferentiated, still the FP8 formula
    assert not np.array_equal(kv_fp8, projection_reference(case.layers, case.ctx_hidden).astype(kv_fp8.dtype))


def test_jax_fp8_weights_in_a_jit_ask_no_tracer_for_its_devices(monkeypatch):
    # A tracer asked for its devices raises an error whose message walks the whole program
    # traced so far; in a jit the default backend's device decides instead.
    jax = pytest.importorskip("jax")
    import fusedkv_jax

    def asked(self, *args):
        raise AssertionError("a tracer was asked for its devices")

    monkeypatch.setattr(jax.core.Tracer, "devices", asked)
    case = _case()
    materializer = fusedkv_jax.FusedKVMaterializer(list(case.layers))
    assert materializer.config.fp8_gemm_shapes
    kv = host(jax.jit(materializer.project)(jax.numpy.asarray(case.ctx_hidden)))
    device = jax.devices()[0]
    if device.platform == "gpu" and float(getattr(device, "compute_capability", 0)) >= 8.9:
        # The default device has FP8 tensor cores: the jit runs the FP8 GEMM.
        _assert_within_fp8_accumulation(kv, projection_reference(case.layers, case.ctx_hidden, fp8_activations=True),
                                        case)
    else:
        assert_close(kv, projection_reference(case.layers, case.ctx_hidden).astype(kv.dtype), name="kv",
                     tolerance=TOLERANCES["bfloat16"])
