"""Interpret mode (a machine without a GPU) takes few, large programs in both kernels: the
interpreters pay per program, and a CPU run proves logic, not tiles. The GPU's tiles stay
as they were, and are what a compiled kernel gets."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from fusedkv_jax import devices  # noqa: E402
from fusedkv_jax.kernel import default_tile as pallas_default_tile  # noqa: E402
from fusedkv_torch.kernel import default_tile as triton_default_tile  # noqa: E402


@pytest.mark.parametrize("total_ctx, heads, head_dim, expected", [
    (16, 8, 128, (16, 8, 1)),        # the check's default: one program per layer
    (1, 8, 128, (1, 8, 1)),
    (19, 6, 96, (32, 2, 1)),         # the largest power of two dividing the heads; ragged tokens
    (100_000, 8, 128, (1024, 8, 1)),  # at most 2**20 elements of K per program
    (100_000, 1, 4096, (256, 1, 1)),
])
def test_interpreted_triton_tiles_hold_many_tokens_and_heads(total_ctx, heads, head_dim, expected):
    assert triton_default_tile(total_ctx, heads, head_dim, interpret=True) == expected
    assert triton_default_tile(total_ctx, heads, head_dim) != expected  # the GPU's own choice


@pytest.mark.parametrize("total_ctx, heads, head_dim, expected", [
    (16, 8, 128, (16, 8)),
    (19, 6, 96, (32, 8)),            # every head in one block, padded to a power of two
    (100_000, 8, 128, (1024, 8)),    # at most 2**20 elements of K per program
    (5, 2, 32, (8, 2)),
])
def test_interpreted_pallas_tiles_hold_many_tokens(total_ctx, heads, head_dim, expected, monkeypatch):
    assert pallas_default_tile(total_ctx, 5, heads, head_dim, interpret=True)[:2] == expected
    monkeypatch.setattr(devices, "multiprocessors", lambda: 132)  # an H200's
    assert pallas_default_tile(total_ctx, 5, heads, head_dim)[0] < expected[0]


def test_interpreted_pallas_tiles_keep_the_overrides_given():
    assert pallas_default_tile(16, 5, 8, 128, block_tokens=2, block_heads=4, num_warps=1, interpret=True) == (2, 4, 1)
