"""Random inputs for tests, the ``check`` command and benchmarks: one generator for all."""

from __future__ import annotations

import dataclasses

import numpy as np

from interop.arrays import numpy_dtype
from interop.reference import rope_cos_sin_cache
from interop.spec import FusedKVConfig


@dataclasses.dataclass(frozen=True)
class OpInputs:
    """Host (NumPy) arguments of one call, in the op's argument order."""

    kv: np.ndarray
    k_norm_weight: np.ndarray
    eps: np.ndarray
    cos_sin_cache: np.ndarray
    positions: np.ndarray

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.kv, self.k_norm_weight, self.eps, self.cos_sin_cache, self.positions)


def random_inputs(
    config: FusedKVConfig,
    *,
    n_layers: int,
    total_ctx: int,
    dtype: str = "bfloat16",
    max_position: int = 32768,
    position_dtype: str = "int32",
    weight_dtype: str = "float32",
    seed: int = 0,
) -> OpInputs:
    """Fresh random inputs: gaussian kv, weights near 1, eps in [1e-6, 1e-5), random positions."""
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((total_ctx, n_layers, 2 * config.kv_size), dtype=np.float32)
    k_norm_weight = 1.0 + 0.25 * rng.standard_normal((n_layers, config.head_dim), dtype=np.float32)
    eps = rng.uniform(1e-6, 1e-5, size=n_layers).astype(np.float32)
    positions = rng.integers(0, max_position, size=total_ctx)
    return OpInputs(
        kv=(2.0 * kv).astype(numpy_dtype(dtype)),
        k_norm_weight=k_norm_weight.astype(numpy_dtype(weight_dtype)),
        eps=eps,
        cos_sin_cache=rope_cos_sin_cache(max_position, config.rotary_dim),
        positions=positions.astype(numpy_dtype(position_dtype)),
    )
