"""Host cost of the eager entry points (issue #13's table) and of their pieces, on a GPU machine.

    PYTHONPATH=. python3 benchmarks/host_path.py [--calls N] [--loops N] [--cpu]

Imports the project from the tree it runs in. Every row is a host loop of N calls
(1000) timed with perf_counter, the device synchronised before each loop and not
inside it; the table gives the median and the minimum of the loops' per-call times
(5 loops), in microseconds. Shape: 16 tokens, 5 layers, 8 KV heads, head_dim 128, bf16.
A failing row prints its error and the rest go on. Every path is first checked against
the NumPy reference. The entry points are timed first and again last, after every
piece has run (the host's first rows ran up to 2x slower on the H200, S5-2/S5-3); the
summary judges the last. The floors: Triton's runner alone, and with each tensor's
metadata read once (what any eager launch reads); jaxlib's DLPack import per array. The
step-by-step sections time a crossing interop call's steps (jax->torch, torch->jax)
inside the call, dropping the results included, where the pieces (timed on arrays kept
alive) fall short of the whole call; and the same calls in loops that keep every result
alive, against loops that drop each at the next call. The crossing calls are also timed,
in alternated rounds, against the same work written with the libraries' calls alone: once
with their public calls, once with the fewest calls a correct crossing makes (the floor
of a crossing call timed as it runs, in a loop).
``--cpu``: a dry run on a machine without a GPU (interpreted kernels).
"""

import argparse
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

parser = argparse.ArgumentParser()
parser.add_argument("--calls", type=int, default=1000)
parser.add_argument("--loops", type=int, default=5)
parser.add_argument("--cpu", action="store_true", help="a dry run of the script on a machine without a GPU")
options = parser.parse_args()
if options.cpu:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import interop  # noqa: E402
import fusedkv_jax  # noqa: E402
import fusedkv_torch  # noqa: E402
from interop import exchange, spec  # noqa: E402
from interop.exchange import to_jax, to_torch  # noqa: E402
from interop.core.reference import fused_kv_norm_rope_reference  # noqa: E402
from interop.core.spec import FusedKVConfig  # noqa: E402
from interop.testing import assert_bit_exact, assert_close, random_inputs  # noqa: E402

print(f"tree: {os.path.abspath(interop.__file__)}")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, jax {jax.__version__}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
try:
    import subprocess
    print("commit:", subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.dirname(os.path.abspath(interop.__file__)))
                                    ).stdout.strip())
except Exception:
    pass

DEVICE = "cpu" if options.cpu else "cuda"


def synchronize():
    if not options.cpu:
        torch.cuda.synchronize()  # the whole device: jax's streams too

CONFIG = FusedKVConfig(8, 128, 128)
STATIC = dict(num_kv_heads=8, head_dim=128, rotary_dim=128)
inputs = random_inputs(CONFIG, n_layers=5, total_ctx=16, max_position=4096, seed=0)
t_args = [to_torch(a).to(DEVICE, copy=True) for a in inputs.arrays()]
j_args = [jax.device_put(a) for a in inputs.arrays()]
jax.block_until_ready(j_args)
OUT_SHAPE = (5, 16, 8, 128)
k_out = torch.empty(OUT_SHAPE, dtype=torch.bfloat16, device=DEVICE)
v_out = torch.empty_like(k_out)
add_a = torch.ones(1024, device=DEVICE)
add_b = torch.ones(1024, device=DEVICE)
synchronize()

ROWS = []


def section(title):
    print(f"\n## {title}")
    print(f"{'row':66s} {'median':>9s} {'min':>9s}  (us per call)")


def timed(name, fn, calls=None):
    calls = calls or options.calls
    try:
        fn()
        synchronize()
        per_call = []
        for _ in range(options.loops):
            synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call.append((time.perf_counter() - start) / calls * 1e6)
        synchronize()
        median, best = statistics.median(per_call), min(per_call)
        ROWS.append((name, median, best))
        print(f"{name:66s} {median:9.2f} {best:9.2f}", flush=True)
    except Exception as error:
        ROWS.append((name, None, None))
        print(f"{name:66s} ERROR {type(error).__name__}: {str(error)[:300]}", flush=True)


def attempt(name, fn):
    """Run ``fn`` once, printing its error (with the traceback's last lines) instead of stopping."""
    try:
        return fn()
    except Exception as error:
        print(f"{name}: ERROR {type(error).__name__}: {str(error)[:300]}")
        print("".join(traceback.format_exc().splitlines(keepends=True)[-6:]))
        return None


# Correctness first: a timing of a wrong path is worth nothing.
section("check: results against the NumPy reference")
k_ref, v_ref = fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC)


def check(name, call):
    def run():
        k, v = call()
        assert_close(k, k_ref)
        assert_bit_exact(v, v_ref)
        print(f"{name}: ok")
    attempt(name, run)


check("fusedkv_torch", lambda: fusedkv_torch.fused_kv_norm_rope(*t_args, **STATIC))
check("fusedkv_jax", lambda: fusedkv_jax.fused_kv_norm_rope(*j_args, **STATIC))
check("interop torch->torch", lambda: interop.fused_kv_norm_rope(*t_args, **STATIC, backend="torch"))
check("interop torch->jax", lambda: interop.fused_kv_norm_rope(*t_args, **STATIC, backend="jax"))
check("interop jax->torch", lambda: interop.fused_kv_norm_rope(*j_args, **STATIC, backend="torch"))
check("interop jax->jax", lambda: interop.fused_kv_norm_rope(*j_args, **STATIC, backend="jax"))


def given_torch_outputs_torch_to_jax():
    k, v = interop.fused_kv_norm_rope(*t_args, **STATIC, k_out=k_out, v_out=v_out, backend="jax")
    assert k is k_out and v is v_out
    return k, v


check("interop torch->jax, outputs given", given_torch_outputs_torch_to_jax)

def entry_points(title):
    section(title)
    timed("torch.add of 1024 floats", lambda: torch.add(add_a, add_b))
    timed("fusedkv_torch.fused_kv_norm_rope, outputs given",
          lambda: fusedkv_torch.fused_kv_norm_rope(*t_args, **STATIC, k_out=k_out, v_out=v_out))
    timed("fusedkv_torch.fused_kv_norm_rope, fresh outputs", lambda: fusedkv_torch.fused_kv_norm_rope(*t_args, **STATIC))
    timed("interop, torch caller, torch backend, fresh outputs",
          lambda: interop.fused_kv_norm_rope(*t_args, **STATIC, backend="torch"))
    timed("interop, torch caller, torch backend, outputs given",
          lambda: interop.fused_kv_norm_rope(*t_args, **STATIC, k_out=k_out, v_out=v_out, backend="torch"))
    timed("fusedkv_jax.fused_kv_norm_rope (eager; the 'jax call')", lambda: fusedkv_jax.fused_kv_norm_rope(*j_args, **STATIC))
    timed("interop, torch caller, jax backend, fresh outputs",
          lambda: interop.fused_kv_norm_rope(*t_args, **STATIC, backend="jax"))
    timed("interop, torch caller, jax backend, outputs given",
          lambda: interop.fused_kv_norm_rope(*t_args, **STATIC, k_out=k_out, v_out=v_out, backend="jax"))
    timed("interop, jax caller, jax backend", lambda: interop.fused_kv_norm_rope(*j_args, **STATIC, backend="jax"))
    timed("interop, jax caller, torch backend", lambda: interop.fused_kv_norm_rope(*j_args, **STATIC, backend="torch"))


entry_points("entry points (issue #13's table), first")

section("torch direct call, piece by piece (outputs given)")
from fusedkv_torch import ops  # noqa: E402
from fusedkv_torch import kernel as torch_kernel  # noqa: E402

prepare_args = (*t_args, 8, 128, 128, "neox", k_out, v_out)
timed("ops.prepare_call (check_arrays, memo, check_output_buffers)", lambda: ops.prepare_call(*prepare_args))
prepared = attempt("prepare_call", lambda: ops.prepare_call(*prepare_args))
if prepared is not None:
    timed("PreparedCall.launch (positions device, plan, _launch)",
          lambda: prepared.launch(*t_args, k_out, v_out, False))
    timed("kernel._launch(plan, ...) (args, DirectLauncher, Triton runner)",
          lambda: torch_kernel._launch(prepared.plan, *t_args, k_out, v_out, None, None, None, prepared.compiled))
outputs = (("k_out", k_out), ("v_out", v_out))
named = (("kv", t_args[0]), ("k_norm_weight", t_args[1]), ("eps", t_args[2]), ("cos_sin_cache", t_args[3]),
         ("positions", t_args[4]), *outputs)
timed("spec.check_arrays (7 tensors)", lambda: spec.check_arrays(named, "torch"))
timed("spec.accept_call (remembered)", lambda: spec.accept_call(*t_args, k_out, v_out, **STATIC))
timed("spec.call_signature", lambda: spec.call_signature("call", "torch", (*t_args, k_out, v_out), 8, 128, 128, "neox"))
timed("spec.check_output_buffers (k_out, v_out)", lambda: spec.check_output_buffers(t_args[0], outputs))
timed("validate_call in full (what the memo saves)",
      lambda: spec.validate_call(*t_args, **STATIC, k_out=k_out, v_out=v_out, check_buffers=False))
timed("kv.new_empty(output shape) (one fresh output)", lambda: t_args[0].new_empty(OUT_SHAPE))
timed("torch.compiler.is_compiling()", torch.compiler.is_compiling)
timed("torch.cuda.current_device()", torch.cuda.current_device)


def launcher_pieces():
    """The direct launch's own steps, as DirectLauncher runs them for this call."""
    from fusedkv_torch.launcher import specialization_key

    grid, constexprs, num_warps, dependent_launch = prepared.plan
    kv, weight, eps, cos_sin, positions = t_args
    tensors = (kv, weight, eps, cos_sin, positions, None, k_out, v_out, None, None)
    plain_ints = (kv.shape[0], cos_sin.shape[0], k_out.shape[1])
    ints = (*kv.stride(), *weight.stride(), *eps.stride(), *cos_sin.stride(), *positions.stride(), 0, 0, 0,
            *k_out.stride(), *v_out.stride())
    addresses = [None if t is None else t.data_ptr() for t in tensors]
    key = (torch.cuda.current_device(), *specialization_key(addresses, ints))
    compiled = prepared.compiled.get(key)
    timed("  tensor addresses (10 data_ptr)", lambda: [None if t is None else t.data_ptr() for t in tensors])
    timed("  strides and sizes (7 stride())", lambda: (*kv.stride(), *weight.stride(), *eps.stride(),
                                                      *cos_sin.stride(), *positions.stride(), *k_out.stride(),
                                                      *v_out.stride()))
    timed("  specialization_key", lambda: specialization_key(addresses, ints))
    timed("  DirectLauncher._observed()", torch_kernel._launcher._observed)
    if compiled is None:
        print("  (no compiled kernel under this key; direct launches on:", torch_kernel._launcher.direct, ")")
        return
    timed("  compiled[(grid, 1, 1)](*args) (Triton's runner, the floor)",
          lambda: compiled[(grid, 1, 1)](*addresses, *plain_ints, *ints, *constexprs))

    def floor():
        # What any eager launch of this kernel reads: each tensor's shape, dtype, device,
        # address and strides, once; then Triton's runner.
        for t in (kv, weight, eps, cos_sin, positions, k_out, v_out):
            t.shape, t.dtype, t.device, t.data_ptr(), t.stride()
        compiled[(grid, 1, 1)](*addresses, *plain_ints, *ints, *constexprs)

    timed("  floor: read each tensor's metadata once + Triton's runner", floor)
    from triton.runtime import driver
    timed("  triton driver get_current_stream", lambda: driver.active.get_current_stream(
        driver.active.get_current_device()))


if prepared is not None:
    attempt("launcher pieces", launcher_pieces)

section("crossing torch -> jax, piece by piece")


def torch_to_jax_pieces():
    kv_t, weight_t, eps_t, cos_sin_t, positions_t = t_args
    jax_device = None if options.cpu else attempt("jax device", lambda: jax.local_devices(backend="gpu")[0])
    if jax_device is not None:
        timed("jax device.get_stream_for_external_ready_events()", jax_device.get_stream_for_external_ready_events)
    timed("torch.cuda.current_stream()", torch.cuda.current_stream)
    timed("torch.cuda.Event() + record", lambda: torch.cuda.Event().record())
    timed("the handshake: exchange._order_jax_after_torch (one event)",
          lambda: exchange._order_jax_after_torch(kv_t.get_device()))
    timed("jax.dlpack.from_dlpack(kv) (DLPack's own per-tensor handshake)", lambda: jax.dlpack.from_dlpack(kv_t))
    timed("jax.dlpack.from_dlpack(positions)", lambda: jax.dlpack.from_dlpack(positions_t))
    timed("torch kv.__dlpack__(stream=-1) (no handshake)", lambda: kv_t.__dlpack__(stream=-1))
    if jax_device is not None:
        jax_stream = jax_device.get_stream_for_external_ready_events()
        timed("torch kv.__dlpack__(stream=jax's) (records one event)", lambda: kv_t.__dlpack__(stream=jax_stream))
    timed("jax.dlpack.from_dlpack(kv without handshake)",
          lambda: jax.dlpack.from_dlpack(exchange._HandshakeDone(kv_t)))
    timed("exchange.to_jax(kv) (one tensor, its own handshake)", lambda: to_jax(kv_t))
    timed("[to_jax(a) for the 5 inputs] (per-array handshakes: what cross replaces)", lambda: [to_jax(a) for a in t_args])
    if jax_device is not None:
        stream = jax_device.get_stream_for_external_ready_events()
        timed("exchange._import(kv) (jaxlib's import, no handshake: the floor per array)",
              lambda: exchange._import(kv_t, jax_device, stream))
    j_kv = j_args[0]
    timed("jnp.asarray(jax kv) (what from_dlpack adds at its end)", lambda: jnp.asarray(j_kv, dtype=j_kv.dtype))
    timed("exchange.cross(5 inputs, 'jax')", lambda: exchange.cross(t_args, "jax"))
    timed("exchange.cross([k, v], 'jax') (results of the torch backend)",
          lambda: exchange.cross([k_out, v_out], "jax"))


attempt("torch -> jax pieces", torch_to_jax_pieces)

section("crossing jax -> torch, piece by piece")


def jax_to_torch_pieces():
    j_kv = j_args[0]
    timed("jax kv.__dlpack_device__()", j_kv.__dlpack_device__)
    ptr = None if options.cpu else (torch.cuda.current_stream().cuda_stream or 1)
    timed("jax kv.__dlpack__(stream=torch's) (waits for kv's ready event)", lambda: j_kv.__dlpack__(stream=ptr))
    timed("torch.from_dlpack(jax kv) (per-array handshake: what cross replaces)", lambda: torch.from_dlpack(j_kv))
    timed("torch.utils.dlpack.from_dlpack(jax kv.__dlpack__(stream=torch's))",
          lambda: torch.utils.dlpack.from_dlpack(j_kv.__dlpack__(stream=ptr)))
    timed("[to_torch(a) for the 5 inputs] (what cross replaces)", lambda: [to_torch(a) for a in j_args])
    timed("exchange.cross(5 inputs, 'torch')", lambda: exchange.cross(j_args, "torch"))
    j_results = fusedkv_jax.fused_kv_norm_rope(*j_args, **STATIC)
    timed("exchange.cross([k, v], 'torch') (results of the jax backend)",
          lambda: exchange.cross(list(j_results), "torch"))


attempt("jax -> torch pieces", jax_to_torch_pieces)


def stepwise(title, caller_args, backend):
    """One crossing interop call's steps timed inside the call (perf_counter between them, the median
    of each over the calls), dropping the results included: where a call's time goes that
    its pieces, timed on arrays kept alive, do not show."""
    from interop import dispatch

    steps = ("accept_call", "check_output_buffers", "choose and load the backend", "cross the 5 inputs",
             "the backend's validated call", "deliver (results cross back)", "drop the results")
    samples = []
    for _ in range(options.calls):
        synchronize()
        marks = [time.perf_counter()]
        accepted = spec.accept_call(*caller_args, None, None, **STATIC, takes="any")
        marks.append(time.perf_counter())
        spec.check_output_buffers(caller_args[0], (("k_out", None), ("v_out", None)))
        marks.append(time.perf_counter())
        caller = exchange.framework_of(caller_args[0])
        module = dispatch.load_backend(dispatch.choose_backend(backend, caller))
        marks.append(time.perf_counter())
        crossed = exchange.cross(caller_args, backend)
        marks.append(time.perf_counter())
        results = module.fused_kv_norm_rope_validated(accepted, *crossed)
        marks.append(time.perf_counter())
        delivered = dispatch._deliver((None, None), results, caller, backend)
        marks.append(time.perf_counter())
        del crossed, results, delivered
        marks.append(time.perf_counter())
        samples.append([(after - before) * 1e6 for before, after in zip(marks, marks[1:])])
    section(title)
    for index, step in enumerate(steps):
        values = [sample[index] for sample in samples]
        print(f"{step:66s} {statistics.median(values):9.2f} {min(values):9.2f}", flush=True)
    totals = [sum(sample) for sample in samples]
    print(f"{'all steps':66s} {statistics.median(totals):9.2f} {min(totals):9.2f}", flush=True)


# A call within one framework crosses nothing and skips these steps (interop.dispatch).
for caller, caller_args, backend in (("jax", j_args, "torch"), ("torch", t_args, "jax")):
    attempt(f"{caller} -> {backend} step by step",
            lambda: stepwise(f"interop, {caller} caller, {backend} backend, step by step "
                             "(device synchronised between calls)", caller_args, backend))

def results_kept(title):
    """The crossing calls in a loop that keeps every result alive until the loop's rows are
    timed, against the same loop dropping each result at the next call: what destroying
    the previous call's results (arrays over another framework's memory) costs a loop."""
    section(title)
    kept = []
    for caller, caller_args, backend in (("jax", j_args, "torch"), ("torch", t_args, "jax")):
        def call(caller_args=caller_args, backend=backend):
            return interop.fused_kv_norm_rope(*caller_args, **STATIC, backend=backend)
        timed(f"interop, {caller} caller, {backend} backend, results dropped", call)
        timed(f"interop, {caller} caller, {backend} backend, results kept", lambda call=call: kept.append(call()))
        kept.clear()
        synchronize()


attempt("results kept", lambda: results_kept("crossing calls: results dropped at the next call, or kept"))

section("the jax backend alone (what a crossing to jax adds to)")
accepted = spec.accept_call(*j_args, None, None, **STATIC)
timed("fusedkv_jax.fused_kv_norm_rope_validated (no validation)",
      lambda: fusedkv_jax.fused_kv_norm_rope_validated(accepted, *j_args))
timed("spec.accept_call on jax arrays (remembered)", lambda: spec.accept_call(*j_args, None, None, **STATIC))


def jit_dispatch_alone():
    from fusedkv_jax import kernel as jax_kernel

    tile = jax_kernel.default_tile(16, 5, 8, 128)
    config = FusedKVConfig(8, 128, 128)
    timed("fusedkv_jax.kernel._launch (the jit's dispatch alone)",
          lambda: jax_kernel._launch(*j_args, None, None, None, None, None, config=config, block_tokens=tile[0],
                                     block_heads=tile[1], num_warps=tile[2], layer_loop=False,
                                     k_rows=jax_kernel.loads_k_rows(config), interpret=False))


attempt("jit dispatch", jit_dispatch_alone)
timed("jnp.add of 5 floats (a jax op's eager dispatch)", lambda: jnp.add(j_args[2], j_args[2]))

section("A/B: crossings to jax through jaxlib's import against jax.dlpack.from_dlpack, alternated")
fast = exchange._IMPORT_BUFFER
for round_ in range(2):
    for label, importer in (("jaxlib import", fast), ("from_dlpack", None)):
        exchange._IMPORT_BUFFER = importer
        timed(f"round {round_}: exchange.cross(5 inputs, 'jax'), {label}", lambda: exchange.cross(t_args, "jax"))
        timed(f"round {round_}: interop torch->jax, fresh outputs, {label}",
              lambda: interop.fused_kv_norm_rope(*t_args, **STATIC, backend="jax"))
exchange._IMPORT_BUFFER = fast

section("the crossing calls against the same work written by hand with the libraries' public calls, alternated")


def by_hand_jax_to_torch():
    inputs_t = [torch.from_dlpack(array) for array in j_args]
    k, v = fusedkv_torch.fused_kv_norm_rope(*inputs_t, **STATIC)
    return jax.dlpack.from_dlpack(k), jax.dlpack.from_dlpack(v)


def by_hand_torch_to_jax():
    inputs_j = [jax.dlpack.from_dlpack(tensor) for tensor in t_args]
    k, v = fusedkv_jax.fused_kv_norm_rope(*inputs_j, **STATIC)
    return torch.from_dlpack(k), torch.from_dlpack(v)


def library_calls_jax_to_torch(jax_device):
    """The fewest library calls a correct jax->torch call makes, without interop's own
    steps: the inputs exported with torch's stream looked up once, the backend's public
    function, one event for jax to wait on, and each result imported with its own ready
    event (a result may be read by jax as soon as it is returned)."""
    stream = torch.cuda.current_stream().cuda_stream or 1
    inputs_t = [torch.utils.dlpack.from_dlpack(array.__dlpack__(stream=stream)) for array in j_args]
    k, v = fusedkv_torch.fused_kv_norm_rope(*inputs_t, **STATIC)
    ready = exchange._order_jax_after_torch(k.get_device())
    return exchange._import(k, jax_device, ready), exchange._import(v, jax_device, ready)


def library_calls_torch_to_jax(jax_device):
    """The same for torch->jax: one event for jax to wait on, carried by the first input
    alone (the backend's one launch waits for it), the backend's public function, and
    the results exported with torch's stream looked up once."""
    ready = exchange._order_jax_after_torch(t_args[0].get_device())
    inputs_j = [exchange._import(tensor, jax_device, ready if index == 0 else None)
                for index, tensor in enumerate(t_args)]
    k, v = fusedkv_jax.fused_kv_norm_rope(*inputs_j, **STATIC)
    stream = torch.cuda.current_stream().cuda_stream or 1
    return (torch.utils.dlpack.from_dlpack(k.__dlpack__(stream=stream)),
            torch.utils.dlpack.from_dlpack(v.__dlpack__(stream=stream)))


def crossing_floors():
    """What a crossing call's work costs written with the libraries' calls alone, in a loop
    as the call runs: with the public calls (every array crossed by DLPack's own
    handshake), and with the fewest calls a correct crossing makes. And what handing a
    result to jax costs: jaxlib's import of a fresh tensor with the ready event a result
    must carry, against the same import without one (unordered: timed only, never read)."""
    check("by hand, jax -> torch", by_hand_jax_to_torch)
    check("by hand, torch -> jax", by_hand_torch_to_jax)
    if options.cpu:
        return
    jax_device = jax.local_devices(backend="gpu")[0]
    check("library calls alone, jax -> torch", lambda: library_calls_jax_to_torch(jax_device))
    check("library calls alone, torch -> jax", lambda: library_calls_torch_to_jax(jax_device))
    for round_ in range(2):
        timed(f"round {round_}: interop, jax caller, torch backend",
              lambda: interop.fused_kv_norm_rope(*j_args, **STATIC, backend="torch"))
        timed(f"round {round_}: by hand: torch.from_dlpack x5, fusedkv_torch, jax.dlpack.from_dlpack x2",
              by_hand_jax_to_torch)
        timed(f"round {round_}: library calls alone, jax -> torch", lambda: library_calls_jax_to_torch(jax_device))
        timed(f"round {round_}: interop, torch caller, jax backend, fresh outputs",
              lambda: interop.fused_kv_norm_rope(*t_args, **STATIC, backend="jax"))
        timed(f"round {round_}: by hand: jax.dlpack.from_dlpack x5, fusedkv_jax, torch.from_dlpack x2",
              by_hand_torch_to_jax)
        timed(f"round {round_}: library calls alone, torch -> jax", lambda: library_calls_torch_to_jax(jax_device))
        timed(f"round {round_}: a result to jax: kv.new_empty + jaxlib import with its ready event",
              lambda: exchange._import(k_out.new_empty(OUT_SHAPE), jax_device,
                                       exchange._order_jax_after_torch(k_out.get_device())))
        timed(f"round {round_}: kv.new_empty + jaxlib import without an event (unordered, never read)",
              lambda: exchange._import(k_out.new_empty(OUT_SHAPE), jax_device, None))


attempt("crossing floors", crossing_floors)

entry_points("entry points again, last (the summary's)")

section("summary: issue #13's bars")
by_name = {name: median for name, median, _ in ROWS}


def bar(label, value, limit, how):
    if value is None or limit is None:
        print(f"{label:50s} n/a")
        return
    print(f"{label:50s} {value:8.1f} us  bar {limit:8.1f} us ({how}): {'met' if value <= limit else 'NOT met'}")


floor = by_name.get("  floor: read each tensor's metadata once + Triton's runner")
print(f"{'floor of an eager torch launch (metadata + runner)':50s} {floor or float('nan'):8.1f} us")
add = by_name.get("torch.add of 1024 floats")
direct = by_name.get("fusedkv_torch.fused_kv_norm_rope, outputs given")
jax_call = by_name.get("fusedkv_jax.fused_kv_norm_rope (eager; the 'jax call')")
bar("torch direct, outputs given", direct, add and 1.5 * add, "1.5x torch.add")
bar("torch direct, fresh outputs", by_name.get("fusedkv_torch.fused_kv_norm_rope, fresh outputs"), add and 2 * add,
    "2x torch.add")
bar("interop torch->torch", by_name.get("interop, torch caller, torch backend, fresh outputs"),
    by_name.get("fusedkv_torch.fused_kv_norm_rope, fresh outputs") and
    by_name["fusedkv_torch.fused_kv_norm_rope, fresh outputs"] + 3, "direct call + 3 us")
bar("interop torch->jax", by_name.get("interop, torch caller, jax backend, fresh outputs"),
    jax_call and jax_call + 100, "jax call + 100 us")
bar("interop jax->torch", by_name.get("interop, jax caller, torch backend"),
    by_name.get("fusedkv_torch.fused_kv_norm_rope, fresh outputs") and
    by_name["fusedkv_torch.fused_kv_norm_rope, fresh outputs"] + 100, "torch call + 100 us")
for label, ours, by_hand, fewest in (
        ("jax->torch", "interop, jax caller, torch backend",
         "by hand: torch.from_dlpack x5, fusedkv_torch, jax.dlpack.from_dlpack x2",
         "library calls alone, jax -> torch"),
        ("torch->jax", "interop, torch caller, jax backend, fresh outputs",
         "by hand: jax.dlpack.from_dlpack x5, fusedkv_jax, torch.from_dlpack x2",
         "library calls alone, torch -> jax")):
    rounds = [[by_name.get(f"round {r}: {row}") for row in (ours, by_hand, fewest)] for r in range(2)]
    if all(None not in values for values in rounds):
        print(f"interop {label}, by hand with public calls, library calls alone (alternated rounds): "
              + "; ".join(f"{a:.1f}, {b:.1f}, {c:.1f} us" for a, b, c in rounds)
              + f"; interop {max(a - c for a, _, c in rounds):+.1f} us over the library calls at most")
