"""Every implementation ``fusedkv bench`` measures: its name, framework, kind, and how to call it.

Kinds:

* ``kernel``: ours, the Triton kernel (torch) and the Pallas kernel (jax) on each of its
  lowerings: ``pallas`` on Triton (the default), ``pallas-mosaic`` on Mosaic GPU; and
  ``pallas-pdl``, ``pallas`` in a jit compiled with XLA's programmatic dependent launch
  (``xla_gpu_enable_pdl``), which lets a kernel's launch overlap the end of the one before;
* ``backward``: their backward kernels alone, ``triton-bwd``, ``pallas-bwd`` and ``pallas-mosaic-bwd``
  (:mod:`interop.bench.backward`), and a training step's forward and backward of the op
  beside autodiff of the baselines' math, ``triton-train``, ``torch-compile-train``,
  ``pallas-train``, ``jnp-jit-train`` (:mod:`interop.bench.training`), read against their
  framework's copy;
* ``baseline``: the op as a model author would write it (eager PyTorch, ``torch.compile``,
  jnp under ``jax.jit``, which XLA fuses); the fastest is the speed-up column's yardstick;
* ``copy``: a device copy of the op's bytes in the same framework (the "of copy" column);
* ``floor``: each kernel's data movement alone, in its own form
  (:mod:`interop.bench.triton_floors`, :mod:`interop.bench.floors`,
  :mod:`interop.bench.mosaic_floors`): ``triton-floor``, ``pallas-floor`` and
  ``pallas-mosaic-floor`` copy K and V unchanged, their ``-cos-sin`` rows also load each
  token's position and cos/sin row;
* ``materializer``: each materializer's GEMM alone, and the materializer end to end,
  into outputs, into a paged cache, and the flow it replaces
  (:mod:`interop.bench.materializers`);
* ``options``: the op with each of a draft's options, beside the plain op (``triton-*``
  beside ``triton``, ``pallas-*`` beside ``pallas``; :mod:`interop.bench.options`), and the
  materializers with FP8 weights beside their bf16 rows, each read against its own GEMM
  (``torch-gemm-fp8``, ``jax-gemm-fp8``);
* ``interop``: the backend-neutral call, in one framework and crossing between them;
* ``host``: an eager call, timed on the host (host dispatch, not device time), and
  ``triton-launch``, Triton's own launch of the compiled kernel the ``triton-host`` call
  runs, with its arguments ready: the floor under every eager call of it; and
  ``triton-launch-reads``, that launch after reading in Python the shape, dtype, device,
  address and strides of each tensor it is given.

The tiles and forms of ``--sweep`` and ``--forms`` are rows of kind ``sweep``
(:mod:`interop.bench.sweep`). A ``prepare`` function takes a
:class:`~interop.bench.workload.Workload` and returns :class:`~interop.bench.rows.Calls`
(torch's device rows and every host row) or :class:`~interop.bench.rows.Steps` (JAX's
device rows, run many to a jit), or raises :class:`~interop.bench.rows.NotApplicable`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

from interop.bench import backward, materializers, options, training
from interop.bench.baselines import jnp_reference_math, torch_reference_math
from interop.bench.check import copy_verdict, kv_copy_verdict, op_verdict
from interop.bench.report import on_gemm
from interop.bench.rows import Calls, Implementation, NotApplicable, Steps, nan_pair, op_calls, op_steps
from interop.bench.workload import Workload

__all__ = ["BY_NAME", "IMPLEMENTATIONS", "KINDS", "LAUNCH_FLOOR", "Calls", "Implementation", "NotApplicable",
           "Steps", "companions", "select", "unknown_words"]

KINDS = ("kernel", "backward", "baseline", "copy", "floor", "materializer", "options", "interop", "host")
# The custom call jax lowers a Mosaic GPU kernel to (jax 0.10-0.11).
MOSAIC_GPU_TARGET = "mosaic_gpu_v2"  # a regex of one name
LAUNCH_FLOOR = "triton-launch"
LAUNCH_READS = "triton-launch-reads"


def triton_calls(workload: Workload, **tile) -> Calls:
    """The Triton kernel writing into outputs of each set; ``tile`` reaches ``fusedkv_torch.fused_kv_norm_rope``."""
    from fusedkv_torch import fused_kv_norm_rope

    return op_calls(workload, "torch", functools.partial(fused_kv_norm_rope, **workload.shape.static(), **tile),
                    given_outputs=True)


def _triton_fresh(workload: Workload) -> Calls:
    from fusedkv_torch import fused_kv_norm_rope

    return op_calls(workload, "torch", functools.partial(fused_kv_norm_rope, **workload.shape.static()),
                    given_outputs=False)


def pallas_steps(workload: Workload, kernel_target: str | None = None, **options) -> Steps:
    """The Pallas kernel writing into the outputs it is given (donated through the chain);
    ``options`` reach ``fusedkv_jax.fused_kv_norm_rope`` (tiles, a lowering);
    ``kernel_target``: see :class:`~interop.bench.rows.Steps`."""
    from fusedkv_jax import fused_kv_norm_rope

    static = workload.shape.static()

    def step(fixed, varying, outputs):
        kv, positions = varying
        return fused_kv_norm_rope(kv, *fixed, positions, **static, k_out=outputs[0], v_out=outputs[1], **options)

    return op_steps(workload, step, kernel_target=kernel_target)


def captured_launches(call: Callable[[], object], kernel_class=None, launch_class=None) -> list[tuple]:
    """``(compiled, grid, args, kwargs)`` of every compiled Triton kernel that ``call()``
    launches, such that ``compiled[grid](*args, **kwargs)`` (Triton's public way to launch a
    compiled kernel) launches it again the same way: launches through that way
    (``kernel_class``: Triton's ``CompiledKernel``, or a stand-in) and through the direct
    launcher's ``launch_class`` (:class:`fusedkv_torch.launcher.Launch`, or a stand-in with
    its ``kernel`` and call)."""
    if kernel_class is None:
        from triton.compiler import CompiledKernel as kernel_class
    if launch_class is None:
        from fusedkv_torch.launcher import Launch as launch_class
    launches = []
    original_getitem, original_call = kernel_class.__getitem__, launch_class.__call__

    def recording_getitem(compiled, grid):
        runner = original_getitem(compiled, grid)

        def run(*args, **kwargs):
            launches.append((compiled, grid, args, kwargs))
            return runner(*args, **kwargs)
        return run

    def recording_call(launch, grid, stream, addresses, arguments):
        # Triton then reads the stream itself.
        launches.append((launch.kernel, (grid, 1, 1), (*addresses, *arguments), {}))
        return original_call(launch, grid, stream, addresses, arguments)

    kernel_class.__getitem__, launch_class.__call__ = recording_getitem, recording_call
    try:
        call()
    finally:
        kernel_class.__getitem__, launch_class.__call__ = original_getitem, original_call
    return launches


def _triton_launch(workload: Workload, read_arguments: bool = False) -> Calls:
    """Triton's own launch of the kernel that ``triton-host``'s call launches, with that
    call's arguments: what is left of an eager call once everything else is taken away.
    ``read_arguments``: before each launch, read in Python each given tensor's shape,
    dtype, device, address and strides (what a check of the call written in Python must
    read), and nothing more."""
    eager = triton_calls(workload)
    for _ in range(3):  # the first call compiles; later ones launch the compiled kernel directly
        k, v = eager.call(0)
    launches = captured_launches(lambda: eager.call(0))
    if len(launches) != 1:
        raise NotApplicable("the Triton call launched no compiled kernel of its own (interpreted, "
                            "or launched through kernel[grid])")
    compiled, grid, args, kwargs = launches[0]
    tensors = [array for array in (*workload.op_args(0, "torch"), k, v) if array is not None] if read_arguments else []

    def call(i):
        for tensor in tensors:
            tensor.shape, tensor.dtype, tensor.device, tensor.data_ptr(), tensor.stride()
        compiled[grid](*args, **kwargs)
        return k, v

    def check():
        k.fill_(float("nan"))
        v.fill_(float("nan"))
        return op_verdict(*call(0), *workload.op_args(0, "torch"), static=workload.shape.static())

    return Calls(call, 1, eager.bytes_moved, check)


# The XLA option that launches each kernel of a jit dependent on the one before, as the
# Triton kernel launches itself (a jit user sets it in XLA_FLAGS or jax.jit's compiler_options).
XLA_PDL = (("xla_gpu_enable_pdl", True),)


def _pallas_pdl(workload: Workload) -> Steps:
    return dataclasses.replace(pallas_steps(workload, lowering="triton"), compiler_options=XLA_PDL)


def _mosaic_interpreted(workload: Workload) -> bool:
    """Whether the Mosaic GPU rows run in its interpreter (``kv`` on the CPU); raises
    :class:`NotApplicable` where the Mosaic GPU kernel takes no such call."""
    from fusedkv_jax import mosaic_kernel

    config, total_ctx = workload.shape.config, workload.total_ctx
    if not mosaic_kernel.supports(config, workload.dtype):
        raise NotApplicable(f"no Mosaic GPU kernel for {workload.dtype} {config.rope_style}, "
                            f"head_dim {config.head_dim}, rotary {config.rotary_dim}")
    interpret = all(device.platform == "cpu" for device in workload.varying(0, "jax")[0].devices())
    if not mosaic_kernel.supports_context(total_ctx, interpret=interpret):
        raise NotApplicable(f"Mosaic GPU's interpreter takes multiples of {mosaic_kernel.BLOCK_TOKENS} tokens"
                            if interpret else "Mosaic GPU takes at most 8 tokens or a multiple of 8")
    return interpret


def _pallas_mosaic_backward(workload: Workload) -> Steps:
    """The Mosaic GPU lowering's backward kernel, where its forward takes the call."""
    interpret = _mosaic_interpreted(workload)
    return backward.pallas_backward(workload, lowering="mosaic_gpu",
                                    kernel_target=None if interpret else MOSAIC_GPU_TARGET)


def _pallas_mosaic(workload: Workload) -> Steps:
    """The Pallas kernel on its Mosaic GPU lowering, writing into the outputs it is given
    as the Triton lowering's row does."""
    interpret = _mosaic_interpreted(workload)
    # Interpreted, the kernel is no custom call but ordinary XLA work.
    return pallas_steps(workload, kernel_target=None if interpret else MOSAIC_GPU_TARGET, lowering="mosaic_gpu")


def _pallas_mosaic_cache(workload: Workload) -> Steps:
    """:func:`interop.bench.options.pallas_cache` on the Mosaic GPU lowering."""
    interpret = _mosaic_interpreted(workload)
    return options.pallas_cache(workload, lowering="mosaic_gpu", kernel_target=None if interpret else MOSAIC_GPU_TARGET)


def _pallas_mosaic_floor(workload: Workload, *, cos_sin: bool) -> Steps:
    """:func:`interop.bench.mosaic_floors.copy` over every input set, checked as a copy of K and V."""
    from interop.bench import mosaic_floors

    interpret = _mosaic_interpreted(workload)
    if workload.total_ctx % 8:
        raise NotApplicable("the Mosaic GPU floor copies tiles of 8 rows: a multiple of 8 tokens")
    config = workload.shape.config
    copy = functools.partial(mosaic_floors.copy, rotary_dim=config.rotary_dim, cos_sin=cos_sin, interpret=interpret)
    return _floor_steps(workload, copy, kernel_target=None if interpret else MOSAIC_GPU_TARGET)


def _pallas_eager(workload: Workload) -> Calls:
    from fusedkv_jax import fused_kv_norm_rope

    return op_calls(workload, "jax", functools.partial(fused_kv_norm_rope, **workload.shape.static()),
                    given_outputs=False)


def _torch_eager(workload: Workload) -> Calls:
    return op_calls(workload, "torch", functools.partial(torch_reference_math, config=workload.shape.config),
                    given_outputs=False)


@functools.cache
def _compiled_torch_math():
    """``torch.compile`` of the baseline, one for the whole run so sizes share compilations."""
    import torch

    # Three shapes and token counts of 1, 2 and more each compile their own graph: more
    # than dynamo's default limit, past which it would silently run the eager code.
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))
            break
    return torch.compile(torch_reference_math)


def _torch_compile(workload: Workload) -> Calls:
    return op_calls(workload, "torch", functools.partial(_compiled_torch_math(), config=workload.shape.config),
                    given_outputs=False)


def _jnp_steps(workload: Workload) -> Steps:
    config = workload.shape.config

    def step(fixed, varying, outputs):
        kv, positions = varying
        return jnp_reference_math(kv, *fixed, positions, config=config)

    return op_steps(workload, step, fresh_outputs=True)


def _jnp_eager(workload: Workload) -> Calls:
    import jax

    jitted = jax.jit(functools.partial(jnp_reference_math, config=workload.shape.config))
    return op_calls(workload, "jax", jitted, given_outputs=False)


def _triton_train(workload: Workload) -> Calls:
    from fusedkv_torch import fused_kv_norm_rope

    return training.torch_training(workload, functools.partial(fused_kv_norm_rope, **workload.shape.static()))


def _torch_compile_train(workload: Workload) -> Calls:
    return training.torch_training(workload, functools.partial(_compiled_torch_math(),
                                                               config=workload.shape.config))


def _pallas_train(workload: Workload) -> Steps:
    """The Pallas kernel's forward and backward, each one custom call a call (interpreted: XLA's work)."""
    from fusedkv_jax import devices, fused_kv_norm_rope

    interpret = devices.on_cpu(workload.varying(0, "jax")[0])
    return training.jax_training(
        workload, functools.partial(fused_kv_norm_rope, **workload.shape.static(), lowering="triton"),
        kernel_target=None if interpret else backward.PALLAS_TRITON_TARGET)


def _jnp_jit_train(workload: Workload) -> Steps:
    return training.jax_training(workload, functools.partial(jnp_reference_math, config=workload.shape.config))


def _pallas_floor(workload: Workload, *, cos_sin: bool) -> Steps:
    """:func:`interop.bench.floors.copy` over every input set, checked as a copy of K and V."""
    from interop.bench import floors

    config = workload.shape.config
    copy = functools.partial(floors.copy, rotary_dim=config.rotary_dim, rope_style=config.rope_style, cos_sin=cos_sin)
    return _floor_steps(workload, copy)


def _floor_steps(workload: Workload, copy: Callable, kernel_target: str | None = None) -> Steps:
    """A JAX floor, ``copy(kv, cos_sin_cache, positions, k_dest, v_dest, *, num_kv_heads,
    head_dim)``, over every input set, checked as a copy of K and V (``kernel_target``: see
    :class:`~interop.bench.rows.Steps`)."""
    config = workload.shape.config
    static = dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)

    def step(fixed, varying, outputs):
        kv, positions = varying
        return tuple(copy(kv, fixed[2], positions, *outputs, **static))

    steps = op_steps(workload, step, kernel_target=kernel_target)
    return dataclasses.replace(steps, check=lambda outputs, i: kv_copy_verdict(
        outputs, workload.varying(i, "jax")[0], **static))


def _triton_floor(workload: Workload, *, cos_sin: bool) -> Calls:
    """:func:`interop.bench.triton_floors.copy` over every input set, checked as a copy of K and V."""
    from interop.bench import triton_floors

    config = workload.shape.config
    static = dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    op_bytes = workload.shape.op_bytes(workload.total_ctx, workload.dtype)
    sets = workload.sets(op_bytes)
    args = [workload.op_args(i, "torch") for i in range(sets)]
    outputs = [nan_pair(workload, "torch") for _ in range(sets)]

    def call(i):
        kv, _, _, cos_sin_cache, positions = args[i]
        return triton_floors.copy(kv, cos_sin_cache, positions, *outputs[i], **static, rotary_dim=config.rotary_dim,
                                  rope_style=config.rope_style, cos_sin=cos_sin)

    return Calls(call, sets, op_bytes, lambda: kv_copy_verdict(call(0), args[0][0], **static))


def _torch_copy(workload: Workload) -> Calls:
    """``copy_`` of ``kv`` into a buffer of its size: the op's bytes, read and written."""
    import torch

    op_bytes = workload.shape.op_bytes(workload.total_ctx, workload.dtype)
    sets = workload.sets(op_bytes)
    sources = [workload.varying(i, "torch")[0] for i in range(sets)]
    destinations = [torch.full_like(source, float("nan")) for source in sources]

    def call(i):
        return destinations[i].copy_(sources[i])

    return Calls(call, sets, op_bytes, lambda: copy_verdict(call(0), sources[0]))


def _xla_copy(workload: Workload) -> Steps:
    """XLA's elementwise pass over ``kv`` (a negation: a copy would be elided), the op's bytes."""
    import jax.numpy as jnp

    kv_shape = workload.shape.kv_shape(workload.total_ctx)
    sets = workload.sets(workload.shape.kv_nbytes(workload.total_ctx, workload.dtype))

    def step(fixed, varying, outputs):
        return -varying[0]

    return Steps(step, (), [workload.varying(i, "jax") for i in range(sets)],
                 lambda: jnp.full(kv_shape, jnp.nan, jnp.dtype(workload.dtype)),
                 workload.shape.op_bytes(workload.total_ctx, workload.dtype),
                 lambda outputs, i: copy_verdict(outputs, workload.varying(i, "jax")[0], negated=True),
                 fresh_outputs=True)


def _interop(workload: Workload, *, caller: str, backend: str) -> Calls:
    """``interop.fused_kv_norm_rope`` on the caller's arrays, run by ``backend``."""
    from interop import dispatch

    return op_calls(workload, caller, functools.partial(dispatch.fused_kv_norm_rope, **workload.shape.static(),
                                                        backend=backend), given_outputs=False)


IMPLEMENTATIONS = (
    Implementation("triton", "torch", "kernel", triton_calls),
    Implementation("pallas", "jax", "kernel", functools.partial(pallas_steps, lowering="triton")),
    Implementation("pallas-mosaic", "jax", "kernel", _pallas_mosaic),
    Implementation("pallas-pdl", "jax", "kernel", _pallas_pdl),
    Implementation("triton-bwd", "torch", "backward", backward.triton_backward, does_op=False),
    Implementation("pallas-bwd", "jax", "backward", backward.pallas_backward, does_op=False),
    Implementation("pallas-mosaic-bwd", "jax", "backward", _pallas_mosaic_backward, does_op=False),
    Implementation("triton-train", "torch", "backward", _triton_train, does_op=False),
    Implementation("torch-compile-train", "torch", "backward", _torch_compile_train, does_op=False),
    Implementation("pallas-train", "jax", "backward", _pallas_train, does_op=False),
    Implementation("jnp-jit-train", "jax", "backward", _jnp_jit_train, does_op=False),
    Implementation("torch-eager", "torch", "baseline", _torch_eager, baseline=True),
    Implementation("torch-compile", "torch", "baseline", _torch_compile, baseline=True),
    Implementation("jnp-jit", "jax", "baseline", _jnp_steps, baseline=True),
    Implementation("torch-copy", "torch", "copy", _torch_copy, does_op=False),
    Implementation("triton-floor", "torch", "floor", functools.partial(_triton_floor, cos_sin=False), does_op=False),
    Implementation("triton-floor-cos-sin", "torch", "floor", functools.partial(_triton_floor, cos_sin=True),
                   does_op=False),
    Implementation("pallas-floor", "jax", "floor", functools.partial(_pallas_floor, cos_sin=False), does_op=False),
    Implementation("pallas-floor-cos-sin", "jax", "floor", functools.partial(_pallas_floor, cos_sin=True),
                   does_op=False),
    Implementation("pallas-mosaic-floor", "jax", "floor", functools.partial(_pallas_mosaic_floor, cos_sin=False),
                   does_op=False),
    Implementation("pallas-mosaic-floor-cos-sin", "jax", "floor",
                   functools.partial(_pallas_mosaic_floor, cos_sin=True), does_op=False),
    Implementation("xla-copy", "jax", "copy", _xla_copy, does_op=False),
    Implementation("torch-gemm", "torch", "materializer", materializers.torch_gemm, does_op=False),
    Implementation("torch-materializer", "torch", "materializer", materializers.torch_materialize,
                   does_op=False, gemm="torch-gemm"),
    Implementation("torch-materializer-cache", "torch", "materializer", materializers.torch_materialize_into_cache,
                   does_op=False, gemm="torch-gemm"),
    Implementation("torch-reference-flow", "torch", "materializer", materializers.torch_reference_flow,
                   does_op=False, gemm="torch-gemm"),
    Implementation("jax-gemm", "jax", "materializer", materializers.jax_gemm, does_op=False),
    Implementation("jax-materializer", "jax", "materializer", materializers.jax_materialize, does_op=False,
                   gemm="jax-gemm"),
    Implementation("jax-materializer-cache", "jax", "materializer", materializers.jax_materialize_into_cache,
                   does_op=False, gemm="jax-gemm"),
    *(Implementation(f"{kernel}-{option}", framework, "options", functools.partial(prepare, option=option),
                     beside=kernel)
      for kernel, framework, prepare in (("triton", "torch", options.triton_option),
                                         ("pallas", "jax", options.pallas_option))
      for option in options.OPTIONS),
    Implementation("pallas-cache", "jax", "options", functools.partial(options.pallas_cache, lowering="triton"),
                   beside="pallas"),
    Implementation("pallas-mosaic-cache", "jax", "options", _pallas_mosaic_cache, beside="pallas-mosaic"),
    Implementation("torch-gemm-fp8", "torch", "options", functools.partial(materializers.torch_gemm, fp8=True),
                   does_op=False, beside="torch-gemm"),
    Implementation("torch-materializer-fp8", "torch", "options",
                   functools.partial(materializers.torch_materialize, fp8=True), does_op=False, gemm="torch-gemm-fp8",
                   beside="torch-materializer"),
    Implementation("jax-gemm-fp8", "jax", "options", functools.partial(materializers.jax_gemm, fp8=True),
                   does_op=False, beside="jax-gemm"),
    Implementation("jax-materializer-fp8", "jax", "options", functools.partial(materializers.jax_materialize, fp8=True),
                   does_op=False, gemm="jax-gemm-fp8", beside="jax-materializer"),
    Implementation("interop-torch", "torch", "interop",
                   functools.partial(_interop, caller="torch", backend="torch"), clock="host"),
    Implementation("interop-jax", "jax", "interop",
                   functools.partial(_interop, caller="jax", backend="jax"), clock="host"),
    Implementation("interop-jax-to-torch", "jax->torch", "interop",
                   functools.partial(_interop, caller="jax", backend="torch"), clock="host"),
    Implementation("interop-torch-to-jax", "torch->jax", "interop",
                   functools.partial(_interop, caller="torch", backend="jax"), clock="host"),
    Implementation(LAUNCH_FLOOR, "torch", "host", _triton_launch, clock="host", does_op=False),
    Implementation(LAUNCH_READS, "torch", "host", functools.partial(_triton_launch, read_arguments=True),
                   clock="host", does_op=False),
    Implementation("triton-host", "torch", "host", triton_calls, clock="host"),
    Implementation("triton-host-fresh", "torch", "host", _triton_fresh, clock="host"),
    Implementation("pallas-host", "jax", "host", _pallas_eager, clock="host"),
    Implementation("torch-eager-host", "torch", "host", _torch_eager, clock="host", baseline=True),
    Implementation("torch-compile-host", "torch", "host", _torch_compile, clock="host", baseline=True),
    Implementation("jnp-jit-host", "jax", "host", _jnp_eager, clock="host", baseline=True),
    Implementation("torch-materializer-host", "torch", "host", materializers.torch_materialize, clock="host",
                   does_op=False),
    Implementation("jax-materializer-host", "jax", "host", materializers.jax_materialize_eager, clock="host",
                   does_op=False),
)
BY_NAME = {implementation.name: implementation for implementation in IMPLEMENTATIONS}
COPIES = {implementation.framework: implementation for implementation in IMPLEMENTATIONS
          if implementation.kind == "copy"}


def unknown_words(words: list[str]) -> list[str]:
    """The words that name neither an implementation nor a kind."""
    return [word for word in words if word not in BY_NAME and word not in KINDS]


def companions(implementation: Implementation) -> list[str]:
    """The rows ``implementation`` is read against, run whenever it runs: its framework's
    copy (device rows but the materializers', which are compared with their GEMM), its
    GEMM alone (materializers), the row without its option (options), Triton's own launch
    (host rows)."""
    names = []
    if implementation.clock == "device" and not on_gemm(implementation.kind, implementation.does_op):
        names.append(COPIES[implementation.framework].name)
    if implementation.gemm:
        names.append(implementation.gemm)
    if implementation.beside:
        names.append(implementation.beside)
    if implementation.clock == "host":
        names.append(LAUNCH_FLOOR)
    return names


def select(words: list[str] | None, frameworks_on_gpu, *,
           extra: Sequence[Implementation] = ()) -> tuple[list[Implementation], list[Implementation]]:
    """The implementations to run, in table order, and those skipped because a framework they
    need sees no GPU.

    ``words``: names and kinds (``None``: all); ``extra``: rows beyond the registry's (the
    sweep's), run after them. Each chosen row's :func:`companions` that can run are
    added, and theirs in turn. Unknown words raise ``ValueError`` naming them.
    """
    if words is None:
        chosen = set(BY_NAME)
    else:
        unknown = unknown_words(words)
        if unknown:
            raise ValueError(f"unknown implementations or kinds {unknown}, expected some of "
                             f"{list(BY_NAME)} or kinds {list(KINDS)}")
        chosen = {name for name, implementation in BY_NAME.items()
                  if name in words or implementation.kind in words}
    chosen |= {implementation.name for implementation in extra}
    candidates = [*IMPLEMENTATIONS, *extra]

    def runs(implementation: Implementation) -> bool:
        return set(implementation.frameworks) <= set(frameworks_on_gpu)

    by_name = {implementation.name: implementation for implementation in candidates}
    pending = sorted(chosen)
    while pending:  # a companion's own companions too (an FP8 row's bf16 twin's GEMM)
        implementation = by_name[pending.pop()]
        if runs(implementation):
            added = {name for name in companions(implementation) if name not in chosen and runs(BY_NAME[name])}
            chosen |= added
            pending += sorted(added)
    selected = [implementation for implementation in candidates if implementation.name in chosen]
    return ([implementation for implementation in selected if runs(implementation)],
            [implementation for implementation in selected if not runs(implementation)])
