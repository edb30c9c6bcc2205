"""The torch op's backward (the Triton backward kernel behind torch.autograd) against the
NumPy reference backward: eagerly, under gradcheck, opcheck and torch.compile, and through
the materializer."""

import re

import numpy as np
import pytest
import torch

import fusedkv_torch
from fusedkv_torch.backward import backward_tile
from interop.core.arrays import as_numpy
from interop.core.materializer import LayerKV, RopeConfig
from interop.core.reference_backward import fused_kv_norm_rope_backward_reference
from interop.core.spec import FusedKVConfig
from interop.exchange import to_torch
from interop.testing import assert_bit_exact, random_inputs
from backward_cases import LAYER_ROPE_TABLES, MAX_POSITION, assert_grad_close, edge_case, with_per_layer_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(config, *, dtype="float32", n_layers=2, total_ctx=3, seed=0, weight_dtype="float32"):
    host = random_inputs(config, n_layers=n_layers, total_ctx=total_ctx, dtype=dtype, max_position=MAX_POSITION,
                         seed=seed, weight_dtype=weight_dtype)
    rng = np.random.default_rng(seed + 1)
    shape = config.output_shape(n_layers, total_ctx)
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    multiplier = rng.uniform(0.5, 2.0, size=n_layers).astype(np.float32)
    return list(host.arrays()), grads, multiplier


def _static(config):
    return dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, rotary_dim=config.rotary_dim,
                rope_style=config.rope_style)


def _torch_grads(config, arrays, grads, multiplier, *, normed=True, layer_rope_table=None):
    """``(grad_kv, grad_k_norm_weight, grad_v_multiplier)`` of the op through torch.autograd."""
    kv, weight, eps, cache, positions = (to_torch(a).to(DEVICE) for a in arrays)
    if not normed:
        weight = eps = None
    leaves = [kv.requires_grad_(), None if weight is None else weight.requires_grad_(),
              None if multiplier is None else torch.tensor(multiplier, device=DEVICE).requires_grad_()]
    tables = {} if layer_rope_table is None else dict(layer_rope_table=torch.tensor(layer_rope_table))
    k, v = fusedkv_torch.fused_kv_norm_rope(kv, weight, eps, cache, positions, **_static(config),
                                            v_multiplier=leaves[2], **tables)
    assert k.grad_fn is not None and v.grad_fn is not None
    given = [torch.tensor(g, device=DEVICE).to(kv.dtype) for g in grads]
    wanted = [leaf for leaf in leaves if leaf is not None]
    got = iter(torch.autograd.grad((k, v), wanted, given))
    return [None if leaf is None else next(got) for leaf in leaves], [as_numpy(g) for g in given]


def _reference(config, arrays, grads, multiplier, *, normed=True, layer_rope_table=None):
    kv, weight, eps, cache, positions = arrays
    if not normed:
        weight = eps = None
    return fused_kv_norm_rope_backward_reference(kv, weight, eps, cache, positions, *grads, **_static(config),
                                                 v_multiplier=multiplier, layer_rope_table=layer_rope_table)


FORMS = [
    # (config, normed, multiplied)
    (FusedKVConfig(2, 16, 16, "neox"), True, False),
    (FusedKVConfig(2, 16, 16, "gptj"), True, True),
    (FusedKVConfig(1, 16, 8, "neox"), True, True),
    (FusedKVConfig(2, 12, 4, "gptj"), False, True),
    (FusedKVConfig(2, 16, 8, "neox"), False, False),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("config, normed, multiplied", FORMS, ids=lambda f: str(f))
def test_torch_gradients_match_the_reference_backward(config, normed, multiplied, dtype):
    arrays, grads, multiplier = _inputs(config, dtype=dtype)
    multiplier = multiplier if multiplied else None
    got, given = _torch_grads(config, arrays, grads, multiplier, normed=normed)
    expected = _reference(config, arrays, given, multiplier, normed=normed)
    assert_grad_close(got[0], expected[0], dtype, "grad_kv")
    assert got[0].dtype == to_torch(arrays[0]).dtype
    if not multiplied:  # V's gradient is the incoming one, bit for bit
        assert_bit_exact(got[0][:, :, config.kv_size:].reshape(3, 2, -1, config.head_dim).transpose(0, 1),
                         given[1])
    for name, index in (("grad_k_norm_weight", 1), ("grad_v_multiplier", 2)):
        if expected[index] is None:
            assert got[index] is None, name
        else:
            assert_grad_close(got[index], expected[index], "float32", name)


def test_torch_weight_gradient_has_the_weights_dtype():
    config = FusedKVConfig(2, 16, 16, "neox")
    arrays, grads, _ = _inputs(config, weight_dtype="bfloat16")
    got, given = _torch_grads(config, arrays, grads, None)
    assert got[1].dtype == torch.bfloat16
    assert_grad_close(got[1], _reference(config, arrays, given, None)[1], "bfloat16", "grad_k_norm_weight")


@pytest.mark.parametrize("kind", ["position outside the table", "head without a scale", "nan head", "inf head",
                                  "overflowing head"])
def test_torch_gradients_take_the_references_edge_values(kind):
    config = FusedKVConfig(2, 16, 16, "gptj")
    arrays, grads, multiplier = _inputs(config, seed=5)
    arrays = edge_case(kind, arrays)
    got, given = _torch_grads(config, arrays, grads, multiplier)
    expected = _reference(config, arrays, given, multiplier)
    for name, got_grad, expected_grad in zip(("grad_kv", "grad_k_norm_weight", "grad_v_multiplier"), got, expected):
        assert_grad_close(got_grad, expected_grad, "float32", name)


def _op_leaves(config, seed=9, total_ctx=2):
    arrays, _, multiplier = _inputs(config, n_layers=1, total_ctx=total_ctx, seed=seed)
    kv, weight, eps, cache, positions = (to_torch(a).to(DEVICE) for a in arrays)
    return kv, weight, eps, cache, positions, torch.tensor(multiplier, device=DEVICE)


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")  # fp32 on purpose: the kernel has no fp64
@pytest.mark.parametrize("config", [FusedKVConfig(1, 8, 8, "neox"), FusedKVConfig(2, 8, 4, "gptj")], ids=str)
def test_torch_op_passes_gradcheck_in_fp32(config):
    kv, weight, eps, cache, positions, multiplier = _op_leaves(config)

    def op(kv, weight, multiplier):
        return fusedkv_torch.fused_kv_norm_rope(kv, weight, eps, cache, positions, **_static(config),
                                                v_multiplier=multiplier)

    # fp32 finite differences: steps of 1e-3 keep the rounding noise below the tolerance.
    assert torch.autograd.gradcheck(op, (kv.requires_grad_(), weight.requires_grad_(), multiplier.requires_grad_()),
                                    eps=1e-3, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("multiplied, tables", [(False, False), (True, False), (True, True)],
                         ids=["copied-v", "v-multiplier", "v-multiplier-per-layer-tables"])
def test_differentiable_op_passes_opcheck_with_its_autograd_checks(multiplied, tables):
    config = FusedKVConfig(2, 8, 4, "gptj")
    kv, weight, eps, cache, positions, multiplier = _op_leaves(config)
    layer_rope_table = None
    if tables:
        cache = torch.stack([cache, cache.flip(0)])
        layer_rope_table = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    args = (kv.requires_grad_(), weight.requires_grad_(), eps, cache, positions, *_static(config).values(),
            None, None, None, multiplier.requires_grad_() if multiplied else None, layer_rope_table)
    torch.library.opcheck(torch.ops.fusedkv.fused_kv_norm_rope.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_backward_under_fullgraph_compile_matches_eager():
    config = FusedKVConfig(2, 8, 8, "neox")
    kv, weight, eps, cache, positions, multiplier = _op_leaves(config, seed=11)
    probe_k, probe_v = (torch.randn(config.output_shape(1, 2), generator=torch.Generator().manual_seed(i)).to(DEVICE)
                        for i in range(2))

    def loss(kv, weight, multiplier):
        k, v = fusedkv_torch.fused_kv_norm_rope(kv, weight, eps, cache, positions, **_static(config),
                                                v_multiplier=multiplier)
        return (k * probe_k).sum() + (v * probe_v).sum()

    def grads(function):
        leaves = [a.detach().clone().requires_grad_() for a in (kv, weight, multiplier)]
        function(*leaves).backward()
        return [leaf.grad for leaf in leaves]

    torch._dynamo.reset()
    compiled = grads(torch.compile(loss, fullgraph=True, backend="aot_eager"))
    for got, expected in zip(compiled, grads(loss)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="captures a CUDA graph")
def test_forward_and_backward_captured_in_a_cuda_graph_replay_the_eager_gradients_bit_for_bit():
    config = FusedKVConfig(2, 16, 16, "neox")
    arrays, grads, _ = _inputs(config, dtype="bfloat16", total_ctx=5)
    kv, weight, eps, cache, positions = (to_torch(a).to(DEVICE) for a in arrays)
    probe_k, probe_v = (torch.tensor(g, device=DEVICE).to(kv.dtype) for g in grads)
    other_kv = to_torch(_inputs(config, dtype="bfloat16", total_ctx=5, seed=3)[0][0]).to(DEVICE)

    def loss(kv, weight):
        k, v = fusedkv_torch.fused_kv_norm_rope(kv, weight, eps, cache, positions, **_static(config))
        return (k * probe_k).sum() + (v * probe_v).sum()

    def eager_grads(kv_values):
        leaves = [kv_values.clone().requires_grad_(), weight.clone().requires_grad_()]
        loss(*leaves).backward()
        return [leaf.grad for leaf in leaves]

    static = [kv.clone().requires_grad_(), weight.clone().requires_grad_()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream: compilation, autograd's first run
        for _ in range(3):
            loss(*static).backward()
    torch.cuda.current_stream().wait_stream(side)
    for leaf in static:
        leaf.grad = None  # the captured backward then allocates the gradients in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss(*static).backward()
    for kv_values in (kv, other_kv):  # the inputs of the capture, then others copied into its static input
        with torch.no_grad():
            static[0].copy_(kv_values)
        graph.replay()
        torch.cuda.synchronize()
        for got, expected in zip([leaf.grad for leaf in static], eager_grads(kv_values)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_outputs_given_to_a_call_that_requires_grad_are_refused():
    config = FusedKVConfig(2, 8, 8, "neox")
    kv, weight, eps, cache, positions, _ = _op_leaves(config)
    k_out = torch.full(config.output_shape(1, 2), float("nan"), device=DEVICE)
    message = ("Invalid k_out for fused KV materialization: got an output buffer while kv, k_norm_weight or "
               "v_multiplier requires grad, expected k_out=None there (outputs written in place carry no "
               "gradient: the differentiable op allocates its own).")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fusedkv_torch.fused_kv_norm_rope(kv, weight.requires_grad_(), eps, cache, positions, **_static(config),
                                         k_out=k_out)
    assert torch.isnan(k_out).all()
    with torch.no_grad():  # without grad mode nothing is recorded, and given outputs are written
        fusedkv_torch.fused_kv_norm_rope(kv, weight, eps, cache, positions, **_static(config), k_out=k_out)
    assert not torch.isnan(k_out).any()


def _layers(config, hidden, seed, bases):
    rng = np.random.default_rng(seed)
    return [LayerKV(kv_proj_weight=torch.tensor(rng.standard_normal((2 * config.kv_size, hidden)).astype(np.float32)
                                                 / hidden ** 0.5, device=DEVICE, requires_grad=True),
                    k_norm_weight=torch.tensor(1 + 0.25 * rng.standard_normal(config.head_dim).astype(np.float32),
                                               device=DEVICE, requires_grad=True),
                    eps=1e-6, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                    rope=RopeConfig(config.rotary_dim, MAX_POSITION, base, style=config.rope_style))
            for base in bases]


# One RoPE for both layers (one table), or a sliding-window layer of another base (per-layer tables).
BASES = pytest.mark.parametrize("bases", [(1e4, 1e4), (1e4, 500.0)], ids=["one_rope", "two_ropes"])


@BASES
def test_materialize_carries_grad_fn_to_ctx_hidden_and_the_layers_weights(bases):
    config, hidden, n_layers = FusedKVConfig(2, 8, 8, "neox"), 6, 2
    layers = _layers(config, hidden, seed=13, bases=bases)
    materializer = fusedkv_torch.FusedKVMaterializer(layers)
    rng = np.random.default_rng(14)
    ctx_hidden = torch.tensor(rng.standard_normal((3, hidden)).astype(np.float32), device=DEVICE,
                              requires_grad=True)
    positions = torch.tensor([0, 5, 9], device=DEVICE)
    k, v = materializer.materialize(ctx_hidden, positions)
    grads = [rng.standard_normal(k.shape).astype(np.float32) for _ in range(2)]
    (torch.tensor(grads[0], device=DEVICE) * k + torch.tensor(grads[1], device=DEVICE) * v).sum().backward()

    weight = np.concatenate([as_numpy(layer.kv_proj_weight.detach()) for layer in layers])
    kv = (as_numpy(ctx_hidden.detach()) @ weight.T).reshape(3, n_layers, -1)
    norm_weight = np.stack([as_numpy(layer.k_norm_weight.detach()) for layer in layers])
    grad_kv, grad_norm_weight, _ = fused_kv_norm_rope_backward_reference(
        kv, norm_weight, np.full(n_layers, 1e-6, np.float32), as_numpy(materializer.cos_sin_cache),
        as_numpy(positions), *grads, **_static(config), layer_rope_table=materializer.layer_rope_table)
    grad_kv = grad_kv.reshape(3, -1)
    assert_grad_close(ctx_hidden.grad, grad_kv @ weight, "float32", "ctx_hidden")
    rows = 2 * config.kv_size
    for index, layer in enumerate(layers):
        assert_grad_close(layer.kv_proj_weight.grad, grad_kv[:, index * rows:(index + 1) * rows].T
                          @ as_numpy(ctx_hidden.detach()), "float32", f"layers[{index}].kv_proj_weight")
        assert_grad_close(layer.k_norm_weight.grad, grad_norm_weight[index], "float32",
                          f"layers[{index}].k_norm_weight")


@pytest.mark.parametrize("config, normed", [(FusedKVConfig(2, 16, 16, "gptj"), True),
                                            (FusedKVConfig(1, 16, 8, "neox"), False)], ids=str)
@pytest.mark.parametrize("kind", LAYER_ROPE_TABLES)
def test_torch_gradients_with_per_layer_tables_match_the_reference_backward(config, normed, kind):
    arrays, grads, multiplier = _inputs(config, seed=15)
    arrays, layer_rope_table = with_per_layer_tables(arrays), np.array(LAYER_ROPE_TABLES[kind], np.int32)
    got, given = _torch_grads(config, arrays, grads, multiplier, normed=normed, layer_rope_table=layer_rope_table)
    expected = _reference(config, arrays, given, multiplier, normed=normed, layer_rope_table=layer_rope_table)
    for name, got_grad, expected_grad in zip(("grad_kv", "grad_k_norm_weight", "grad_v_multiplier"), got, expected):
        if expected_grad is None:
            assert got_grad is None, name
        else:
            assert_grad_close(got_grad, expected_grad, "float32", name)


@pytest.mark.parametrize("heads", [8, 2, 1, 6])
def test_backward_tiles_hold_sixteen_tokens_of_one_head_over_threads_of_32_elements(heads):
    assert backward_tile(4096, heads, 128) == (16, 1, 2)
    assert backward_tile(4096, heads, 256) == (16, 1, 4)
    assert backward_tile(4096, heads, 64) == (16, 1, 1)
    assert backward_tile(16, heads, 128) == fusedkv_torch.kernel.default_tile(16, heads, 128)


def test_a_refused_call_with_per_layer_tables_that_requires_grad_raises_under_fullgraph_compile():
    config = FusedKVConfig(2, 8, 8, "neox")
    kv, weight, eps, cache, positions, _ = _op_leaves(config)
    tables, index = torch.stack([cache, cache]), torch.tensor([0], dtype=torch.int32)
    k_out = torch.full(config.output_shape(1, 2), float("nan"), device=DEVICE)

    def call(kv):
        return fusedkv_torch.fused_kv_norm_rope(kv, weight, eps, tables, positions, **_static(config), k_out=k_out,
                                                layer_rope_table=index)[0]

    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"^Invalid k_out for fused KV materialization: got an output buffer while"):
        torch.compile(call, fullgraph=True, backend="aot_eager")(kv.requires_grad_())
    assert torch.isnan(k_out).all()


@pytest.mark.parametrize("name", ["kv", "k_norm_weight", "v_multiplier"])
def test_a_cache_call_autograd_would_record_is_refused_with_the_caches_untouched(name):
    config = FusedKVConfig(2, 8, 8, "neox")
    kv, weight, eps, cache, positions, multiplier = _op_leaves(config)
    arrays = dict(kv=kv, k_norm_weight=weight, v_multiplier=multiplier)
    arrays[name].requires_grad_()
    caches = [torch.full((1, 4, 2, 8), 7.0, device=DEVICE) for _ in range(2)]
    slots = torch.tensor([3, 0], device=DEVICE)
    message = (f"Invalid {name} for fused KV materialization: got a tensor that requires grad for "
               "fused_kv_norm_rope_into_cache, expected one that does not")

    def call():
        return fusedkv_torch.fused_kv_norm_rope_into_cache(
            arrays["kv"], arrays["k_norm_weight"], eps, cache, positions, slots, *caches, **_static(config),
            v_multiplier=arrays["v_multiplier"])

    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        call()
    assert all((c == 7).all() for c in caches)
    with torch.no_grad():  # nothing recorded, nothing lost
        call()
    assert not (caches[0][0, 3] == 7).any() and (caches[0][0, 1] == 7).all()


@pytest.mark.parametrize("method", ["materialize_into_cache", "materialize_layers"])
@pytest.mark.parametrize("recorded", ["ctx_hidden", "layers[1].k_norm_weight"])
def test_materializer_calls_without_gradients_refuse_what_autograd_would_record(method, recorded):
    config, hidden = FusedKVConfig(2, 8, 8, "neox"), 6
    layers = _layers(config, hidden, seed=15, bases=(1e4, 1e4))
    for layer in layers:
        for tensor in (layer.kv_proj_weight, layer.k_norm_weight):
            tensor.requires_grad_(False)
    if recorded != "ctx_hidden":
        layers[1].k_norm_weight.requires_grad_()
    materializer = fusedkv_torch.FusedKVMaterializer(layers)
    ctx_hidden = torch.ones((2, hidden), device=DEVICE, requires_grad=recorded == "ctx_hidden")
    positions = torch.tensor([0, 5], device=DEVICE)
    caches = [torch.full((2, 4, 2, 8), 7.0, device=DEVICE) for _ in range(2)]
    written = []

    def call():
        if method == "materialize_into_cache":
            return materializer.materialize_into_cache(ctx_hidden, positions, torch.tensor([1, 2], device=DEVICE),
                                                       *caches)
        return materializer.materialize_layers(ctx_hidden, positions, lambda *args: written.append(args))

    message = (f"Invalid {recorded} for fused KV materialization: got a tensor that requires grad for {method}, "
               "expected one that does not")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        call()
    assert all((c == 7).all() for c in caches) and not written
    # Refused before the materializer grows a buffer for the call.
    assert materializer._workspace.numel() == materializer._staging.numel() == 0
    with torch.no_grad():
        call()
    assert len(written) == 2 if method == "materialize_layers" else not (caches[0][:, 1] == 7).any()
