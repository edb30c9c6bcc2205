"""The one door to a private jaxlib call: importing a torch tensor's DLPack capsule.

``jax.dlpack.from_dlpack`` wraps jaxlib's import in Python that checks what a crossing
(:func:`interop.exchange.cross`) has already made sure of; calling jaxlib's import
directly saves that per array. It is private API, so it is looked up once, used only
where its signature is the one known, and every failure falls back to the public
``from_dlpack`` for good (``tests/test_interop_dispatch.py`` fails when the private
path is gone from a supported jaxlib).
"""

from __future__ import annotations

from interop.core.spec import DLPACK_DEVICE_NAMES


def import_buffer(tensor, device, ready_stream):
    """``jax.dlpack.from_dlpack(tensor)`` for a tensor jax may read once ``ready_stream``
    (None: at once) has run: exported without a handshake (DLPack's ``stream=-1``: the
    crossing ordered it; the CPU has no streams) and imported by the jaxlib call that
    ``from_dlpack`` makes, without ``from_dlpack``'s Python around it (checks a crossing
    makes once, and an ``asarray`` that changes nothing for dtypes of 32 bits or fewer).
    64-bit dtypes, which jax narrows with x64 off,
    and a jaxlib whose call differs take ``from_dlpack`` (with DLPack's own handshake
    where ``ready_stream`` is None: slower, never less ordered)."""
    global _IMPORT_BUFFER
    if _IMPORT_BUFFER is _UNRESOLVED:
        _IMPORT_BUFFER = _jaxlib_import_buffer()
    if _IMPORT_BUFFER is not None and tensor.element_size() <= 4:
        try:
            return _IMPORT_BUFFER(tensor.__dlpack__(stream=-1 if tensor.is_cuda else None), device,
                                  ready_stream, None, _DLPACK_DEVICE_TYPES[device.platform])
        except TypeError:  # another jaxlib's signature: from_dlpack from now on
            _IMPORT_BUFFER = None
    import jax

    return jax.dlpack.from_dlpack(tensor if ready_stream is None else _HandshakeDone(tensor))


def _jaxlib_import_buffer():
    """jaxlib's DLPack import as ``jax.dlpack.from_dlpack`` calls it from jaxlib extension
    467 on: ``(capsule, device, stream, copy, DLPack device type)``; None before."""
    try:
        from jax._src.lib import _jax, jaxlib_extension_version
    except ImportError:
        return None
    return _jax.dlpack_managed_tensor_to_buffer if jaxlib_extension_version >= 467 else None


# jax platform -> DLPack device type, from the one table of the core.
_DLPACK_DEVICE_TYPES = {"cpu": 1, "gpu": 2, **{name: code for code, name in DLPACK_DEVICE_NAMES.items() if name != "cpu"}}
_UNRESOLVED = object()
_IMPORT_BUFFER = _UNRESOLVED  # jaxlib's import, looked up at the first crossing to jax


class _HandshakeDone:
    """A torch tensor that jax imports without DLPack's per-tensor handshake: the
    crossing already made jax's stream wait for torch's (:func:`_order_jax_after_torch`).
    ``stream=-1`` is DLPack's "no synchronization"."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, *, stream=None, **kwargs):
        return self.tensor.__dlpack__(stream=-1, **kwargs)
