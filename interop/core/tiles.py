"""Tiling rules both kernels share."""

from __future__ import annotations

# An interpreter (Triton's, Pallas interpret mode) pays per program in Python, while NumPy
# does a tile's arithmetic in microseconds: a CPU run proves logic, not tiles, so it takes
# few programs over tiles of up to this many K elements.
INTERPRETED_TILE_ELEMENTS = 1 << 20


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def interpreted_block_tokens(total_ctx: int, block_heads: int, head_dim: int) -> int:
    """Tokens per program in an interpreter: the power of two of tokens, at most the
    context's, whose ``[tokens, block_heads, head_dim]`` tile fits INTERPRETED_TILE_ELEMENTS."""
    fitting = max(1, INTERPRETED_TILE_ELEMENTS // (block_heads * next_power_of_2(head_dim)))
    return min(next_power_of_2(max(1, total_ctx)), 1 << (fitting.bit_length() - 1))
