"""Calls remembered as validated (interop.core.spec.accept_call): the one call signature that every
entry point keys on holds everything validation reads, so no changed call skips a check."""

import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

import fusedkv_jax  # noqa: E402
import fusedkv_torch  # noqa: E402
import interop  # noqa: E402
from interop.core import spec  # noqa: E402
from interop.core.arrays import numpy_dtype  # noqa: E402
from interop.exchange import to_torch  # noqa: E402
from interop.core.spec import (  # noqa: E402
    FusedKVConfig,
    call_signature,
    check_arrays,
    validate_cache_call,
    validate_call,
)
from interop.testing import random_inputs  # noqa: E402

CONFIG = FusedKVConfig(num_kv_heads=2, head_dim=32, rotary_dim=32)
STATIC = dict(num_kv_heads=2, head_dim=32, rotary_dim=32, rope_style="neox")
OUT_SHAPE = (1, 3, 2, 32)


def _host_call():
    inputs = random_inputs(CONFIG, n_layers=1, total_ctx=3, max_position=64, seed=3)
    arrays = dict(zip(("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions"), inputs.arrays()))
    bf16 = arrays["kv"].dtype
    return dict(arrays, k_out=np.zeros(OUT_SHAPE, bf16), v_out=np.zeros(OUT_SHAPE, bf16))


# Where the torch kernel runs in this process: the GPU, unless Triton interprets.
TORCH_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _as_torch(array):
    return to_torch(array).clone().to(TORCH_DEVICE)


def _as_jax(array):
    return jnp.asarray(array)


# (entry point, how its arrays are made, how it is called)
ENTRY_POINTS = {
    "fusedkv_torch": (_as_torch, lambda **call: fusedkv_torch.fused_kv_norm_rope(**call)),
    "fusedkv_jax": (_as_jax, lambda **call: fusedkv_jax.fused_kv_norm_rope(**call)),
    "interop, torch backend": (_as_torch, lambda **call: interop.fused_kv_norm_rope(**call, backend="torch")),
    "interop, jax backend": (_as_torch, lambda **call: interop.fused_kv_norm_rope(**call, backend="jax")),
}


def _changes(entry, make):
    """One field of a call that passes changed so that the call must be refused: the field,
    the new value (built from the host call) and the error's type and opening words.
    jax holds no 64-bit floats here (x64 off), so dtypes change to ones it keeps."""
    reversed_kv = lambda host: host["kv"][::-1]  # noqa: E731 (a NumPy array: not made)
    if entry == "fusedkv_torch":
        reversed_kv_refusal = (TypeError, "Invalid kv for fused KV materialization: got numpy.ndarray")
    else:
        reversed_kv_refusal = (ValueError, "Invalid kv for fused KV materialization: got strides (-256, 256, 2) with a negative stride")
    changes = [
        ("kv", reversed_kv, *reversed_kv_refusal),
        ("num_kv_heads", 2.0, TypeError, "Invalid num_kv_heads"),
        ("num_kv_heads", 4, ValueError, "Invalid fused KV projection shape"),
        ("head_dim", np.float64(32.0), TypeError, "Invalid head_dim"),
        ("rotary_dim", 30.0, TypeError, "Invalid rotary_dim"),
        ("rotary_dim", 31, ValueError, "Invalid fused KV rotary/head dim pair"),
        ("rope_style", "llama", ValueError, "Invalid rope_style"),
        ("kv", lambda host: [[[0.0]]], TypeError, "Invalid kv for fused KV materialization: got list"),
        ("kv", lambda host: host["kv"][:2], ValueError, "Invalid positions shape"),
        ("kv", lambda host: host["kv"].astype(np.int32), ValueError, "Invalid kv dtype"),
        ("k_norm_weight", lambda host: host["k_norm_weight"][:, :16], ValueError,
         "Invalid stacked k_norm_weight shape"),
        ("k_norm_weight", lambda host: host["k_norm_weight"].astype(np.int32), ValueError,
         "Invalid k_norm_weight dtype"),
        ("eps", lambda host: np.ones(2, np.float32), ValueError, "Invalid stacked eps shape"),
        ("eps", lambda host: host["eps"].astype(np.float16), ValueError, "Invalid eps dtype"),
        ("cos_sin_cache", lambda host: host["cos_sin_cache"][:, :16], ValueError, "Invalid cos_sin_cache shape"),
        ("cos_sin_cache", lambda host: host["cos_sin_cache"].astype(np.int32), ValueError,
         "Invalid cos_sin_cache dtype"),
        ("cos_sin_cache", lambda host: np.stack([host["cos_sin_cache"]] * 2), ValueError,
         "Invalid layer_rope_table"),
        ("positions", lambda host: host["positions"][:2], ValueError, "Invalid positions shape"),
        ("positions", lambda host: host["positions"].astype(np.float32), ValueError, "Invalid positions dtype"),
        ("k_out", lambda host: host["k_out"][:, :2], ValueError, "Invalid k_out shape"),
        ("k_out", lambda host: host["k_out"].astype(np.float16), ValueError, "Invalid k_out device/dtype"),
        ("v_out", lambda host: host["v_out"].astype(np.float32), ValueError, "Invalid v_out device/dtype"),
    ]
    if make is _as_torch:  # another device: torch's meta tensors have one without memory
        changes.append(("k_out", lambda host: torch.empty(OUT_SHAPE, dtype=torch.bfloat16, device="meta"),
                        ValueError, "Invalid k_out device/dtype"))
    return [(name, change if not callable(change) or change is reversed_kv else _made(change, make), error, message)
            for name, change, error, message in changes]


def _refused_before_validation(message):
    """Whether a refusal comes from check_arrays, which runs before validate_call."""
    return message.startswith("Invalid kv for fused KV materialization: got ")


def _made(change, make):
    def array(host):
        value = change(host)
        return make(value) if isinstance(value, np.ndarray) else value
    return array


@pytest.fixture
def validations(monkeypatch):
    """Start with nothing remembered, and count the calls that are validated in full."""
    monkeypatch.setattr(spec, "_ACCEPTED_CALLS", {})
    count = [0]
    real = spec.validate_call

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(spec, "validate_call", counted)
    return count


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_call_that_passed_does_not_let_the_same_call_with_one_field_changed_through(entry, validations):
    make, call = ENTRY_POINTS[entry]
    host = _host_call()
    good = {name: make(array) for name, array in host.items()}
    for _ in range(2):
        call(**good, **STATIC)
    assert validations[0] == 1  # the second call was remembered, not validated again
    changes = _changes(entry, make)
    for name, change, error, message in changes:
        changed = {**good, **STATIC, name: change(host) if callable(change) else change}
        for _ in range(2):  # a refused call is never remembered
            with pytest.raises(error, match="^" + re.escape(message)):
                call(**changed)
    call(**good, **STATIC)
    assert validations[0] == 1 + 2 * sum(1 for *_, message in changes if not _refused_before_validation(message))


def test_a_numpy_kv_with_a_negative_stride_is_refused_after_the_same_call_with_a_positive_one(validations):
    host = _host_call()
    args = {name: host[name] for name in ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions")}
    interop.fused_kv_norm_rope(**args, **STATIC, backend="jax")
    reversed_kv = host["kv"][::-1]  # the same type, shape and dtype; only the strides differ
    for _ in range(2):
        with pytest.raises(ValueError, match="^" + re.escape(
                "Invalid kv for fused KV materialization: got strides (-256, 256, 2) with a negative stride")):
            interop.fused_kv_norm_rope(**{**args, "kv": reversed_kv}, **STATIC, backend="jax")


class _Recorded:
    """An array of a framework of its own that records which of its attributes are read."""

    def __init__(self, array, reads: set):
        object.__setattr__(self, "_array", array)
        object.__setattr__(self, "_reads", reads)

    def __getattribute__(self, name):
        if name not in ("_array", "_reads"):
            object.__getattribute__(self, "_reads").add(name)
        return object.__getattribute__(self, name)

    @property
    def shape(self):
        return self._array.shape

    @property
    def dtype(self):
        return self._array.dtype

    def __dlpack__(self, *, stream=None):
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def _reads_of(run, arrays):
    """The attributes ``run`` reads of each of ``arrays`` (wrapped so that reads are seen)."""
    reads = [set() for _ in arrays]
    run([_Recorded(array, read) for array, read in zip(arrays, reads)])
    return reads


def test_the_call_signature_reads_every_attribute_validation_reads():
    host = _host_call()
    names = ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions", "k_out", "v_out")
    arrays = [host[name] for name in names]
    validated = _reads_of(lambda recorded: (check_arrays(zip(names, recorded), "any"), validate_call(
        *recorded[:5], k_out=recorded[5], v_out=recorded[6], check_buffers=False, **STATIC)), arrays)
    signed = _reads_of(lambda recorded: call_signature("call", "any", recorded, *STATIC.values()), arrays)
    assert all(validated), "validation read no attribute: the recording sees nothing"
    for name, by_validation, by_signature in zip(names, validated, signed):
        assert by_validation <= by_signature, f"{name}: validation reads {by_validation - by_signature}"


def test_the_cache_call_signature_reads_every_attribute_validation_reads():
    host = _host_call()
    fp8_cache = np.zeros((1, 8, 2, 32), numpy_dtype("float8_e4m3fn"))  # fp8: the scales are read too
    names = ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions", "cache_loc", "k_cache", "v_cache",
             "k_scale", "v_scale")
    arrays = [host[name] for name in names[:5]] + [np.arange(3, dtype=np.int32), fp8_cache, fp8_cache.copy(),
                                                   np.ones(1, np.float32), np.ones(1, np.float32)]
    validated = _reads_of(lambda recorded: (check_arrays(zip(names, recorded), "any"), validate_cache_call(
        *recorded[:8], k_scale=recorded[8], v_scale=recorded[9], check_buffers=False, **STATIC)), arrays)
    signed = _reads_of(lambda recorded: call_signature("cache", "any", recorded, *STATIC.values()), arrays)
    assert all(validated), "validation read no attribute: the recording sees nothing"
    for name, by_validation, by_signature in zip(names, validated, signed):
        assert by_validation <= by_signature, f"{name}: validation reads {by_validation - by_signature}"
