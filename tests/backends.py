"""The two backends as the shared tests drive them, and where each runs.

A backend moves host (NumPy) arrays to where its kernel runs, calls its entry points
(``backend.kernel``: ``fused_kv_norm_rope``, ``fused_kv_norm_rope_into_cache``,
``FusedKVMaterializer``) and reads results back. ``interpret`` picks the kernel: True,
the interpreter on the CPU device (Triton's, Pallas interpret mode); False, the kernel
compiled for the GPU. A machine without a GPU runs only the interpreted kernels; a GPU
machine runs both, the interpreted torch kernel in a process started with
``TRITON_INTERPRET=1``, since Triton picks its interpreter once, at import
(``test_contract_op.py`` starts that process).
"""

from __future__ import annotations

import contextlib
import re

import numpy as np

from interop.core.arrays import as_numpy
from interop.core.spec import device_name


class Backend:
    """What both backends share; each says what it takes, as its refusal of other arrays
    words it, and what it refuses (``foreign``)."""

    name: str
    takes: str
    foreign_type: str
    # What follows a refusal's message (jax: a note on an error raised while it traces).
    message_tail = ""

    def error_pattern(self, message: str) -> str:
        """A ``pytest.raises(match=...)`` pattern for exactly ``message``."""
        return f"^{re.escape(message)}{self.message_tail}$"

    def assert_untouched(self, array, before: np.ndarray, name: str = "buffer") -> None:
        """``array`` still holds ``before``, bit for bit."""
        from interop.testing import assert_bit_exact

        assert_bit_exact(array, before, name=name)

    @property
    def device_name(self) -> str:
        """The device as validation messages name it."""
        return device_name(self.put(np.zeros(1, np.float32)))


class TorchBackend(Backend):
    name = "torch"
    takes = ("a torch.Tensor (fusedkv_torch takes torch tensors; interop.fused_kv_norm_rope takes arrays of any "
             "framework)")
    foreign_type = "numpy.ndarray"
    # Given outputs and caches are written in place and returned as given.
    writes_in_place = True

    def __init__(self, *, interpret: bool):
        import torch

        import fusedkv_torch

        self.torch, self.kernel, self.interpret = torch, fusedkv_torch, interpret
        self.device = "cpu" if interpret else "cuda"
        self.triton_interpreter = interpret

    def __repr__(self):  # as a falsifying example prints it, ready to paste
        return f"TorchBackend(interpret={self.interpret})"

    @staticmethod
    def unavailable(interpret: bool) -> str | None:
        """Why this process cannot run the kernel so, or None."""
        import torch

        from fusedkv_torch.kernel import _launcher

        if interpret and not _launcher.interpreted:
            return ("Triton compiles in this process; the interpreted twins run in one started "
                    "with TRITON_INTERPRET=1 (test_torch_twins_pass_under_the_triton_interpreter)")
        if not interpret and (_launcher.interpreted or not torch.cuda.is_available()):
            return "needs a CUDA device and Triton compiling (TRITON_INTERPRET unset)"
        return None

    def context(self):
        return contextlib.nullcontext()

    def put(self, host: np.ndarray):
        from interop.exchange import to_torch

        return to_torch(np.ascontiguousarray(host)).to(self.device, copy=True)

    def put_small(self, host: np.ndarray, on_host: bool):
        """Positions, slots or scales on the kernel's device, or left on the host (a CPU tensor)."""
        from interop.exchange import to_torch

        return to_torch(host.copy()) if on_host else self.put(host)

    def kv(self, host: np.ndarray, padding):
        """``kv`` as given (padding None) or as the columns between ``padding = (left, right)``
        extra columns of a wider GEMM workspace: a strided view."""
        if padding is None:
            return self.put(host)
        left, right = padding
        total_ctx, n_layers, width = host.shape
        workspace = self.torch.zeros((total_ctx, n_layers, left + width + right),
                                     dtype=getattr(self.torch, str(host.dtype)), device=self.device)
        view = workspace[:, :, left:left + width]
        view.copy_(self.put(host))
        return view

    def foreign(self, host: np.ndarray):
        """The array as another framework holds it (what this backend refuses)."""
        return host

    def gemm(self, hidden, weight):
        """``hidden @ weight^T`` by the framework's own GEMM."""
        return hidden @ weight.t()


class JaxBackend(Backend):
    name = "jax"
    takes = ("a jax or NumPy array (fusedkv_jax takes jax and NumPy arrays; interop.fused_kv_norm_rope takes "
             "arrays of any framework)")
    foreign_type = "torch.Tensor"
    message_tail = (r"(\n-+\nFor simplicity, JAX has removed its internal frames from the traceback of the "
                    r"following exception\. Set JAX_TRACEBACK_FILTERING=off to include these\.)?")
    # jax arrays are immutable: given outputs and caches are replaced by the returned arrays.
    writes_in_place = False
    triton_interpreter = False  # Pallas interpret mode rounds like XLA

    def __init__(self, *, interpret: bool):
        import jax

        import fusedkv_jax

        self.jax, self.kernel, self.interpret = jax, fusedkv_jax, interpret
        # The kernel runs interpreted where its arrays are on the CPU (interpret=None).
        self.device = jax.devices("cpu")[0] if interpret else jax.devices()[0]

    def __repr__(self):
        return f"JaxBackend(interpret={self.interpret})"

    @staticmethod
    def unavailable(interpret: bool) -> str | None:
        import jax

        if not interpret and jax.default_backend() != "gpu":
            return "needs a GPU (jax.default_backend() == 'gpu')"
        return None

    def context(self):
        """Arrays the test makes itself (``jnp.full``, NumPy arguments) land on the kernel's device."""
        return self.jax.default_device(self.device)

    def put(self, host: np.ndarray):
        """A jax array on the kernel's device; but an array of a dtype jax would narrow
        (float64, int64 with x64 off) stays NumPy, as the entry points take it, so that
        what they are given is the dtype the test names."""
        if self.jax.dtypes.canonicalize_dtype(host.dtype) != host.dtype:
            return host.copy()
        return self.jax.device_put(np.ascontiguousarray(host), self.device)

    def put_small(self, host: np.ndarray, on_host: bool):
        return host.copy() if on_host else self.put(host)

    def kv(self, host: np.ndarray, padding):
        if padding is None:
            return self.put(host)
        # jax arrays are dense: the slice of the wider workspace is a new array.
        left, right = padding
        total_ctx, n_layers, width = host.shape
        workspace = np.zeros((total_ctx, n_layers, left + width + right), host.dtype)
        workspace[:, :, left:left + width] = host
        return self.put(workspace)[:, :, left:left + width]

    def foreign(self, host: np.ndarray):
        from interop.exchange import to_torch

        return to_torch(host.copy())

    def gemm(self, hidden, weight):
        return self.jax.numpy.dot(hidden, weight.T)

    def assert_untouched(self, array, before: np.ndarray, name: str = "buffer") -> None:
        if hasattr(array, "is_deleted"):
            assert not array.is_deleted(), f"{name} was donated by a call that was refused"
        super().assert_untouched(array, before, name)


BACKENDS = {"torch": TorchBackend, "jax": JaxBackend}


def machine_interprets(name: str) -> bool:
    """Whether this process runs ``name``'s kernel interpreted when nothing says otherwise."""
    return BACKENDS[name].unavailable(interpret=False) is not None


def host(array) -> np.ndarray:
    """A host copy that shares no memory with ``array`` (a view would see later writes,
    and in jax block the buffer's donation)."""
    return np.array(as_numpy(array), copy=True)
