"""Eager calls that repeat a layout (fusedkv_torch.repeated): launched again without
validation on new addresses, and everything else on the full path.

On the CPU the launcher is made to launch directly as on a GPU: each compiled kernel is a
stand-in that records its launches and runs the interpreted kernel on the tensors at the
addresses it is handed, so a relaunch computes what the kernel would. On a GPU the same
calls run for real (``test_repeated_layouts_on_the_gpu_*``).
"""

import gc
import re
import weakref

import numpy as np
import pytest
import torch
from triton import knobs

from interop.core import spec as spec_module
from interop.core.reference import fused_kv_norm_rope_into_cache_reference, fused_kv_norm_rope_reference
from interop.core.spec import FusedKVConfig
from interop.exchange import to_torch
from interop.testing import assert_bit_exact, assert_close, random_inputs
from fusedkv_torch import fused_kv_norm_rope, fused_kv_norm_rope_into_cache, repeated
from fusedkv_torch import kernel as kernel_module
from fusedkv_torch import ops as ops_module

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
cpu_only = pytest.mark.skipif(ON_GPU, reason="stands in for the GPU's launcher: on a GPU the kernel launches for real")
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")

CONFIG = FusedKVConfig(2, 64, 32, "neox")
N_LAYERS, TOTAL_CTX = 2, 3
SHAPE = CONFIG.output_shape(N_LAYERS, TOTAL_CTX)
STATIC = dict(num_kv_heads=2, head_dim=64, rotary_dim=32, rope_style="neox")


class StandIn:
    """A compiled kernel's launch that records ``(grid, addresses)`` and runs the interpreted
    kernel on the tensors at those addresses."""

    def __init__(self, launches, tensors_at, options):
        self.launches, self.tensors_at, self.options = launches, tensors_at, options
        self.calls = 0

    def __call__(self, grid, stream, addresses, rest):
        addresses = tuple(addresses)
        self.launches.append((grid, addresses))
        self.calls += 1
        tensors = [None if address is None else self.tensors_at[address] for address in addresses]
        kernel_module._launcher.kernel[(grid,)](*tensors, *rest, **self.options)


class DirectLaunches:
    """What the stand-in launcher did: ``compiles`` (first launches of a key), ``launches``
    (``(grid, addresses)`` of every later launch of a compiled kernel, in order),
    ``relaunches`` (those of them from a kept layout) and ``validations`` (the calls
    validation checked)."""

    def __init__(self):
        self.compiles, self.launches, self.relaunches, self.validations = [], [], [], []
        self.tensors_at = {}

    def known(self, *tensors):
        """Let the stand-in find ``tensors`` by address; returns them."""
        for tensor in tensors:
            if tensor is not None:
                self.tensors_at[tensor.data_ptr()] = tensor
        return tensors


@pytest.fixture
def direct(monkeypatch):
    if ON_GPU:
        pytest.skip("on a GPU the kernel launches for real")
    record = DirectLaunches()
    launcher = kernel_module._launcher

    def compile_and_launch(compiled, key, grid, tensors, addresses, plain_ints, ints, constexprs, options):
        record.compiles.append(key)
        launcher.kernel[(grid,)](*tensors, *plain_ints, *ints, *constexprs, **options)
        compiled[key] = StandIn(record.launches, record.tensors_at, options)

    relaunch = launcher.relaunch

    def recorded_relaunch(launch, grid, device, addresses, arguments):
        launched = relaunch(launch, grid, device, addresses, arguments)
        if launched:
            record.relaunches.append((grid, tuple(addresses)))
        return launched

    def counted(accept):
        def accept_and_count(*args, **kwargs):
            record.validations.append(accept.__name__)
            return accept(*args, **kwargs)
        return accept_and_count

    monkeypatch.setattr(launcher, "direct", True)
    monkeypatch.setattr(launcher, "_by_signature", {})  # no stand-in of another test's record
    monkeypatch.setattr(launcher, "_current_stream", lambda device: 0)
    monkeypatch.setattr(launcher, "_compile_and_launch", compile_and_launch)
    monkeypatch.setattr(launcher, "relaunch", recorded_relaunch)
    new_empty = torch.Tensor.new_empty  # the stand-in must find the outputs a call allocates
    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, *args, **kwargs: record.known(new_empty(self, *args, **kwargs))[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)  # a CPU tensor's get_device()
    monkeypatch.setattr(repeated, "_LAYOUTS", {})
    monkeypatch.setattr(spec_module, "_ACCEPTED_CALLS", {})
    monkeypatch.setattr(ops_module, "accept_call", counted(ops_module.accept_call))
    monkeypatch.setattr(ops_module, "accept_cache_call", counted(ops_module.accept_cache_call))
    return record


def call_inputs(seed, **dtypes):
    inputs = random_inputs(CONFIG, n_layers=N_LAYERS, total_ctx=TOTAL_CTX, max_position=64, seed=seed, **dtypes)
    return inputs, [to_torch(array).to(DEVICE) for array in inputs.arrays()]


def poisoned(shape, dtype=torch.bfloat16, device=DEVICE):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_matches_reference(inputs, k, v):
    expected_k, expected_v = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)
    assert_close(k, expected_k)
    assert_bit_exact(v, expected_v)


def bits(tensor):
    return tensor.view(torch.int16).cpu().numpy().tobytes()


def test_a_repeated_layout_is_launched_again_on_new_addresses_without_validation(direct):
    for seed in (1, 2, 3):
        inputs, arrays = call_inputs(seed)
        k_out, v_out = direct.known(*arrays, poisoned(SHAPE), poisoned(SHAPE))[-2:]
        k, v = fused_kv_norm_rope(*arrays, **STATIC, k_out=k_out, v_out=v_out)
        assert k is k_out and v is v_out
        assert_matches_reference(inputs, k, v)
    assert len(direct.compiles) == 1 and direct.validations == ["accept_call"]
    assert len(direct.relaunches) == 2 and direct.relaunches == direct.launches
    assert direct.relaunches[-1][1][0] == arrays[0].data_ptr()  # the last call's own kv


def test_a_kept_layout_holds_none_of_its_calls_tensors(direct):
    _, arrays = call_inputs(3)
    k_out, v_out = direct.known(poisoned(SHAPE), poisoned(SHAPE))
    fused_kv_norm_rope(*direct.known(*arrays), **STATIC, k_out=k_out, v_out=v_out)
    assert len(repeated._LAYOUTS) == 1
    watched = [weakref.ref(tensor) for tensor in (*arrays, k_out, v_out)]
    direct.tensors_at.clear()
    del arrays, k_out, v_out
    gc.collect()
    assert [ref() for ref in watched] == [None] * len(watched)


def test_fresh_outputs_are_allocated_on_every_repeated_call(direct):
    outputs = []
    for seed in (4, 5):
        inputs, arrays = call_inputs(seed)
        k, v = fused_kv_norm_rope(*direct.known(*arrays), **STATIC)
        assert k.shape == v.shape == SHAPE
        assert_matches_reference(inputs, k, v)
        outputs += [k, v]
    assert len(direct.relaunches) == 1 and direct.validations == ["accept_call"]
    assert direct.relaunches[0][1][6:8] == (outputs[2].data_ptr(), outputs[3].data_ptr())
    assert len({output.data_ptr() for output in outputs}) == 4


def transposed_kv(arrays):
    layer_major = arrays[0].transpose(0, 1).contiguous()
    return [layer_major.transpose(0, 1), *arrays[1:]]


@pytest.mark.parametrize("change", ["kv strides", "kv dtype", "positions dtype", "a float size",
                                    "a tile override", "check_positions"])
def test_a_call_that_changes_what_validation_reads_takes_the_full_path(direct, change):
    inputs, arrays = call_inputs(6)
    direct.known(*arrays)
    fused_kv_norm_rope(*arrays, **STATIC)
    static, options = dict(STATIC), {}
    if change == "kv strides":
        arrays = transposed_kv(arrays)
    elif change in ("kv dtype", "positions dtype"):
        inputs, arrays = call_inputs(6, **({"dtype": "float16"} if change == "kv dtype" else
                                           {"position_dtype": "int64"}))
    elif change == "a float size":
        static["head_dim"] = 64.0
    elif change == "a tile override":
        options = dict(num_warps=2)
    else:
        options = dict(check_positions=True)
    direct.known(*arrays)
    if change == "a float size":
        with pytest.raises(TypeError, match=re.escape("Invalid head_dim for fused KV materialization: got 64.0 "
                                                      "(float), expected a positive int.")):
            fused_kv_norm_rope(*arrays, **static)
    else:
        assert_matches_reference(inputs, *fused_kv_norm_rope(*arrays, **static, **options))
    assert direct.validations == ["accept_call", "accept_call"]
    assert direct.relaunches == []


def test_a_weight_resized_in_place_after_its_layout_was_kept_is_refused_by_validation(direct):
    _, arrays = call_inputs(6)
    fused_kv_norm_rope(*direct.known(*arrays), **STATIC)
    arrays[1].resize_(N_LAYERS, 32)  # the same tensor object, now too short a row for head_dim 64
    message = ("Invalid stacked k_norm_weight shape for fused KV materialization: got (2, 32), expected (2, 64).")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fused_kv_norm_rope(*arrays, **STATIC)
    assert direct.relaunches == []


def test_layouts_of_one_length_that_differ_in_strides_are_each_launched_again(direct):
    kv_addresses = []
    for seed in (40, 41, 42, 43):
        inputs, arrays = call_inputs(seed)
        arrays = transposed_kv(arrays) if seed % 2 else arrays
        assert_matches_reference(inputs, *fused_kv_norm_rope(*direct.known(*arrays), **STATIC))
        kv_addresses.append(arrays[0].data_ptr())
    assert direct.validations == ["accept_call", "accept_call"]
    assert [addresses[0] for _, addresses in direct.relaunches] == kv_addresses[2:]


def test_each_alignment_of_a_repeated_layout_is_launched_by_the_kernel_compiled_for_it(direct):
    numel = TOTAL_CTX * N_LAYERS * 2 * CONFIG.kv_size
    for round_ in range(2):
        for offset in (0, 1, 4):  # kv 0, 2 and 8 bytes past 16
            inputs, arrays = call_inputs(50 + offset + 10 * round_)
            kv = torch.zeros(numel + 16, dtype=torch.bfloat16)[offset:offset + numel].view(inputs.kv.shape)
            kv.copy_(arrays[0])
            assert_matches_reference(inputs, *fused_kv_norm_rope(*direct.known(kv, *arrays[1:]), **STATIC))
        if round_ == 0:
            assert len(direct.compiles) == 3 and direct.relaunches == []
    assert len(direct.compiles) == 3 and len(direct.relaunches) == 3
    [kept] = repeated._LAYOUTS.values()
    [layout] = kept.layouts
    launches = layout.launches
    assert sorted(bits if bits == 0 else bits[0] for _, bits in launches) == [0, 2, 8]
    assert [launch.calls for launch in launches.values()] == [1, 1, 1]  # each once, in the second round


OVERLAP = "got a buffer overlapping {}, expected outputs that overlap neither each other nor kv."


@pytest.mark.parametrize("case", ["partly shared", "one buffer in two storages", "k_out over kv"])
def test_overlapping_outputs_of_a_repeated_layout_are_refused_and_nothing_is_written(direct, case):
    _, arrays = call_inputs(7)
    kv = arrays[0]
    fused_kv_norm_rope(*direct.known(*arrays), **STATIC, k_out=poisoned(SHAPE), v_out=poisoned(SHAPE))
    n = kv.numel() // 2
    if case == "partly shared":
        pool = poisoned((2 * n - 64,))
        k_out, v_out, name, other = pool[:n].view(SHAPE), pool[n - 64:].view(SHAPE), "v_out", "k_out"
    elif case == "one buffer in two storages":
        k_out = poisoned(SHAPE)
        v_out, name, other = torch.utils.dlpack.from_dlpack(k_out.__dlpack__()), "v_out", "k_out"
    else:
        k_out, v_out, name, other = kv.reshape(-1)[n:].view(SHAPE), poisoned(SHAPE), "k_out", "kv"
    before = [bits(buffer) for buffer in (kv, k_out, v_out)]
    message = f"Invalid {name} for fused KV materialization: " + OVERLAP.format(other)
    for _ in range(2):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            fused_kv_norm_rope(*arrays, **STATIC, k_out=k_out, v_out=v_out)
    assert [bits(buffer) for buffer in (kv, k_out, v_out)] == before
    assert direct.relaunches == []


def test_k_and_v_interleaved_in_one_pool_are_written_on_a_repeated_layout(direct):
    for seed in (8, 9):
        inputs, arrays = call_inputs(seed)
        pool = poisoned((N_LAYERS, 2, *SHAPE[1:]))  # [n_layers, K or V, total_ctx, heads, head_dim]
        direct.known(*arrays, pool[:, 0], pool[:, 1])
        k, v = fused_kv_norm_rope(*arrays, **STATIC, k_out=pool[:, 0], v_out=pool[:, 1])
        assert_matches_reference(inputs, k, v)
    assert len(direct.relaunches) == 1 and direct.validations == ["accept_call"]


def test_a_watched_launch_takes_the_full_path(direct, monkeypatch):
    _, arrays = call_inputs(10)
    fused_kv_norm_rope(*direct.known(*arrays), **STATIC)
    watched = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: watched.append(metadata))
    inputs, arrays = call_inputs(11)
    assert_matches_reference(inputs, *fused_kv_norm_rope(*direct.known(*arrays), **STATIC))
    assert direct.relaunches == [] and len(direct.compiles) == 1


def test_a_layout_kept_without_grad_gives_a_differentiable_call_when_kv_requires_grad(direct):
    _, arrays = call_inputs(12)
    fused_kv_norm_rope(*direct.known(*arrays), **STATIC)
    inputs, arrays = call_inputs(13)
    kv = arrays[0].requires_grad_()
    k, v = fused_kv_norm_rope(*direct.known(*arrays), **STATIC)
    assert k.grad_fn is not None and v.grad_fn is not None
    assert_matches_reference(inputs, k.detach(), v.detach())
    assert direct.relaunches == []


def test_a_layout_kept_under_no_grad_with_a_parameter_weight_is_differentiable_in_grad_mode(direct):
    for seed in (44, 45):  # serving: weights that require grad, calls under no_grad
        inputs, arrays = call_inputs(seed)
        arrays[1].requires_grad_()
        with torch.no_grad():
            assert_matches_reference(inputs, *fused_kv_norm_rope(*direct.known(*arrays), **STATIC))
    assert len(direct.relaunches) == 1
    k, v = fused_kv_norm_rope(*direct.known(*arrays), **STATIC)
    assert k.grad_fn is not None
    assert_matches_reference(inputs, k.detach(), v.detach())
    assert len(direct.relaunches) == 1


def cache_call(seed, direct, slots):
    inputs, arrays = call_inputs(seed)
    poison = np.full((N_LAYERS, 5, 2, 64), np.nan, np.float32).astype(inputs.kv.dtype)
    k_cache, v_cache = (to_torch(poison.copy()).to(DEVICE) for _ in range(2))
    cache_loc = torch.tensor(slots, device=DEVICE)
    if direct is not None:
        direct.known(*arrays, cache_loc, k_cache, v_cache)
    written = fused_kv_norm_rope_into_cache(*arrays, cache_loc, k_cache, v_cache, **STATIC)
    assert written[0] is k_cache and written[1] is v_cache
    expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(*inputs.arrays(), np.array(slots), poison,
                                                                     poison, **STATIC)
    assert_close(k_cache, expected_k)
    assert_bit_exact(v_cache, expected_v)
    return k_cache, v_cache


def test_a_repeated_cache_layout_writes_new_slots(direct):
    for seed, slots in ((14, [4, -1, 0]), (15, [1, 2, 3]), (16, [-1, -1, 2])):
        cache_call(seed, direct, slots)
    assert len(direct.relaunches) == 2 and direct.validations == ["accept_cache_call"]


def test_a_cache_over_kv_of_a_repeated_layout_is_refused_and_nothing_is_written(direct):
    cache_call(17, direct, [0, 1, 2])
    _, arrays = call_inputs(18)
    kv = arrays[0]
    k_cache = kv.reshape(-1)[:N_LAYERS * 5 * 2 * 64].view(N_LAYERS, 5, 2, 64)
    v_cache = poisoned((N_LAYERS, 5, 2, 64))
    before = [bits(buffer) for buffer in (kv, v_cache)]
    message = "Invalid k_cache for fused KV materialization: " + OVERLAP.format("kv")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fused_kv_norm_rope_into_cache(*arrays, torch.tensor([0, 1, 2]), k_cache, v_cache, **STATIC)
    assert [bits(buffer) for buffer in (kv, v_cache)] == before
    assert direct.relaunches == []


@gpu
@pytest.mark.gpu
def test_repeated_layouts_on_the_gpu_match_the_reference_at_every_alignment():
    # kv and k_out 0, 2 and 8 bytes past 16, twice each: the second round launches from kept layouts.
    numel = TOTAL_CTX * N_LAYERS * 2 * CONFIG.kv_size
    for round_ in range(2):
        for offset in (0, 1, 4):
            inputs, arrays = call_inputs(20 + offset + 10 * round_)
            kv = torch.zeros(numel + 16, dtype=torch.bfloat16, device=DEVICE)[offset:offset + numel]
            kv = kv.view(inputs.kv.shape).copy_(arrays[0])
            k_out = poisoned((numel // 2 + 16,))[offset:offset + numel // 2].view(SHAPE)
            k, v = fused_kv_norm_rope(kv, *arrays[1:], **STATIC, k_out=k_out, v_out=poisoned(SHAPE))
            assert_matches_reference(inputs, k, v)
            assert_matches_reference(inputs, *fused_kv_norm_rope(kv, *arrays[1:], **STATIC))
    layouts = [layout for key, kept in repeated._LAYOUTS.items() if key[:5] == ("call", *STATIC.values())
               for layout in kept.layouts]
    assert sum(len(layout.launches) for layout in layouts) >= 6


@gpu
@pytest.mark.gpu
def test_repeated_layouts_on_the_gpu_write_new_cache_slots():
    for seed, slots in ((30, [4, -1, 0]), (31, [1, 2, 3]), (32, [-1, -1, 2])):
        cache_call(seed, None, slots)


@gpu
@pytest.mark.gpu
def test_repeated_layouts_on_the_gpu_take_positions_from_the_host_on_the_full_path():
    for seed in (33, 34):
        inputs, arrays = call_inputs(seed)
        assert_matches_reference(inputs, *fused_kv_norm_rope(*arrays, **STATIC))
    inputs, arrays = call_inputs(35)
    assert_matches_reference(inputs, *fused_kv_norm_rope(*arrays[:4], arrays[4].cpu(), **STATIC))
