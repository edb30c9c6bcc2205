"""Random device inputs for one shape and token count, rotated over enough sets to defeat the L2 cache.

Inputs are generated on the GPU in one framework (torch when it sees the GPU, else
jax) and handed to the other through DLPack without a copy, so every implementation
reads the very same bytes: ``kv`` gaussian (twice a standard normal, as
:func:`interop.testing.random_inputs` draws it), positions uniform below
:data:`~interop.bench.shapes.MAX_POSITION` (or, with ``positions="consecutive"``, a
sequence's context: counting up from a random start; with ``positions="sequences"``, a
batch of several sequences' contexts, :func:`sequence_positions`, drawn on the host
from the seed and then put on the device), and the small per-layer arrays from
``random_inputs`` itself.
"""

from __future__ import annotations

import math

import numpy as np

from interop.bench.shapes import MAX_POSITION, BenchShape
from interop.core.reference import rope_cos_sin_cache
from interop.exchange import to_framework
from interop.testing import random_inputs

POSITIONS = ("uniform", "consecutive", "sequences")  # how a workload draws its tokens' positions
SEQUENCE_TOKENS = 256  # the longest sequence of positions="sequences"

# The H200's L2 (60 MiB), used only where torch cannot read the device's.
FALLBACK_L2_BYTES = 60 * 2**20
MAX_INPUT_SETS = 64


def l2_bytes() -> int:
    """The GPU's L2 cache size as torch reports it, else :data:`FALLBACK_L2_BYTES`."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)
    except (ImportError, AttributeError):
        pass
    return FALLBACK_L2_BYTES


def input_sets_needed(bytes_per_set: int, cache_bytes: int | None = None) -> int:
    """How many input sets to rotate so repeated calls do not just measure the L2 cache.

    Enough that the sets together are about twice the cache, at most
    :data:`MAX_INPUT_SETS`; one where a single set is that large already.
    """
    rotation_bytes = 2 * (l2_bytes() if cache_bytes is None else cache_bytes)
    return max(1, min(MAX_INPUT_SETS, math.ceil(rotation_bytes / max(1, bytes_per_set))))


class _TorchRandom:
    def __init__(self, seed: int, device: str):
        import torch

        self._torch, self._device = torch, device
        self._generator = torch.Generator(device=device).manual_seed(seed)

    def normal(self, shape, dtype: str, scale: float):
        torch = self._torch
        values = torch.randn(shape, generator=self._generator, device=self._device, dtype=torch.float32)
        return (scale * values).to(getattr(torch, dtype))

    def positions(self, count: int):
        return self._torch.randint(0, MAX_POSITION, (count,), generator=self._generator, device=self._device,
                                   dtype=self._torch.int32)

    def consecutive_positions(self, count: int):
        torch = self._torch
        start = torch.randint(0, MAX_POSITION - count + 1, (1,), generator=self._generator, device=self._device)
        return (start + torch.arange(count, device=self._device)).to(torch.int32)

    def slots(self, count: int, num_slots: int):
        torch = self._torch
        return torch.randperm(num_slots, generator=self._generator, device=self._device)[:count].to(torch.int32)

    def put(self, host_array):
        return to_framework(host_array, "torch").to(self._device)


class _JaxRandom:
    def __init__(self, seed: int):
        import jax
        import jax.numpy as jnp

        self._jax, self._jnp = jax, jnp
        self._key = jax.random.key(seed)

    def _next_key(self):
        self._key, key = self._jax.random.split(self._key)
        return key

    def normal(self, shape, dtype: str, scale: float):
        values = self._jax.random.normal(self._next_key(), shape, self._jnp.float32)
        return (scale * values).astype(self._jnp.dtype(dtype))

    def positions(self, count: int):
        return self._jax.random.randint(self._next_key(), (count,), 0, MAX_POSITION, self._jnp.int32)

    def consecutive_positions(self, count: int):
        start = self._jax.random.randint(self._next_key(), (1,), 0, MAX_POSITION - count + 1, self._jnp.int32)
        return start + self._jnp.arange(count, dtype=self._jnp.int32)

    def slots(self, count: int, num_slots: int):
        return self._jax.random.permutation(self._next_key(), num_slots)[:count].astype(self._jnp.int32)

    def put(self, host_array):
        return to_framework(host_array, "jax")


def sequence_positions(rng: np.random.Generator, count: int) -> np.ndarray:
    """``int32[count]`` positions of a batch of sequences, one after another: each of 1 to
    :data:`SEQUENCE_TOKENS` tokens (uniform), counting up from its own random start with
    every token below :data:`~interop.bench.shapes.MAX_POSITION` (the last one cut at
    ``count``). A block of a kernel's tokens then holds a run or the end of one sequence
    and the start of the next, as in a serving batch."""
    lengths = rng.integers(1, SEQUENCE_TOKENS + 1, count)  # count sequences are always enough
    ends = np.cumsum(lengths)
    sequences = int(np.searchsorted(ends, count)) + 1
    lengths, firsts = lengths[:sequences], ends[:sequences] - lengths[:sequences]
    starts = rng.integers(0, MAX_POSITION - lengths + 1)
    sequence = np.repeat(np.arange(sequences), lengths)[:count]
    return (starts[sequence] + np.arange(count) - firsts[sequence]).astype(np.int32)


def _host_options(shape: BenchShape, host, seed: int) -> dict:
    """``v_multiplier: fp32[n_layers]`` drawn in [0.5, 2); ``cos_sin_tables: fp32[2, max_pos,
    rotary_dim]``, the shared table then one of another RoPE base, and ``layer_rope_table:
    int32[n_layers]`` alternating between them (a draft mixing two RoPEs, layer by layer)."""
    other = rope_cos_sin_cache(MAX_POSITION, shape.config.rotary_dim, base=1_000_000.0)
    return dict(v_multiplier=np.random.default_rng(seed).uniform(0.5, 2.0, shape.n_layers).astype(np.float32),
                cos_sin_tables=np.stack([np.asarray(host.cos_sin_cache, np.float32), other]),
                layer_rope_table=(np.arange(shape.n_layers) % 2).astype(np.int32))


class Workload:
    """The inputs of one (shape, token count, dtype): ``set_count`` sets of ``kv`` and
    positions, one set of per-layer arrays, and ``ctx_hidden`` and cache slot sets for
    the materializers (distinct slots of a paged cache of :attr:`num_slots` slots).

    ``framework`` is where the arrays are made; :meth:`op_args` and the other getters
    hand them to either framework (converted once, then kept). ``set_count`` defaults to
    what rotating ``kv`` alone past the L2 takes, and at least two. ``torch_device`` is
    where torch's arrays live (``"cpu"`` only to exercise the calls without a GPU);
    ``positions`` one of :data:`POSITIONS`.
    """

    def __init__(self, shape: BenchShape, total_ctx: int, dtype: str, *, framework: str, seed: int = 0,
                 set_count: int | None = None, torch_device: str = "cuda", positions: str = "uniform"):
        self.shape, self.total_ctx, self.dtype, self.framework = shape, total_ctx, dtype, framework
        self.torch_device = torch_device
        self.set_count = set_count or max(2, input_sets_needed(shape.kv_nbytes(total_ctx, dtype)))
        self._random = _TorchRandom(seed, torch_device) if framework == "torch" else _JaxRandom(seed)
        host = random_inputs(shape.config, n_layers=shape.n_layers, total_ctx=0, max_position=MAX_POSITION,
                             seed=seed)
        self._shared = tuple(self._random.put(a) for a in (host.k_norm_weight, host.eps, host.cos_sin_cache))
        self._options = {name: self._random.put(array) for name, array in _host_options(shape, host, seed).items()}
        self._kv = [self._random.normal(shape.kv_shape(total_ctx), dtype, 2.0) for _ in range(self.set_count)]
        if positions not in POSITIONS:
            raise ValueError(f"Invalid positions for the bench's workload: got {positions!r}, expected one of "
                             f"{POSITIONS}.")
        host_rng = np.random.default_rng(seed)
        draw = {"uniform": self._random.positions, "consecutive": self._random.consecutive_positions,
                "sequences": lambda count: self._random.put(sequence_positions(host_rng, count))}[positions]
        self._positions = [draw(total_ctx) for _ in range(self.set_count)]
        self._hidden: list = []
        self._slots: list = []
        self._converted: dict = {}

    @property
    def num_slots(self) -> int:
        """Slots of the paged caches the materializers write into: twice the tokens."""
        return 2 * self.total_ctx

    def sets(self, bytes_per_set: int) -> int:
        """How many of the sets an implementation moving ``bytes_per_set`` per call rotates over."""
        return min(self.set_count, max(2, input_sets_needed(bytes_per_set)))

    def _in(self, framework: str, key, array):
        if framework == self.framework:
            return array
        converted = self._converted.get((framework, key))
        if converted is None:
            converted = self._converted[(framework, key)] = to_framework(array, framework)
        return converted

    def shared(self, framework: str) -> tuple:
        """``(k_norm_weight, eps, cos_sin_cache)``."""
        return tuple(self._in(framework, ("shared", i), a) for i, a in enumerate(self._shared))

    def options(self, framework: str) -> dict:
        """The op's options for the rows of kind ``options``: ``v_multiplier``; ``cos_sin_tables``
        and ``layer_rope_table`` (see :func:`_host_options`)."""
        return {name: self._in(framework, ("options", name), array) for name, array in self._options.items()}

    def varying(self, index: int, framework: str) -> tuple:
        """``(kv, positions)`` of set ``index``."""
        return (self._in(framework, ("kv", index), self._kv[index]),
                self._in(framework, ("positions", index), self._positions[index]))

    def op_args(self, index: int, framework: str) -> tuple:
        """The op's five arrays for set ``index``: ``kv, k_norm_weight, eps, cos_sin_cache, positions``."""
        kv, positions = self.varying(index, framework)
        return (kv, *self.shared(framework), positions)

    def hidden(self, index: int, framework: str):
        """``ctx_hidden: dtype[total_ctx, hidden]`` of set ``index``, drawn on first use."""
        while len(self._hidden) <= index:
            self._hidden.append(self._random.normal((self.total_ctx, self.shape.hidden), self.dtype, 1.0))
        return self._in(framework, ("hidden", index), self._hidden[index])

    def slots(self, index: int, framework: str):
        """``cache_loc: int32[total_ctx]`` of set ``index``, distinct slots below
        :attr:`num_slots`, drawn on first use."""
        while len(self._slots) <= index:
            self._slots.append(self._random.slots(self.total_ctx, self.num_slots))
        return self._in(framework, ("slots", index), self._slots[index])
