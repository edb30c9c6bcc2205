"""Moving buffers between NumPy, torch, jax (and CuPy) through DLPack.

What crosses without a copy: any contiguous (or transposed) buffer between torch and
jax, on CPU and GPU, and torch/NumPy on the CPU. What costs a copy, and why:

* a torch view DLPack cannot describe to jax (a column slice of a wider workspace):
  jax accepts only compact strides, so the view is made contiguous first;
* int64 positions going to jax with x64 off: jax would wrap them to int32 silently,
  so they are saturated to int32 first (any position past 2**31 - 1 is past every
  cos/sin cache anyway, and stays out of range);
* bf16 NumPy arrays: NumPy's DLPack refuses bf16, so they travel to torch as an
  int16 view (no copy); jax receives every NumPy array through ``device_put``, which
  places it on jax's default device (a host-to-device copy when that is a GPU).

* on the CPU, a buffer that is not 64-byte aligned (NumPy's own allocations are
  not; torch's are) is copied by jax on import.

A tensor that requires grad is exported through ``.detach()``, which copies nothing.

On a GPU the consumer must not read a buffer before the producer's queued work has
written it. DLPack orders each exchange on its own: the consumer passes its stream to
the producer's ``__dlpack__``, which makes that stream wait for the producer's (torch
records an event per tensor; jax waits for each buffer's own ready event). A call that
moves several arrays does better with :func:`cross`: torch tensors going to jax make
jax's stream for external buffers wait once, for one event on torch's current stream,
and are then exported without a handshake of their own (DLPack's ``stream=-1``) and
imported by jaxlib's own DLPack import (:mod:`interop.jaxlib_dlpack`); where they all go into one launch,
only the first on each device carries a ready event (:func:`cross`'s ``one_launch``).
jax arrays going to torch are exported with torch's current stream looked up once (jax
has no stream-wide event to wait for: each buffer carries its own, waited for on the
device, never on the host).
"""

from __future__ import annotations

import importlib
from typing import Sequence

import numpy as np

from interop.core.arrays import numpy_dtype
from interop.core.spec import DLPACK_DEVICE_NAMES, SATURATED_INDEX_RANGE, dtype_name, framework_of
from interop.jaxlib_dlpack import import_buffer


def to_torch(array):
    """A torch tensor over the same memory (see the module docstring for the exceptions)."""
    import torch

    if framework_of(array) == "torch":
        return array
    if isinstance(array, np.ndarray):
        name = dtype_name(array.dtype)
        if name in ("bfloat16", "float8_e4m3fn"):
            bits = np.int16 if name == "bfloat16" else np.uint8
            return torch.from_numpy(array.view(bits)).view(getattr(torch, name))
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


def to_jax(array):
    """A jax array over the same memory where DLPack allows; a documented copy where not."""
    import jax

    kind = framework_of(array)
    if kind == "jax":
        return array
    if kind == "torch":
        array = _torch_for_jax(array)
    elif isinstance(array, np.ndarray):
        # Host memory goes to jax's default device, where the kernel will run.
        from fusedkv_jax.indices import narrow_for_jax

        return jax.device_put(narrow_for_jax(array))
    return jax.dlpack.from_dlpack(array)


def _torch_for_jax(tensor):
    import torch

    if tensor.requires_grad:  # torch exports no tensor that requires grad
        tensor = tensor.detach()
    from fusedkv_jax.indices import jax_holds_int64

    if tensor.dtype == torch.int64 and not jax_holds_int64():
        tensor = tensor.clamp(*SATURATED_INDEX_RANGE).to(torch.int32)
    if not (tensor.is_contiguous() or _compact(tensor)):
        tensor = tensor.contiguous()
    return tensor


def _compact(tensor) -> bool:
    """Whether the strides are a permutation of a dense layout (what jax accepts)."""
    dims = sorted((stride, size) for stride, size in zip(tensor.stride(), tensor.shape) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def to_framework(array, framework: str):
    """``array`` as an array of ``framework`` (``'torch'`` or ``'jax'``)."""
    return to_torch(array) if framework == "torch" else to_jax(array)


def returns_to(caller: str) -> bool:
    """Whether :func:`to_caller` can hand results to ``caller``'s framework: NumPy, torch
    and jax always; another library when its top-level module has ``from_dlpack``."""
    if caller in ("numpy", "torch", "jax"):
        return True
    try:
        module = importlib.import_module(caller)
    except ImportError:
        return False
    return callable(getattr(module, "from_dlpack", None))


def to_caller(array, caller: str):
    """A backend's result handed back as an array of the caller's framework, zero-copy."""
    if framework_of(array) == caller:
        return array
    if caller == "numpy":
        return _to_numpy(array)
    if caller == "torch":
        return to_torch(array)
    if caller == "jax":
        return to_jax(array)
    return importlib.import_module(caller).from_dlpack(array)


def cross(arrays: Sequence, framework: str, *, one_launch: bool = False) -> list:
    """``[to_framework(a, framework) for a in arrays]`` (None stays None), with one stream
    handshake for the whole crossing (module docstring). Every array crosses on every
    call: a jax array kept over a torch tensor from an earlier call reads stale values
    once torch rewrites the tensor in place.

    ``one_launch``: the crossed arrays are read by one computation that takes them all
    (a backend's launch) and by nothing else. Torch tensors going to jax then carry one
    ready event per device between them, the first tensor's, and the others are
    imported as ready: that computation waits for every input's event, and the one
    event comes after all the work queued on torch's stream before the crossing, which
    includes every write to the others. Arrays handed on separately must not use it.
    """
    if all(array is None or framework_of(array) == framework for array in arrays):
        return list(arrays)
    if framework == "torch":
        return _cross_to_torch(arrays)
    return _cross_to_jax(arrays, one_launch)


def _cross_to_torch(arrays) -> list:
    import torch

    streams = {}
    crossed = []
    for array in arrays:
        if framework_of(array) != "jax":
            crossed.append(None if array is None else to_torch(array))
            continue
        device_type, device_id = array.__dlpack_device__()
        stream = None  # host memory: jax hands it over once written
        if int(device_type) in _DLPACK_GPU_DEVICES:
            stream = streams.get(device_id)
            if stream is None:
                current = torch.cuda.current_stream(int(device_id)).cuda_stream
                # DLPack names CUDA's legacy default stream 1 (0 would mean "no stream").
                stream = streams[device_id] = 1 if current == 0 else current
        crossed.append(torch.utils.dlpack.from_dlpack(array.__dlpack__(stream=stream)))
    return crossed


_DLPACK_GPU_DEVICES = tuple(code for code, name in DLPACK_DEVICE_NAMES.items() if name != "cpu")


def _cross_to_jax(arrays, one_launch: bool) -> list:
    import jax

    crossed = [None] * len(arrays)
    fresh = []  # (index, tensor made ready for jax, its CUDA index or None) of the torch tensors
    for index, array in enumerate(arrays):
        if framework_of(array) == "torch":
            tensor = _torch_for_jax(array)
            fresh.append((index, tensor, tensor.get_device() if tensor.is_cuda else None))
        elif array is not None:
            crossed[index] = to_jax(array)
    # After every tensor above is made ready for jax: that may queue work on torch's stream.
    ready_streams = {cuda_index: _order_jax_after_torch(cuda_index)
                     for cuda_index in {cuda_index for _, _, cuda_index in fresh} if cuda_index is not None}
    carried = set()  # the devices whose ready event a tensor of this crossing carries
    for index, tensor, cuda_index in fresh:
        if cuda_index is None:
            crossed[index] = import_buffer(tensor, jax.devices("cpu")[0], None)
            continue
        stream = ready_streams[cuda_index]
        if stream is None:
            crossed[index] = jax.dlpack.from_dlpack(tensor)
            continue
        if one_launch and cuda_index in carried:
            stream = None
        carried.add(cuda_index)
        crossed[index] = import_buffer(tensor, _jax_device(cuda_index), stream)
    return crossed


def _order_jax_after_torch(cuda_index: int):
    """Make the stream jax takes external buffers' readiness from, on CUDA device
    ``cuda_index``, wait for the work queued so far on torch's current stream there: one
    event, no host wait. Returns that stream: jax records each buffer it then imports as
    ready on it (after the wait), and its kernels wait for that before reading. None
    where jax has no such stream (its own ``from_dlpack`` then passes none either), and
    the tensors take DLPack's handshake."""
    import torch

    try:
        jax_stream = _jax_device(cuda_index).get_stream_for_external_ready_events()
    except Exception:  # a jax or platform without one: jax's from_dlpack falls back alike
        return None
    torch_stream = torch.cuda.current_stream(cuda_index)
    if torch_stream.cuda_stream != jax_stream:
        _torch_stream(jax_stream, cuda_index).wait_stream(torch_stream)
    return jax_stream


_JAX_DEVICES: dict[int, object] = {}
_TORCH_STREAMS: dict[tuple[int, int], object] = {}


def _jax_device(index: int):
    """jax's GPU with CUDA index ``index`` (its ``local_hardware_id``)."""
    device = _JAX_DEVICES.get(index)
    if device is None:
        import jax

        _JAX_DEVICES.update((d.local_hardware_id, d) for d in jax.local_devices(backend="gpu"))
        device = _JAX_DEVICES[index]
    return device


def _torch_stream(pointer: int, index: int):
    """jax's stream ``pointer`` as a torch stream (a wrapper only: jax owns the stream)."""
    stream = _TORCH_STREAMS.get((pointer, index))
    if stream is None:
        import torch

        stream = _TORCH_STREAMS[(pointer, index)] = torch.cuda.ExternalStream(pointer, device=index)
    return stream


def _to_numpy(array) -> np.ndarray:
    if framework_of(array) == "torch":
        name = dtype_name(array.dtype)
        if name in ("bfloat16", "float8_e4m3fn"):
            import torch

            bits = torch.int16 if name == "bfloat16" else torch.uint8
            return array.view(bits).numpy().view(numpy_dtype(name))
        return array.numpy()
    return np.asarray(array)
