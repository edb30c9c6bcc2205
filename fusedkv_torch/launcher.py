"""Launching a compiled Triton kernel again without Triton's per-call Python: the one module
that reads Triton's private API (its binder, ``JITFunction.device_caches``, a compiled
kernel's launcher and ``knobs.runtime``), each read with a fallback to ``kernel[grid]``;
``tests/test_private_doors.py`` fails when a supported Triton moves them.

``kernel[grid](*args)`` binds and specializes every argument, builds a cache key from
them, reads its settings and has the driver check every pointer, on every call: tens of
microseconds of host time for a kernel of some forty arguments, more than the kernel
itself runs at decode sizes. :class:`DirectLauncher` pays that once per specialization:
the first call of a new key goes through ``kernel[grid]``, which compiles, launches and
returns the compiled kernel; later calls of that key hand raw addresses and integers to
the compiled kernel's launcher, ``compiled.run``, with the current stream from Triton's
driver: what ``compiled[grid](*args)`` (Triton's public way to launch a compiled kernel)
does without building its runner and launch metadata on every call, which no launch hook
reads (launches a hook watches go through ``kernel[grid]``). The same on Triton 3.6 to
3.9; a compiled kernel without ``run``, ``function`` or ``packed_metadata`` is launched
through ``compiled[grid]``.

The key must decide what Triton specializes a compilation on, which on Triton 3.6 to
3.9 (``native_specialize_impl``) is: for a tensor its dtype and whether its address is
a multiple of 16 bytes; for an integer whether it fits 32 bits and, unless the kernel
lists it in ``do_not_specialize``, whether it is 1 or a multiple of 16; None is a
constant. The key holds exactly these. The first call of every key also compares them
with Triton's own binder and, if they ever disagree (a Triton that specializes
differently, or whose binder cannot be read), turns direct launches off for good: a
wrong guess costs host time, never a wrong kernel. Everything unusual takes
``kernel[grid]`` as before: the interpreter (``TRITON_INTERPRET=1``), a launch hook (a
profiler) or Triton's debug mode, a size argument past 32 bits, a tensor off the
current device (Triton then raises its own error).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

_INT32_END = 2**31
_MAX_INTEGER_KEYS = 1024


def specialization_key(addresses: Sequence[Optional[int]], ints: Sequence[int]) -> tuple:
    """What Triton specializes ``addresses`` (None for a None tensor) and specialized
    ``ints`` on, or finer, never coarser: the low four bits of every address; integers
    below 16 as they are, others up to 32 bits by their remainder modulo 16 (marked 16
    and up, so apart from the small ones), wider ones as they are."""
    return (*_address_key(addresses), *_integer_key(ints))


def _address_key(addresses: Sequence[Optional[int]]) -> list:
    return [address & 15 for address in addresses if address is not None]


def _integer_key(ints: Sequence[int]) -> list:
    return [value if value < 16 else 16 | value & 15 if value < _INT32_END else value for value in ints]


def expected_attributes(addresses: Sequence[Optional[int]], plain_ints: Sequence[int],
                        ints: Sequence[int]) -> list:
    """The attribute Triton's binder gives each runtime argument, by the rules the key assumes."""
    return ([None if address is None else "" if address & 15 else "D" for address in addresses]
            + [None] * len(plain_ints)
            + [1 if value == 1 else "" if value & 15 else "D" for value in ints])


class DirectLauncher:
    """``kernel[grid]`` for a kernel whose parameters are, in order: tensors (or None),
    integers in ``do_not_specialize``, other integers, then constexprs.

    ``interpreted`` is True under ``TRITON_INTERPRET=1``. ``direct`` is False where the
    kernel is interpreted or direct launches were turned off; benchmarks may set it to
    time Triton's own launch path.
    """

    def __init__(self, kernel):
        from triton import knobs

        self.kernel = kernel
        self.interpreted = not hasattr(kernel, "device_caches")  # the interpreter's, not a JITFunction
        self.direct = not self.interpreted
        self._runtime_knobs = knobs.runtime
        self._current_stream = None  # Triton's driver's, read at the first direct launch
        self._by_signature: dict[tuple, dict] = {}
        # The integers' part of the key, by the integers: a caller's strides take few
        # values, and the key costs more host time than looking it up.
        self._integer_keys: dict[tuple, tuple] = {}

    def __call__(self, grid: int, tensors: Sequence[Optional[torch.Tensor]], plain_ints: Sequence[int],
                 ints: tuple, constexprs: tuple, *, num_warps: int, launch_pdl: bool = False,
                 compiled: Optional[dict] = None) -> Optional["Launch"]:
        """Launch ``grid`` programs; the compiled kernel's :class:`Launch` (or its stand-in)
        where it was launched directly, which :meth:`relaunch` may launch again on
        arguments of the same key, else None.

        ``launch_pdl``: launch with programmatic dependent launch (Triton's option of that
        name), for a kernel that waits for its prerequisite grid itself.
        ``compiled``: the caller's dict for the compiled kernels of launches that agree
        in every tensor's dtype and device (and None-ness), ``constexprs``, ``num_warps``
        and ``launch_pdl``; the launcher keeps one per such signature when not given.
        """
        if self.direct and not self._observed() and max(plain_ints) < _INT32_END:
            if compiled is None:
                signature = (constexprs, num_warps, launch_pdl,
                             *[None if tensor is None else (tensor.dtype, tensor.get_device()) for tensor in tensors])
                compiled = self._by_signature.setdefault(signature, {})
            addresses = [None if tensor is None else tensor.data_ptr() for tensor in tensors]
            integer_key = self._integer_keys.get(ints)
            if integer_key is None:
                if len(self._integer_keys) >= _MAX_INTEGER_KEYS:
                    self._integer_keys.clear()
                integer_key = self._integer_keys[ints] = tuple(_integer_key(ints))
            device = torch.cuda.current_device()
            key = (device, *_address_key(addresses), *integer_key)
            launch = compiled.get(key)
            if launch is not None:
                launch(grid, self._current_stream(device), addresses, (*plain_ints, *ints, *constexprs))
                return launch
            self._compile_and_launch(compiled, key, grid, tensors, addresses, plain_ints, ints, constexprs,
                                     dict(num_warps=num_warps, launch_pdl=launch_pdl))
            return compiled.get(key)
        self.kernel[(grid,)](*tensors, *plain_ints, *ints, *constexprs, num_warps=num_warps, launch_pdl=launch_pdl)
        return None

    def relaunch(self, launch, grid: int, device: int, addresses: Sequence[Optional[int]], arguments: tuple) -> bool:
        """``launch``, returned by a call of this launcher on ``device`` (the current device),
        again on ``addresses`` (the tensors', None for a None tensor) of the same key and the
        rest of that call's ``arguments`` (its integers and constexprs), on the current
        stream; False, launching nothing, where a hook or debug mode now wants every launch
        through ``kernel[grid]``."""
        if self._observed():
            return False
        launch(grid, self._current_stream(device), addresses, arguments)
        return True

    def _observed(self) -> bool:
        """Whether Triton's debug mode is on or a hook watches launches (a profiler):
        those want every launch through ``kernel[grid]``."""
        knobs = self._runtime_knobs
        if knobs.debug:
            return True
        # A hook is None, a callable, or a HookChain (Triton 3.6 on) whose ``calls`` may be empty.
        for hook in (knobs.launch_enter_hook, knobs.launch_exit_hook):
            if hook is not None and getattr(hook, "calls", True):
                return True
        return False

    def _compile_and_launch(self, compiled, key, grid, tensors, addresses, plain_ints, ints, constexprs,
                            options: dict) -> None:
        """``kernel[grid]``, then keep the compiled kernel under ``key`` if Triton agrees with it."""
        args = (*tensors, *plain_ints, *ints, *constexprs)
        kernel = self.kernel[(grid,)](*args, **options)
        device = key[0]
        if any(tensor is not None and tensor.get_device() != device for tensor in tensors):
            return  # Triton launched it on the current device; never launch that directly
        try:
            kernel = kernel.result() if hasattr(kernel, "result") else kernel
            binder = self.kernel.device_caches[device][-1]
            _, specialization, _ = binder(*args, **options)
            expected = expected_attributes(addresses, plain_ints, ints)
            if [attribute for _, attribute in specialization[:len(expected)]] == expected:
                if self._current_stream is None:
                    self._current_stream = _driver_stream_getter()
                compiled[key] = _launch_of(kernel)
            else:
                self.direct = False
        except Exception:  # a Triton whose internals differ: launch through kernel[grid] from now on
            self.direct = False


def _driver_stream_getter():
    """Triton's driver's current stream by device, as ``compiled[grid]`` reads it."""
    from triton.runtime.driver import driver

    return driver.active.get_current_stream


def _launch_of(kernel):
    """``launch(grid, stream, addresses, arguments)`` of a compiled ``kernel``: :class:`Launch`,
    or ``kernel[grid]`` where the compiled kernel lacks the parts ``kernel[grid]`` hands its launcher."""
    if all(hasattr(kernel, name) for name in ("run", "function", "packed_metadata")):
        return Launch(kernel)
    return lambda grid, stream, addresses, arguments: kernel[(grid, 1, 1)](*addresses, *arguments, stream=stream)


class Launch:
    """A compiled kernel's launcher on a one-axis grid, with no launch metadata or hooks (no
    hook watches a direct launch). ``kernel``: the compiled kernel, whose ``kernel[grid]``
    launches it the same way through Triton."""

    __slots__ = ("kernel", "_run", "_function", "_metadata")

    def __init__(self, kernel):
        self.kernel = kernel
        self._run, self._function, self._metadata = kernel.run, kernel.function, kernel.packed_metadata

    def __call__(self, grid: int, stream: int, addresses: Sequence[Optional[int]], arguments: tuple) -> None:
        """Launch ``grid`` programs on ``stream`` with the kernel's tensors at ``addresses``
        (None for a None tensor) and the rest of its ``arguments``."""
        self._run(grid, 1, 1, stream, self._function, self._metadata, None, None, None, *addresses, *arguments)
