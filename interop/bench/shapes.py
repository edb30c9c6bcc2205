"""What ``fusedkv bench`` measures: the three shapes, the shape grid, the token counts, and the bytes a call must move.

The grid (``--shape grid``, :func:`grid_shapes`) is a fixed sample of draft
configurations drawn with :data:`GRID_SEED`: two halves of :data:`GRID_HALF_SIZE`, each
drawn so that every value of every axis (:data:`GRID_AXES`) appears in it, interleaved
so that the configurations numbered even are the ``fit`` half (tile rules may be fitted
on them) and the odd ones the ``held-out`` half (the rules are reported on them).
"""

from __future__ import annotations

import dataclasses
import random

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

GRID_SEED = 27
GRID_HALF_SIZE = 20
GRID_HALVES = ("fit", "held-out")
GRID_TOKENS = (1, 16, 64, 256, 1024, 4096, 32768)
# Rotary widths as fractions of head_dim: every one even for every grid head_dim.
ROTARY_FRACTIONS = {"full": 1, "half": 2, "quarter": 4}
GRID_AXES = {
    "head_dim": (64, 80, 96, 128, 192, 256),
    "num_kv_heads": (1, 2, 4, 8, 16, 32),
    "n_layers": (1, 2, 3, 5, 8),
    "rotary": tuple(ROTARY_FRACTIONS),
    "rope_style": ("neox", "gptj"),
    "dtype": DTYPES,
}
# A grid size whose kv and outputs together pass this is skipped, not drawn.
GRID_MAX_BYTES = 8 * 2**30
DTYPE_TAGS = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """One draft configuration: the op's static arguments, its layers, and (for the
    materializers) the hidden size of the target model it reads."""

    name: str
    config: FusedKVConfig
    n_layers: int
    description: str
    hidden: int = 4096
    dtype: str | None = None  # a grid configuration's own dtype; None: the run's
    half: str = ""  # a grid configuration's half, one of GRID_HALVES

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


def _axis_column(values: tuple, count: int, rng: random.Random) -> list:
    """``count`` draws of ``values``, each at least ``count // len(values)`` times, shuffled."""
    column = list(values) * (count // len(values)) + rng.sample(values, count % len(values))
    rng.shuffle(column)
    return column


def _grid_shape(index: int, draw: dict) -> BenchShape:
    head_dim, heads, layers = draw["head_dim"], draw["num_kv_heads"], draw["n_layers"]
    rotary = head_dim // ROTARY_FRACTIONS[draw["rotary"]]
    style, dtype = draw["rope_style"], draw["dtype"]
    name = f"g{index:02d}-hd{head_dim}-h{heads}-l{layers}-r{rotary}-{style}-{DTYPE_TAGS[dtype]}"
    description = (f"{layers} layer{'s' * (layers > 1)}, {heads} KV head{'s' * (heads > 1)}, head_dim {head_dim}, "
                   f"rotary {rotary}, {style}, {GRID_HALVES[index % 2]} half")
    return BenchShape(name, FusedKVConfig(heads, head_dim, rotary, style), layers, description, dtype=dtype,
                      half=GRID_HALVES[index % 2])


def grid_shapes(seed: int = GRID_SEED, half_size: int = GRID_HALF_SIZE) -> list[BenchShape]:
    """The shape grid: ``2 * half_size`` distinct configurations, the same for the same
    ``seed`` (module docstring); ``g00``, ``g02``... are the ``fit`` half."""
    rng = random.Random(seed)
    while True:
        halves = [list(zip(*(_axis_column(values, half_size, rng) for values in GRID_AXES.values())))
                  for _ in GRID_HALVES]
        draws = [draw for pair in zip(*halves) for draw in pair]
        if len(set(draws)) == len(draws):  # a configuration drawn twice: draw again
            break
    return [_grid_shape(index, dict(zip(GRID_AXES, draw))) for index, draw in enumerate(draws)]


GRID = {shape.name: shape for shape in grid_shapes()}
