"""What ``fusedkv bench`` measures: the three shapes, the token counts, and the bytes a call must move."""

from __future__ import annotations

import dataclasses

from interop.core.arrays import numpy_dtype
from interop.core.spec import KV_DTYPES, FusedKVConfig

# Positions are drawn below this: the cos/sin table of a 32k-context draft.
MAX_POSITION = 32768

# Decode sizes (at most this many tokens): only there are host-dispatch rows worth their
# time, and the latency plot stops there.
DECODE_TOKENS = 1024

DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 32768, 65536)
QUICK_TOKENS = (16, 256, 4096, 32768)
DTYPES = KV_DTYPES


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """One draft configuration: the op's static arguments, its layers, and (for the
    materializers) the hidden size of the target model it reads."""

    name: str
    config: FusedKVConfig
    n_layers: int
    description: str
    hidden: int = 4096

    def static(self) -> dict:
        """The op's keyword arguments (``num_kv_heads``, ``head_dim``, ``rotary_dim``, ``rope_style``)."""
        return dict(num_kv_heads=self.config.num_kv_heads, head_dim=self.config.head_dim,
                    rotary_dim=self.config.rotary_dim, rope_style=self.config.rope_style)

    def kv_shape(self, total_ctx: int) -> tuple[int, int, int]:
        return (total_ctx, self.n_layers, 2 * self.config.kv_size)

    def output_shape(self, total_ctx: int) -> tuple[int, int, int, int]:
        return self.config.output_shape(self.n_layers, total_ctx)

    def kv_nbytes(self, total_ctx: int, dtype: str) -> int:
        return total_ctx * self.n_layers * 2 * self.config.kv_size * numpy_dtype(dtype).itemsize

    def op_bytes(self, total_ctx: int, dtype: str) -> int:
        """What the op cannot avoid moving: read ``kv`` once, write K and V once (``2 * kv.nbytes``).

        Not counted, as a copy of K and V does not move them: the weights and eps (a few
        KB), the positions, and the cos/sin row of each token's position (``rotary_dim``
        fp32 values a token, so 5% over these bytes in hd256, 1.3% in draft and 0.8% in
        rotary64). ``pallas-floor-cos-sin`` measures what loading them costs.
        """
        return 2 * self.kv_nbytes(total_ctx, dtype)

    def gemm_bytes(self, total_ctx: int, dtype: str) -> int:
        """What the materializer's GEMM cannot avoid: read the stacked weights and
        ``ctx_hidden``, write ``kv``."""
        itemsize = numpy_dtype(dtype).itemsize
        weights = self.n_layers * 2 * self.config.kv_size * self.hidden * itemsize
        return weights + total_ctx * self.hidden * itemsize + self.kv_nbytes(total_ctx, dtype)


SHAPES = {
    shape.name: shape for shape in (
        BenchShape("draft", FusedKVConfig(8, 128, 128, "neox"), 5,
                   "5 layers, 8 KV heads, head_dim 128 (a Qwen3-8B draft)"),
        BenchShape("hd256", FusedKVConfig(2, 256, 256, "neox"), 5,
                   "5 layers, 2 KV heads, head_dim 256"),
        BenchShape("rotary64", FusedKVConfig(4, 128, 64, "neox"), 8,
                   "8 layers, 4 KV heads, head_dim 128, rotary 64 of 128"),
    )
}
DRAFT_SHAPE = SHAPES["draft"]
