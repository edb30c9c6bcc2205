"""Compiles the Triton kernels (the forward and the backward) for a Hopper GPU without one (to
PTX and a cubin, which Triton's own ptxas builds), for every form a call can take: each
optional argument given or None (``layer_rope_table_ptr`` given: per-layer cos/sin tables),
both RoPE styles, with and without an unrotated tail (a gptj one also as part of the pairs), an
fp32 or a bf16 table; pointers and strides aligned as a launch on contiguous tensors finds them,
so the layouts compiled are the ones a launch compiles. Run by test_torch_kernel.py in a process
without TRITON_INTERPRET; exits non-zero on the first form that does not compile, printing it and
the compiler's error."""

import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedkv_torch import backward, kernel
from interop.core.spec import FusedKVConfig

OPTIONAL = ("k_norm_weight_ptr", "slots_ptr", "k_scale_ptr", "v_scale_ptr", "v_multiplier_ptr",
            "layer_rope_table_ptr")
TENSORS = {"kv_ptr": "*bf16", "k_norm_weight_ptr": "*fp32", "eps_ptr": "*fp32", "cos_sin_ptr": "*fp32",
           "positions_ptr": "*i32", "slots_ptr": "*i32", "k_dest_ptr": "*bf16", "v_dest_ptr": "*bf16",
           "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "v_multiplier_ptr": "*fp32",
           "layer_rope_table_ptr": "*i32"}


# Triton specializes a launch's 16-byte aligned pointers and its integers that are multiples of
# 16, and picks each load's and store's vector width and register layout from that.
_ALIGNED = [["tt.divisibility", 16]]


def _compile(function, present: dict, absent: set, sizes: dict) -> None:
    """``function`` compiled for Hopper: ``present`` tensors of their types, ``absent`` ones None,
    ``sizes`` constexprs, every other argument an i32: the strides of the rows and heads of
    ``kv`` and the outputs multiples of 16, as is the cos/sin table's row stride (its rotary
    dims) where it is one, the strides of their last dims 1."""
    signature, constants, attributes = {}, {}, {}
    for index, name in enumerate(function.arg_names):
        if name in present:
            signature[name] = present[name]
            attributes[(index,)] = _ALIGNED
        elif name in absent or name in sizes or name.endswith("_stride_d"):
            signature[name] = "constexpr"
            constants[(index,)] = None if name in absent else sizes.get(name, 1)
        else:
            signature[name] = "i32"
            aligned_table = name == "cos_sin_stride_p" and sizes["ROTARY_DIM"] % 16 == 0
            if name.split("_stride_")[-1] in ("t", "l", "row", "h") or aligned_table:
                attributes[(index,)] = _ALIGNED
    triton.compile(ASTSource(function, signature, constants, attributes), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4})


def _sizes(gptj: bool, tail: int, **more) -> dict:
    head_dim = 128
    config = FusedKVConfig(8, head_dim, head_dim - tail, "gptj" if gptj else "neox")
    blocks = kernel.piece_blocks(config, whole_rows=True)
    pieces = dict(zip(("PAIRED_DIM", "PAIR_BLOCK", "TAIL_BLOCK", "HEAD_BLOCK"), blocks))
    return dict(N_LAYERS=5, NUM_HEADS=8, HEAD_DIM=head_dim, ROTARY_DIM=head_dim - tail, GPTJ=gptj, BLOCK_T=2,
                BLOCK_HEADS=4, **pieces, **more)


def compile_form(given: set, gptj: bool, tail: int, table: str = "*fp32", weight_row: bool = False) -> None:
    absent = {name for name in OPTIONAL if name not in given}
    if "k_norm_weight_ptr" not in given:
        absent.add("eps_ptr")
    present = {name: dtype for name, dtype in TENSORS.items() if name not in absent}
    present["cos_sin_ptr"] = table
    for scale, destination in (("k_scale_ptr", "k_dest_ptr"), ("v_scale_ptr", "v_dest_ptr")):
        if scale in given:  # a scale comes with an fp8 cache
            present[destination] = "*fp8e4nv"
    _compile(kernel._fused_kv_norm_rope_kernel, present, absent,
             _sizes(gptj, tail, DEPENDENT_LAUNCH=True, WEIGHT_ROW=weight_row))


BACKWARD_OPTIONAL = ("k_norm_weight_ptr", "v_multiplier_ptr", "layer_rope_table_ptr")
BACKWARD_TENSORS = {"kv_ptr": "*bf16", "k_norm_weight_ptr": "*fp32", "eps_ptr": "*fp32", "cos_sin_ptr": "*fp32",
                    "positions_ptr": "*i32", "v_multiplier_ptr": "*fp32", "layer_rope_table_ptr": "*i32",
                    "grad_k_ptr": "*bf16", "grad_v_ptr": "*bf16", "grad_kv_ptr": "*bf16",
                    "weight_partials_ptr": "*fp32", "multiplier_partials_ptr": "*fp32"}
# Each partial sum exists with what it sums: the weight's with a K-norm, the multiplier's with one.
PARTIALS_OF = {"weight_partials_ptr": "k_norm_weight_ptr", "eps_ptr": "k_norm_weight_ptr",
               "multiplier_partials_ptr": "v_multiplier_ptr"}


def compile_backward_form(given: set, gptj: bool, tail: int) -> None:
    absent = {name for name in BACKWARD_TENSORS
              if PARTIALS_OF.get(name, name) in BACKWARD_OPTIONAL and PARTIALS_OF.get(name, name) not in given}
    present = {name: dtype for name, dtype in BACKWARD_TENSORS.items() if name not in absent}
    _compile(backward._fused_kv_norm_rope_backward_kernel, present, absent, _sizes(gptj, tail))


def main() -> int:
    forms = [set(), set(OPTIONAL)] + [set(OPTIONAL) - {name} for name in OPTIONAL]
    shapes = [(gptj, tail, "*fp32", False) for gptj, tail in itertools.product((False, True), (0, 64))]
    # A gptj row of rotary 32 of 128 is loaded as pairs throughout (kernel.piece_blocks); the
    # K-norm weight as one broadcast row (kernel.loads_one_weight_row), in both styles.
    shapes += [(False, 0, "*bf16", False), (True, 96, "*fp32", False), (False, 64, "*fp32", True),
               (True, 96, "*fp32", True)]
    # Rotary 40 of 128: rows of the table that Triton cannot know to be 16-byte aligned.
    shapes += [(gptj, 88, "*fp32", weight_row) for gptj, weight_row in itertools.product((False, True), (False, True))]
    for given, (gptj, tail, table, weight_row) in itertools.product(forms, shapes):
        try:
            compile_form(given, gptj, tail, table, weight_row)
        except Exception as error:  # the compiler's own errors, printed for the test's message
            print(f"given={sorted(given)} gptj={gptj} tail={tail} table={table} weight_row={weight_row}: "
                  f"{type(error).__name__}: {error}")
            return 1
    plain = [set(), {"k_norm_weight_ptr"}, {"v_multiplier_ptr"}, {"k_norm_weight_ptr", "v_multiplier_ptr"}]
    backward_forms = plain + [{"layer_rope_table_ptr"}, set(BACKWARD_OPTIONAL)]
    for given, (gptj, tail) in itertools.product(backward_forms, ((False, 0), (False, 64), (True, 0), (True, 64),
                                                                  (True, 96))):
        try:
            compile_backward_form(given, gptj, tail)
        except Exception as error:  # the compiler's own errors, printed for the test's message
            print(f"backward given={sorted(given)} gptj={gptj} tail={tail}: {type(error).__name__}: {error}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
