"""The backend-neutral call: every caller framework with every backend, over DLPack."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

import interop  # noqa: E402
from interop.command import check as check_command  # noqa: E402
from interop.command import cli  # noqa: E402
from interop.core.arrays import as_numpy, numpy_dtype  # noqa: E402
from interop.command.backends import run_backend  # noqa: E402
from interop.exchange import framework_of, to_jax, to_torch  # noqa: E402
from interop.core.reference import fused_kv_norm_rope_reference  # noqa: E402
from interop.core.reference_backward import fused_kv_norm_rope_backward_reference  # noqa: E402
from interop.core.spec import FusedKVConfig  # noqa: E402
from interop.testing import assert_bit_exact, assert_close, gradient_mismatch, random_inputs  # noqa: E402

CONFIG = FusedKVConfig(num_kv_heads=2, head_dim=32, rotary_dim=32)
STATIC = dict(num_kv_heads=2, head_dim=32, rotary_dim=32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(seed, total_ctx=5, n_layers=2, **kwargs):
    return random_inputs(CONFIG, n_layers=n_layers, total_ctx=total_ctx, max_position=256,
                         seed=seed, **kwargs)


def _as_caller(array, caller):
    if caller == "numpy":
        return array
    if caller == "torch":
        # A fresh torch allocation: NumPy's own memory is not aligned enough for XLA's CPU
        # client, which copies such buffers on import (a CPU-only cost, see interop.exchange).
        return to_torch(array).to(DEVICE, copy=True)
    return jax.device_put(array)


def _pointer(array):
    if framework_of(array) == "torch":
        return array.data_ptr()
    if framework_of(array) == "jax":
        return array.unsafe_buffer_pointer()
    return array.__array_interface__["data"][0]


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize("caller", ["numpy", "torch", "jax"])
def test_every_caller_gets_reference_results_in_its_own_framework(caller, backend):
    if caller == "numpy" and DEVICE == "cuda" and backend == "torch":
        with pytest.raises(ValueError, match="^NumPy arrays live on the host"):
            interop.fused_kv_norm_rope(*_inputs(seed=1).arrays(), **STATIC, backend="torch")
        return
    inputs = _inputs(seed=len(caller) * 10 + len(backend))
    k, v = interop.fused_kv_norm_rope(*(_as_caller(a, caller) for a in inputs.arrays()),
                                      **STATIC, backend=backend)
    assert framework_of(k) == framework_of(v) == caller
    k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)
    assert_close(k, k_ref)
    assert_bit_exact(v, v_ref)


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize("caller, table_dtype", [("numpy", "bfloat16"), ("torch", "float16")])
def test_a_table_in_the_model_dtype_crosses_as_it_is_and_is_read_as_fp32(caller, table_dtype, backend):
    if caller == "numpy" and DEVICE == "cuda" and backend == "torch":
        pytest.skip("NumPy arrays do not reach the Triton kernel on a GPU")
    inputs = _inputs(seed=9, table_dtype=table_dtype)
    k, v = interop.fused_kv_norm_rope(*(_as_caller(a, caller) for a in inputs.arrays()), **STATIC, backend=backend)
    k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)
    assert_close(k, k_ref)
    assert_bit_exact(v, v_ref)


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize("caller", ["numpy", "torch", "jax"])
def test_per_layer_tables_cross_with_their_layer_index(caller, backend):
    if caller == "numpy" and DEVICE == "cuda" and backend == "torch":
        pytest.skip("NumPy arrays do not reach the Triton kernel on a GPU")
    inputs = _inputs(seed=11, n_layers=3)
    tables = np.stack([inputs.cos_sin_cache, inputs.cos_sin_cache[::-1].copy()])
    layer_rope_table = np.array([1, 0, 1], np.int32)
    arrays = inputs.arrays()[:3] + (tables, inputs.positions)
    k, v = interop.fused_kv_norm_rope(*(_as_caller(a, caller) for a in arrays), **STATIC, backend=backend,
                                      layer_rope_table=_as_caller(layer_rope_table, caller))
    k_ref, v_ref = fused_kv_norm_rope_reference(*arrays, **STATIC, layer_rope_table=layer_rope_table)
    assert_close(k, k_ref)
    assert_bit_exact(v, v_ref)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_given_torch_outputs_are_written_and_returned(backend):
    inputs = _inputs(seed=7)
    k_out = torch.full((2, 5, 2, 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v_out = torch.full_like(k_out, float("nan"))
    k, v = interop.fused_kv_norm_rope(*(_as_caller(a, "torch") for a in inputs.arrays()),
                                      **STATIC, k_out=k_out, v_out=v_out, backend=backend)
    assert k is k_out and v is v_out
    k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)
    assert_close(k_out, k_ref)
    assert_bit_exact(v_out, v_ref)


def test_auto_picks_the_callers_own_backend(monkeypatch):
    seen = []
    for name in ("torch", "jax"):
        module = interop.registry.load_backend(name)
        real = module.fused_kv_norm_rope_accepted
        monkeypatch.setattr(module, "fused_kv_norm_rope_accepted",
                            lambda *a, _real=real, _name=name, **k: seen.append(_name) or _real(*a, **k))
    inputs = _inputs(seed=8)
    interop.fused_kv_norm_rope(*(_as_caller(a, "jax") for a in inputs.arrays()), **STATIC)
    interop.fused_kv_norm_rope(*(_as_caller(a, "torch") for a in inputs.arrays()), **STATIC)
    interop.fused_kv_norm_rope(*inputs.arrays(), **STATIC)
    assert seen == ["jax", "torch", "jax"]


@pytest.mark.parametrize("caller, backend", [("torch", "jax"), ("jax", "torch")])
def test_contiguous_inputs_cross_without_a_copy(monkeypatch, caller, backend):
    module = interop.registry.load_backend(backend)
    received = {}

    def spy(accepted, kv, k_norm_weight, eps, cos_sin_cache, positions, **kwargs):
        received.update(kv=_pointer(kv), weight=_pointer(k_norm_weight),
                        cache=_pointer(cos_sin_cache), positions=_pointer(positions))
        return module_real(accepted, kv, k_norm_weight, eps, cos_sin_cache, positions, **kwargs)

    module_real = module.fused_kv_norm_rope_accepted
    monkeypatch.setattr(module, "fused_kv_norm_rope_accepted", spy)
    args = [_as_caller(a, caller) for a in _inputs(seed=9).arrays()]
    interop.fused_kv_norm_rope(*args, **STATIC, backend=backend)
    assert received == dict(kv=_pointer(args[0]), weight=_pointer(args[1]),
                            cache=_pointer(args[3]), positions=_pointer(args[4]))


def test_results_cross_back_without_a_copy():
    values = jnp.arange(64, dtype=jnp.bfloat16).reshape(4, 16)
    assert to_torch(values).data_ptr() == values.unsafe_buffer_pointer()
    tensor = torch.arange(64, dtype=torch.float32, device=DEVICE).reshape(4, 16)
    assert to_jax(tensor).unsafe_buffer_pointer() == tensor.data_ptr()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int32", "float8_e4m3fn", "float64", "int64"])
def test_a_crossing_to_jax_gives_what_jax_dlpack_from_dlpack_gives(dtype):
    from interop import exchange, jaxlib_dlpack

    tensor = (torch.arange(24, device=DEVICE) - 12).to(getattr(torch, dtype)).reshape(2, 12)
    (crossed,) = exchange.cross([tensor], "jax")
    # What jax's own import makes of the tensor as a crossing prepares it (int64 saturated).
    expected = jax.dlpack.from_dlpack(exchange._torch_for_jax(tensor))
    assert (crossed.dtype, crossed.shape, crossed.devices()) == (expected.dtype, expected.shape, expected.devices())
    assert_bit_exact(crossed, as_numpy(expected))
    if tensor.element_size() <= 4:  # jaxlib's import, which every supported jax offers, served it
        assert jaxlib_dlpack._IMPORT_BUFFER is not None
        assert crossed.unsafe_buffer_pointer() == tensor.data_ptr()


def test_a_transposed_tensor_crosses_to_jax_without_a_copy():
    from interop import exchange

    tensor = torch.arange(24, dtype=torch.float32, device=DEVICE).reshape(4, 6).t()
    assert not tensor.is_contiguous()
    (crossed,) = exchange.cross([tensor], "jax")
    assert crossed.unsafe_buffer_pointer() == tensor.data_ptr()
    assert_bit_exact(crossed, tensor.cpu().numpy())


def test_column_sliced_kv_view_reaches_jax_correctly():
    inputs = _inputs(seed=10)
    workspace = torch.zeros(5, 2, 2 * 2 * 32 + 16, dtype=torch.bfloat16, device=DEVICE)
    workspace[:, :, :128] = to_torch(inputs.kv).to(DEVICE)
    kv_view = workspace[:, :, :128]
    others = [_as_caller(a, "torch") for a in inputs.arrays()[1:]]
    k, v = interop.fused_kv_norm_rope(kv_view, *others, **STATIC, backend="jax")
    k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)
    assert_close(k, k_ref)
    assert_bit_exact(v, v_ref)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_kv_that_requires_grad_gives_the_reference_values(backend):
    # The jax backend takes it where autograd records nothing (a gradient cannot cross frameworks).
    inputs = _inputs(seed=11, dtype="float32")
    kv = to_torch(inputs.kv).to(DEVICE).requires_grad_(True)
    others = [_as_caller(a, "torch") for a in inputs.arrays()[1:]]
    with torch.set_grad_enabled(backend == "torch"):
        k, v = interop.fused_kv_norm_rope(kv, *others, **STATIC, backend=backend)
    k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)
    assert_close(k, k_ref)
    assert_bit_exact(v, v_ref)


def test_int64_positions_past_int32_stay_out_of_range_in_jax():
    inputs = _inputs(seed=12, position_dtype="int64")
    positions = inputs.positions.copy()
    positions[1] = 2**32 + 3  # would wrap to the valid position 3 if cast naively
    args = [_as_caller(a, "torch") for a in inputs.arrays()[:4]] + [to_torch(positions).to(DEVICE)]
    k, _ = interop.fused_kv_norm_rope(*args, **STATIC, backend="jax")
    k_ref, _ = fused_kv_norm_rope_reference(*inputs.arrays()[:4], positions, **STATIC)
    assert np.isnan(k_ref[:, 1].astype(np.float32)).all()
    assert_close(k, k_ref)


def test_bad_input_is_rejected_before_any_backend_runs():
    inputs = _inputs(seed=13)
    k_out = torch.full((2, 5, 2, 32), 7.0, dtype=torch.bfloat16, device=DEVICE)
    bad_eps = np.ones(3, np.float32)
    with pytest.raises(ValueError, match=r"^Invalid stacked eps shape"):
        interop.fused_kv_norm_rope(inputs.kv, inputs.k_norm_weight, bad_eps, inputs.cos_sin_cache,
                                   inputs.positions, **STATIC, k_out=k_out, backend="torch")
    assert bool((k_out == 7.0).all())
    with pytest.raises(ValueError, match=r"^Invalid backend for fused KV materialization: got 'cuda'"):
        interop.fused_kv_norm_rope(*inputs.arrays(), **STATIC, backend="cuda")


@pytest.mark.parametrize("bad_backend", ["cuda", ["torch"]])
def test_a_bad_backend_is_refused_on_every_call_after_the_same_call_went_through(bad_backend):
    args = [_as_caller(array, "torch") for array in _inputs(seed=14).arrays()]
    interop.fused_kv_norm_rope(*args, **STATIC, backend="jax")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^Invalid backend for fused KV materialization: got "
                                             + re.escape(repr(bad_backend))):
            interop.fused_kv_norm_rope(*args, **STATIC, backend=bad_backend)


def _corrupting(run_name, index):
    def runner(name, placed, config):
        run = run_backend(name, placed, config)
        if name != run_name:
            return run
        k = run.k.copy()
        k[index] = np.float32(k[index]) + 1.0
        return dataclasses.replace(run, k=k)
    return runner


def test_check_fails_and_names_a_planted_disagreement(monkeypatch, capsys):
    monkeypatch.setattr(check_command, "run_backend", _corrupting("jax", (1, 3, 0, 5)))
    status = cli.main(["check", "--layers", "2", "--heads", "2", "--head-dim", "32",
                       "--tokens", "4", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 1 and not report["ok"]
    failing = [row for row in report["rows"] if row["ok"] is False]
    assert {(row["subject"], row["against"]) for row in failing} == {("jax", "reference"), ("torch", "jax")}
    assert all("(1, 3, 0, 5)" in row["detail"] for row in failing)


def test_check_passes_when_backends_agree(capsys):
    status = cli.main(["check", "--layers", "2", "--heads", "2", "--head-dim", "32", "--tokens", "4"])
    table = capsys.readouterr().out
    assert status == 0, table
    assert table.count(" PASS ") == 3 and table.strip().endswith("ALL PASS")


gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="stream ordering needs a CUDA device")
GPU_CASE = dict(seed=21, total_ctx=2048, n_layers=5)


@pytest.mark.gpu
@gpu_only
def test_gpu_torch_work_still_queued_is_finished_before_jax_reads():
    inputs = _inputs(**GPU_CASE)
    source = to_torch(inputs.kv).to(DEVICE)
    kv = torch.full_like(source, float("nan"))
    others = [_as_caller(a, "torch") for a in inputs.arrays()[1:]]
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # about 50 ms of a busy stream
    kv.copy_(source)  # queued behind the sleep: kv is NaN until then
    k, v = interop.fused_kv_norm_rope(kv, *others, **STATIC, backend="jax")
    k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)
    assert_close(k, k_ref)
    assert_bit_exact(v, v_ref)


@pytest.mark.gpu
@gpu_only
def test_gpu_torch_writes_to_a_weight_between_calls_are_finished_before_jax_reads():
    inputs = _inputs(**GPU_CASE)
    args = [_as_caller(a, "torch") for a in inputs.arrays()]
    interop.fused_kv_norm_rope(*args, **STATIC, backend="jax")
    new_weight = _inputs(seed=22, n_layers=GPU_CASE["n_layers"]).k_norm_weight
    source = to_torch(new_weight).to(DEVICE)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # about 50 ms of a busy stream
    args[1].copy_(source)  # queued behind the sleep
    k, v = interop.fused_kv_norm_rope(*args, **STATIC, backend="jax")
    k_ref, v_ref = fused_kv_norm_rope_reference(inputs.kv, new_weight, *inputs.arrays()[2:], **STATIC)
    assert_close(k, k_ref)
    assert_bit_exact(v, v_ref)


@pytest.mark.gpu
@gpu_only
def test_gpu_torch_writes_queued_to_an_input_without_its_own_ready_event_are_finished_before_jax_reads():
    # A crossing for one launch gives a ready event to the first torch tensor alone: with a
    # jax kv that is the weight, and the positions written late must still be waited for.
    inputs = _inputs(**GPU_CASE)
    late_positions = _inputs(**{**GPU_CASE, "seed": 23}).positions
    assert not np.array_equal(late_positions, inputs.positions)
    kv = jax.device_put(inputs.kv)
    others = [_as_caller(a, "torch") for a in inputs.arrays()[1:]]
    interop.fused_kv_norm_rope(kv, *others, **STATIC, backend="jax")  # compiled before the race
    source = to_torch(late_positions).to(DEVICE)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # about 50 ms of a busy stream
    others[3].copy_(source)  # queued behind the sleep
    k, v = interop.fused_kv_norm_rope(kv, *others, **STATIC, backend="jax")
    k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays()[:4], late_positions, **STATIC)
    assert_close(k, k_ref)
    assert_bit_exact(v, v_ref)


@jax.jit
def _late_copy(kv, weight):
    """``kv`` again, but only after about 2 TFLOP of fp32 matrix products on jax's stream."""
    product = weight
    for _ in range(16):
        product = product @ weight
    return kv + (product[0, 1] * 0).astype(kv.dtype)


@pytest.mark.gpu
@gpu_only
def test_gpu_jax_work_still_queued_is_finished_before_torch_reads():
    inputs = _inputs(**GPU_CASE)
    identity = jnp.eye(4096, dtype=jnp.float32)
    kv = _late_copy(jax.device_put(inputs.kv), identity)  # dispatched, not finished
    others = [jax.device_put(a) for a in inputs.arrays()[1:]]
    k, v = interop.fused_kv_norm_rope(kv, *others, **STATIC, backend="torch")
    k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)
    assert_close(k, k_ref)
    assert_bit_exact(v, v_ref)


def test_a_call_that_passed_before_does_not_let_a_bad_one_through():
    inputs = _inputs(seed=14)
    args = [_as_caller(a, "torch") for a in inputs.arrays()]
    good = torch.empty((2, 5, 2, 32), dtype=torch.bfloat16, device=DEVICE)
    interop.fused_kv_norm_rope(*args, **STATIC, k_out=good, v_out=good.clone(), backend="torch")
    bad = torch.full((2, 5, 2, 32), 3.0, dtype=torch.float16, device=DEVICE)
    for _ in range(2):  # rejected metadata is never remembered
        with pytest.raises(ValueError, match=r"^Invalid k_out device/dtype"):
            interop.fused_kv_norm_rope(*args, **STATIC, k_out=bad, v_out=good, backend="torch")
    assert bool((bad == 3.0).all())


def _refused_before_any_backend_runs(monkeypatch, error, message, *args, **kwargs):
    """Call interop with a spy on both backends; the call must raise ``message`` and run neither."""
    ran = []
    for name in ("torch", "jax"):
        module = interop.registry.load_backend(name)
        for entry in ("fused_kv_norm_rope", "fused_kv_norm_rope_accepted"):
            monkeypatch.setattr(module, entry, lambda *a, _name=name, **k: ran.append(_name))
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        interop.fused_kv_norm_rope(*args, **kwargs)
    assert ran == []


@pytest.mark.parametrize("name", ["kv", "k_out"])
def test_a_list_is_refused_naming_dlpack(monkeypatch, name):
    args = dict(zip(("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions"), _inputs(seed=15).arrays()))
    args[name] = np.zeros((2, 5, 2, 32), np.float32).tolist() if name == "k_out" else args["kv"].tolist()
    _refused_before_any_backend_runs(
        monkeypatch, TypeError, f"Invalid {name} for fused KV materialization: got list, expected an array "
        "with __dlpack__ (NumPy, torch, jax, CuPy).", **args, **STATIC)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_read_only_numpy_output_is_refused_before_any_backend_runs(monkeypatch, backend):
    inputs = _inputs(seed=16)
    k_out = np.full((2, 5, 2, 32), 7.0, np.float32).astype(inputs.kv.dtype)
    k_out.flags.writeable = False
    _refused_before_any_backend_runs(
        monkeypatch, ValueError, "Invalid k_out for fused KV materialization: got a read-only array, expected "
        "a writable one (pass a copy: np.array(k_out)).", *inputs.arrays(), **STATIC, k_out=k_out,
        backend=backend)
    assert (k_out.astype(np.float32) == 7.0).all()


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_negative_stride_numpy_kv_is_refused_with_the_fix(monkeypatch, backend):
    inputs = _inputs(seed=17)
    _refused_before_any_backend_runs(
        monkeypatch, ValueError, "Invalid kv for fused KV materialization: got strides (-512, 256, 2) with a "
        "negative stride, expected non-negative strides (pass np.ascontiguousarray(kv)).",
        inputs.kv[::-1], *inputs.arrays()[1:], **STATIC, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize("name", ["cos_sin_cache", "k_out"])
def test_a_big_endian_numpy_array_is_refused_before_any_backend_runs(monkeypatch, backend, name):
    args = dict(zip(("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions"),
                    _inputs(seed=20, dtype="float32").arrays()))
    args["k_out"] = np.full((2, 5, 2, 32), 7.0, np.float32)
    args[name] = args[name].astype(">f4")
    _refused_before_any_backend_runs(
        monkeypatch, ValueError, f"Invalid {name} for fused KV materialization: got a big-endian array (dtype "
        f">f4), expected native byte order (pass {name}.astype({name}.dtype.newbyteorder('='))).",
        **args, **STATIC, backend=backend)
    assert (args["k_out"] == 7.0).all()


def _output(framework, fill):
    host = np.full((2, 5, 2, 32), fill, np.float32).astype(numpy_dtype("bfloat16"))
    return {"numpy": host, "torch": to_torch(host).to(DEVICE, copy=True), "jax": jnp.asarray(host)}[framework]


@pytest.mark.parametrize("caller, backend", [("torch", "torch"), ("torch", "jax"), ("numpy", "torch"),
                                             ("numpy", "jax"), ("jax", "jax"), ("jax", "torch")])
def test_one_array_as_both_outputs_is_refused_on_every_call(caller, backend):
    if caller == "numpy" and backend == "torch" and DEVICE == "cuda":
        pytest.skip("NumPy arrays do not reach the Triton kernel on a GPU")
    args = [_as_caller(a, caller) for a in _inputs(seed=18).arrays()]
    # The same metadata with two arrays first: accepted, and remembered.
    interop.fused_kv_norm_rope(*args, **STATIC, k_out=_output(caller, 1.0), v_out=_output(caller, 2.0),
                               backend=backend)
    out = _output(caller, 3.0)
    for _ in range(2):
        with pytest.raises(ValueError, match="^" + re.escape(
                "Invalid v_out for fused KV materialization: got a buffer overlapping k_out, expected outputs "
                "that overlap neither each other nor kv.") + "$"):
            interop.fused_kv_norm_rope(*args, **STATIC, k_out=out, v_out=out, backend=backend)
    assert (np.asarray(as_numpy(out), np.float32) == 3.0).all()


def test_a_float_size_is_refused_after_the_same_call_with_ints():
    args = [_as_caller(a, "torch") for a in _inputs(seed=19).arrays()]
    interop.fused_kv_norm_rope(*args, **STATIC, backend="torch")
    with pytest.raises(TypeError, match="^" + re.escape(
            "Invalid num_kv_heads for fused KV materialization: got 2.0 (float), expected a positive int.") + "$"):
        interop.fused_kv_norm_rope(*args, **{**STATIC, "num_kv_heads": 2.0}, backend="torch")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CuPy arrays live on a CUDA device")
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_cupy_callers_get_reference_results_as_cupy_arrays(backend):
    cupy = pytest.importorskip("cupy")
    inputs = _inputs(seed=11, dtype="float16")  # CuPy has no bfloat16
    k, v = interop.fused_kv_norm_rope(*(cupy.asarray(a) for a in inputs.arrays()), **STATIC, backend=backend)
    assert framework_of(k) == framework_of(v) == "cupy"
    k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)
    assert_close(cupy.asnumpy(k), k_ref)
    assert_bit_exact(cupy.asnumpy(v), v_ref)


class _HostArray:
    """A NumPy array as a library other than NumPy, torch and jax holds it: ``__dlpack__``
    and its metadata only (its module is set by :func:`_library`)."""

    def __init__(self, array):
        self.array = array
        self.shape, self.dtype = array.shape, array.dtype

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def _library(monkeypatch, name, **attributes):
    """A module ``name`` holding its own copy of :class:`_HostArray` and ``attributes``."""
    module = types.ModuleType(name)
    module.Array = type("Array", (_HostArray,), {"__module__": name})
    vars(module).update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_caller_whose_library_has_no_from_dlpack_is_refused_before_any_backend_runs(monkeypatch, backend):
    library = _library(monkeypatch, "nofromdlpack")
    inputs = _inputs(seed=20, dtype="float32")
    k_out = np.full((2, 5, 2, 32), 7.0, np.float32)
    _refused_before_any_backend_runs(
        monkeypatch, TypeError, "Invalid kv for fused KV materialization: got nofromdlpack.Array, whose module "
        "has no from_dlpack to return results through, expected an array of NumPy, torch, jax or a library "
        "with from_dlpack (or NumPy or torch k_out and v_out to write results into).",
        library.Array(inputs.kv), *inputs.arrays()[1:], **STATIC, k_out=k_out, backend=backend)
    assert (k_out == 7.0).all()


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_outputs_of_another_library_are_refused_before_any_backend_runs(monkeypatch, backend):
    if backend == "torch" and DEVICE == "cuda":
        pytest.skip("host arrays do not reach the Triton kernel on a GPU: the route refuses kv first")
    library = _library(monkeypatch, "otherlibrary", from_dlpack=lambda array: None)
    inputs = _inputs(seed=21, dtype="float32")
    held = np.full((2, 5, 2, 32), 7.0, np.float32)
    _refused_before_any_backend_runs(
        monkeypatch, TypeError, "Invalid v_out for fused KV materialization: got otherlibrary.Array, expected a "
        "NumPy, torch or jax array (interop writes results into those), or no v_out for a new array of kv's "
        "framework.", *inputs.arrays(), **STATIC, v_out=library.Array(held), backend=backend)
    assert (held == 7.0).all()


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_caller_without_from_dlpack_gets_the_results_in_its_given_numpy_outputs(monkeypatch, backend):
    if backend == "torch" and DEVICE == "cuda":
        pytest.skip("host arrays do not reach the Triton kernel on a GPU")
    library = _library(monkeypatch, "nofromdlpack")
    inputs = _inputs(seed=22, dtype="float32")
    k_out, v_out = np.zeros((2, 5, 2, 32), np.float32), np.zeros((2, 5, 2, 32), np.float32)
    k, v = interop.fused_kv_norm_rope(library.Array(inputs.kv), *inputs.arrays()[1:], **STATIC, k_out=k_out,
                                      v_out=v_out, backend=backend)
    assert k is k_out and v is v_out
    k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)
    assert_close(k, k_ref)
    assert_bit_exact(v, v_ref)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_library_with_from_dlpack_gets_its_own_arrays_back(monkeypatch, backend):
    if backend == "torch" and DEVICE == "cuda":
        pytest.skip("host arrays do not reach the Triton kernel on a GPU")
    library = _library(monkeypatch, "withfromdlpack")
    library.from_dlpack = lambda array: library.Array(np.from_dlpack(array))
    inputs = _inputs(seed=23, dtype="float32")
    k, v = interop.fused_kv_norm_rope(library.Array(inputs.kv), *inputs.arrays()[1:], **STATIC, backend=backend)
    assert type(k) is type(v) is library.Array
    k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)
    assert_close(k.array, k_ref)
    assert_bit_exact(v.array, v_ref)


def _without_triton_interpret(script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh process whose environment lacks TRITON_INTERPRET (conftest sets it here)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=pathlib.Path(__file__).parents[1],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU only")
def test_the_library_leaves_the_environment_alone_and_the_torch_backend_says_what_to_set():
    result = _without_triton_interpret("""
        import os
        import interop
        from interop.testing import random_inputs
        from interop.core.spec import FusedKVConfig

        inputs = random_inputs(FusedKVConfig(2, 64, 32), n_layers=2, total_ctx=3, max_position=16)
        try:
            interop.fused_kv_norm_rope(*inputs.arrays(), num_kv_heads=2, head_dim=64, rotary_dim=32,
                                       backend="torch")
        except ValueError as error:
            print(error)
        print(os.environ.get("TRITON_INTERPRET"))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-2:] == [
        "Invalid kv device for fused KV materialization: got device=cpu, expected a CUDA device (to run "
        "the Triton kernel on the CPU, set TRITON_INTERPRET=1 before fusedkv_torch is imported).",
        "None",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU only")
def test_the_command_line_interprets_the_triton_kernel_without_a_gpu():
    result = _without_triton_interpret("""
        import os
        from interop.command import cli

        code = cli.main(["check", "--backends", "torch", "--layers", "1", "--heads", "2", "--head-dim", "32",
                         "--tokens", "3"])
        print(code, os.environ.get("TRITON_INTERPRET"))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "0 1"


# --- gradients through the backend-neutral call --------------------------------------------


def test_torch_tensors_that_require_grad_differentiate_through_the_torch_backend():
    kv, weight, eps, cos_sin, positions = _inputs(60, dtype="float32").arrays()
    grad_k, grad_v = (np.random.default_rng(61 + i).standard_normal(CONFIG.output_shape(2, 5)).astype(np.float32)
                      for i in range(2))
    leaves = [to_torch(a).to(DEVICE, copy=True).requires_grad_() for a in (kv, weight)]
    rest = [to_torch(a).to(DEVICE, copy=True) for a in (eps, cos_sin, positions)]
    k, v = interop.fused_kv_norm_rope(leaves[0], leaves[1], *rest, **STATIC, backend="torch")
    assert k.grad_fn is not None and v.grad_fn is not None
    torch.autograd.backward((k, v), (to_torch(grad_k).to(DEVICE), to_torch(grad_v).to(DEVICE)))
    expected_kv, expected_weight, _ = fused_kv_norm_rope_backward_reference(
        kv, weight, eps, cos_sin, positions, grad_k, grad_v, **STATIC, rope_style="neox")
    for name, leaf, expected in (("grad_kv", leaves[0], expected_kv),
                                 ("grad_k_norm_weight", leaves[1], expected_weight)):
        mismatch = gradient_mismatch(leaf.grad, expected, "float32", name=name)
        assert not mismatch, mismatch


def test_given_outputs_with_a_tensor_that_requires_grad_are_refused_as_fusedkv_torch_refuses_them():
    kv, *rest = (to_torch(a).to(DEVICE, copy=True) for a in _inputs(62).arrays())
    kv.requires_grad_()
    k_out, v_out = (torch.full(CONFIG.output_shape(2, 5), 7.0, dtype=kv.dtype, device=DEVICE) for _ in range(2))
    with pytest.raises(ValueError) as refused:
        interop.fused_kv_norm_rope(kv, *rest, **STATIC, k_out=k_out, v_out=v_out, backend="torch")
    assert str(refused.value).startswith("Invalid k_out for fused KV materialization: got an output buffer while kv")
    assert (k_out == 7).all() and (v_out == 7).all()


@pytest.mark.parametrize("name", ["kv", "k_norm_weight", "v_multiplier"])
def test_a_torch_tensor_that_requires_grad_is_refused_by_the_jax_backend(name):
    arrays = dict(zip(("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions"),
                      (to_torch(a).to(DEVICE, copy=True) for a in _inputs(63).arrays())))
    arrays["v_multiplier"] = torch.ones(2, device=DEVICE)
    arrays[name].requires_grad_()
    message = (f"Invalid {name} for fused KV materialization: got a torch tensor that requires grad for the jax "
               "backend, expected one that does not")
    with pytest.raises(ValueError, match=re.escape(message)):
        interop.fused_kv_norm_rope(**arrays, **STATIC, backend="jax")
    with torch.no_grad():  # nothing is recorded there, so nothing is lost
        k, _ = interop.fused_kv_norm_rope(**arrays, **STATIC, backend="jax")
    assert framework_of(k) == "torch"


@pytest.mark.parametrize("transform", ["jit", "grad"])
def test_traced_jax_arrays_are_refused_by_the_torch_backend_naming_the_array(transform):
    kv, weight, eps, cos_sin, positions = (jnp.asarray(a) for a in _inputs(64, dtype="float32").arrays())

    def op(kv):
        k, v = interop.fused_kv_norm_rope(kv, weight, eps, cos_sin, positions, **STATIC, backend="torch")
        return jnp.sum(k) + jnp.sum(v)

    message = ("Invalid kv for fused KV materialization: got a traced jax array (inside jax.jit, jax.grad or "
               "another jax transformation) for the torch backend, expected a concrete array")
    with pytest.raises(TypeError, match=re.escape(message)):
        (jax.jit(op) if transform == "jit" else jax.grad(op))(kv)
