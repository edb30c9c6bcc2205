"""``fusedkv bench``: its table, files and plots on fixed measurements, its refusal without a GPU,
and its machinery (the chain of calls in one jit, the check before timing) on small inputs."""

import argparse
import csv
import dataclasses
import functools
import json
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from interop.bench import add_bench_arguments, run_bench_command
from interop.bench.registry import BY_NAME, IMPLEMENTATIONS, Calls, Implementation, Steps, select
from interop.bench.report import Measurement, annotate, format_table, write_data
from interop.bench.runner import Effort, calls_per_jit, plan, run
from interop.bench.shapes import DECODE_TOKENS, SHAPES, BenchShape
from interop.core.reference import fused_kv_norm_rope_reference
from interop.core.spec import FusedKVConfig
from interop.testing import assert_bit_exact, assert_close, random_inputs

# Timers sample once, with few calls a jit (compiling many takes long on the CPU): these
# tests pin down what is checked and recorded, not timings.
ONCE = Effort(graph_ms=1, jax_repeats=1, jax_batch_seconds=0.001, host_calls=3, host_repeats=1,
              max_calls_per_jit=8)
TINY = BenchShape("tiny", FusedKVConfig(num_kv_heads=2, head_dim=32, rotary_dim=16), 2, "2 layers, 2 heads",
                  hidden=64)
# The smallest shape the Mosaic GPU lowering takes: rotary halves of 16 bf16 columns (32 bytes).
MOSAIC_TINY = BenchShape("mosaic-tiny", FusedKVConfig(num_kv_heads=2, head_dim=32, rotary_dim=32), 1,
                         "1 layer, 2 heads", hidden=64)


try:
    import torch
    ON_GPU = torch.cuda.is_available()
except ImportError:
    ON_GPU = False


def _measurement(implementation, kind, tokens, seconds, *, framework="torch", clock="device",
                 bytes_moved=4_000_000, check="ok", error="", baseline=False, does_op=True):
    return Measurement("draft", "bfloat16", implementation, framework, kind, clock, tokens, seconds,
                       bytes_moved, method="m", input_sets=2, check=check, error=error, baseline=baseline,
                       does_op=does_op)


# Round numbers, so every derived column is known without the code under test:
# 4e6 bytes in 1 us is 4000 GB/s, a torch copy of them in 0.8 us 5000 GB/s (80%), the
# fastest device baseline 4 us (4x); XLA's copy 1 us (4000 GB/s), so pallas's 2 us is 50%
# and pallas-mosaic's 1.25 us 80%.
FIXED = [
    _measurement("triton", "kernel", 16, 1e-6),
    _measurement("pallas", "kernel", 16, 2e-6, framework="jax"),
    _measurement("pallas-mosaic", "kernel", 16, 1.25e-6, framework="jax"),
    _measurement("torch-eager", "baseline", 16, 8e-6, baseline=True),
    _measurement("torch-compile", "baseline", 16, 4e-6, baseline=True),
    _measurement("torch-copy", "copy", 16, 0.8e-6, does_op=False),
    _measurement("xla-copy", "copy", 16, 1e-6, framework="jax", does_op=False),
    _measurement("torch-gemm", "materializer", 16, 10e-6, bytes_moved=20_000_000, does_op=False),
    _measurement("broken", "kernel", 16, None, check="FAIL: k: 3 of 10 elements outside tolerance"),
    _measurement("crashed", "kernel", 16, None, error="RuntimeError: out of memory"),
    _measurement("triton-host", "host", 16, 20e-6, clock="host"),
    _measurement("torch-eager-host", "host", 16, 400e-6, clock="host", baseline=True),
    _measurement("triton", "kernel", 4096, 40e-6, bytes_moved=160_000_000),
    _measurement("torch-copy", "copy", 4096, 32e-6, bytes_moved=160_000_000, does_op=False),
    _measurement("pallas-mosaic", "kernel", 4096, None, framework="jax",
                 check="n/a: Mosaic GPU takes at most 8 tokens or a multiple of 8"),
]


def _table_rows(text):
    return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[1:] if line.strip()]


def test_table_gives_bandwidth_fraction_of_copy_and_speedup_per_token_count():
    rows = {(cells[0], cells[2]): cells for cells in _table_rows(format_table(annotate(FIXED)))}
    assert rows["triton", "16"] == ["triton", "kernel", "16", "1.00", "4000", "80%", "4.00x", "m", "ok"]
    assert rows["pallas", "16"] == ["pallas", "kernel", "16", "2.00", "2000", "50%", "2.00x", "m", "ok"]
    # A second kernel row of one framework: its own fraction of the same copy, its own speed-up.
    assert rows["pallas-mosaic", "16"] == ["pallas-mosaic", "kernel", "16", "1.25", "3200", "80%", "3.20x", "m",
                                           "ok"]
    assert rows["torch-compile", "16"][4:7] == ["1000", "20%", "1.00x"]
    assert rows["torch-eager", "16"][6] == "0.50x"
    assert rows["torch-copy", "16"][4:7] == ["5000", "100%", "-"]
    # The materializer moves more bytes and does more than the op: a fraction, no speed-up.
    assert rows["torch-gemm", "16"][4:7] == ["2000", "40%", "-"]
    # Host rows: no bandwidth, and their speed-up is over the baselines' eager calls.
    assert rows["triton-host", "16"][3:7] == ["20.00", "-", "-", "20.00x"]
    # No baseline measured at 4096 tokens: no speed-up there.
    assert rows["triton", "4096"][3:7] == ["40.00", "4000", "80%", "-"]


def test_a_failed_crashed_or_not_applicable_row_shows_why_and_no_time():
    rows = {(cells[0], cells[2]): cells for cells in _table_rows(format_table(annotate(FIXED)))}
    assert rows["broken", "16"][3:7] == ["-"] * 4
    assert rows["broken", "16"][-1] == "FAIL: k: 3 of 10 elements outside tolerance"
    assert rows["crashed", "16"][-1] == "ERROR: RuntimeError: out of memory"
    assert rows["pallas-mosaic", "4096"][3:] == ["-"] * 4 + [
        "m", "n/a: Mosaic GPU takes at most 8 tokens or a multiple of 8"]
    # Not applicable is no failure: the command's exit status counts only rows that are not ok.
    assert [m.implementation for m in FIXED if not m.ok] == ["broken", "crashed"]


def test_table_separates_token_counts_by_a_blank_line():
    lines = format_table(annotate(FIXED)).splitlines()
    blank = lines.index("")
    assert all(" 16 " in line for line in lines[1:blank])
    assert all(" 4096 " in line for line in lines[blank + 1:])


def test_csv_and_json_hold_every_row_with_its_derived_columns(tmp_path):
    meta = {"devices": {"torch": "test device"}, "tokens": [16, 4096]}
    written = write_data(annotate(FIXED), tmp_path, meta)
    assert sorted(path.name for path in written) == ["bench.csv", "bench.json"]
    with open(tmp_path / "bench.csv", newline="") as file:
        records = list(csv.DictReader(file))
    assert len(records) == len(FIXED)
    triton = next(r for r in records if r["implementation"] == "triton" and r["tokens"] == "16")
    assert float(triton["us"]) == pytest.approx(1.0)
    assert float(triton["gbps"]) == pytest.approx(4000)
    assert float(triton["of_copy"]) == pytest.approx(0.8)
    assert float(triton["speedup"]) == pytest.approx(4.0)
    broken = next(r for r in records if r["implementation"] == "broken")
    assert broken["us"] == broken["gbps"] == "" and broken["check"].startswith("FAIL")
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["meta"] == meta
    assert [r["implementation"] for r in document["rows"]] == [m.implementation for m in FIXED]
    assert document["rows"][1]["of_copy"] == pytest.approx(0.5)
    assert document["rows"][2]["of_copy"] == pytest.approx(0.8)
    assert document["rows"][-1]["us"] is None and document["rows"][-1]["check"].startswith("n/a: ")


def _png_size(path):
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_plots_draw_device_rows_with_the_copy_lines_and_latency_at_small_counts(tmp_path):
    pytest.importorskip("matplotlib")
    from interop.bench.plots import plot_bandwidth, plot_latency, write_plots

    rows = annotate(FIXED)
    written = write_plots(rows, tmp_path)
    assert [path.name for path in written] == ["bandwidth-draft-bfloat16.png", "latency-draft-bfloat16.png"]
    assert all(_png_size(path) == (900, 500) for path in written)

    bandwidth = plot_bandwidth(rows, tmp_path / "b.png", title="t")
    assert list(bandwidth) == ["triton", "pallas", "pallas-mosaic", "torch-eager", "torch-compile", "torch-copy",
                               "xla-copy", "torch-gemm"]
    assert bandwidth["pallas-mosaic"] == [(16, pytest.approx(3200))]  # nothing drawn where it is n/a
    assert bandwidth["triton"] == [(16, pytest.approx(4000)), (4096, pytest.approx(4000))]
    assert bandwidth["torch-copy"] == [(16, pytest.approx(5000)), (4096, pytest.approx(5000))]
    latency = plot_latency(rows, tmp_path / "l.png", title="t", max_tokens=DECODE_TOKENS)
    assert latency["triton"] == [(16, pytest.approx(1.0))]
    assert "triton-host" not in latency and "broken" not in latency


def _parser():
    return add_bench_arguments(argparse.ArgumentParser(prog="fusedkv bench"))


def test_options_default_to_the_draft_shape_in_bf16_and_parse_token_lists():
    args = _parser().parse_args(["--tokens", "256,1,16,16", "--only", "kernel,torch-eager"])
    assert (args.shape, args.dtype, args.out, args.quick) == ("draft", "bfloat16", "bench-results", False)
    assert args.max_calls_per_jit is None  # the effort's own cap
    assert args.tokens == (1, 16, 256)
    assert args.only == ["kernel", "torch-eager"]


@pytest.mark.parametrize("tokens", ["0,16", "16,abc", ","])
def test_token_lists_other_than_positive_counts_are_refused(tokens, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--tokens", tokens])
    assert exit_info.value.code == 2
    assert f"argument --tokens: got {tokens!r}, expected comma-separated positive token counts" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("cap", ["0", "-4", "many"])
def test_a_cap_of_calls_per_jit_other_than_a_positive_number_is_refused(cap, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--max-calls-per-jit", cap])
    assert exit_info.value.code == 2
    assert f"argument --max-calls-per-jit: got {cap!r}, expected a positive whole number" in capsys.readouterr().err


@pytest.mark.parametrize("only, unknown", [("triton,tritn", "unknown: tritn"), (",", "none given")])
def test_only_words_other_than_implementations_and_kinds_are_an_argparse_error(only, unknown, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--only", only])
    assert exit_info.value.code == 2
    usage, message = capsys.readouterr().err.rstrip("\n").rsplit("\n", 1)
    assert usage.startswith("usage: fusedkv bench ")
    assert message.startswith(f"fusedkv bench: error: argument --only: got {only!r}, expected comma-separated "
                              f"implementations or kinds; {unknown}; kinds: kernel, ")


@pytest.mark.skipif(ON_GPU, reason="the refusal is for machines without a GPU")
def test_without_a_gpu_the_command_refuses_in_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert run_bench_command(_parser().parse_args(["--quick", "--out", str(out)])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("fusedkv bench: no GPU here (torch sees no CUDA device")
    assert captured.err.count("\n") == 1
    assert not out.exists()


@pytest.mark.skipif(ON_GPU, reason="the refusal is for machines without a GPU")
def test_without_a_gpu_the_module_exits_2_without_a_traceback():
    result = subprocess.run([sys.executable, "-m", "interop.bench", "--quick"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("fusedkv bench: no GPU here") and result.stderr.count("\n") == 1


def test_where_jax_alone_sees_a_device_the_command_runs_its_rows_and_writes_its_files(tmp_path, capsys,
                                                                                    monkeypatch):
    pytest.importorskip("jax")
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    from interop.bench import command

    # The CPU stands in for the GPU: the whole path but the kernels' real timing, and few
    # calls a jit (compiling 512 calls of jnp takes a minute here).
    monkeypatch.setattr(command, "gpu_frameworks", lambda: ({"jax": "stand-in"}, ["torch sees no CUDA device"]))
    args = _parser().parse_args(["--tokens", "4", "--only", "jnp-jit,jnp-jit-host,triton", "--quick",
                                 "--max-calls-per-jit", "8", "--out", str(tmp_path)])
    assert run_bench_command(args) == 0
    out = capsys.readouterr().out
    assert "skipped (torch sees no CUDA device): triton" in out
    table = out[out.index("== draft: 5 layers, 8 KV heads, head_dim 128"):]
    assert [cells[:3] for cells in _table_rows(table.split("\n", 1)[1].split("\n\nwrote")[0])] == [
        ["jnp-jit", "baseline", "4"], ["xla-copy", "copy", "4"], ["jnp-jit-host", "host", "4"]]
    with open(tmp_path / "bench.csv", newline="") as file:
        records = list(csv.DictReader(file))
    assert [r["check"] for r in records] == ["ok", "ok", "ok"]
    assert [r["method"].split(" (")[0] for r in records[:2]] == ["in-jit, 8 calls/jit"] * 2
    assert json.loads((tmp_path / "bench.json").read_text())["meta"]["max_calls_per_jit"] == 8
    assert {p.name for p in tmp_path.iterdir()} == {"bench.csv", "bench.json", "bandwidth-draft-bfloat16.png",
                                                     "latency-draft-bfloat16.png"}


def test_importing_the_bench_imports_no_framework_nor_plotting_library():
    probe = ("import sys, interop.bench, interop.bench.registry, interop.bench.runner, interop.bench.plots, "
             "interop.bench.timers, interop.bench.workload, interop.bench.check, interop.bench.baselines; "
             "print(sorted(m for m in ('torch', 'jax', 'triton', 'matplotlib', 'tqdm') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_selection_adds_each_frameworks_copy_and_skips_frameworks_without_a_gpu():
    runnable, skipped = select(["kernel"], {"torch": "gpu"})
    assert [i.name for i in runnable] == ["triton", "torch-copy"]
    assert [i.name for i in skipped] == ["pallas", "pallas-mosaic"]
    runnable, skipped = select(["interop"], {"torch": "gpu", "jax": "gpu"})
    assert [i.name for i in runnable] == ["interop-torch", "interop-jax", "interop-jax-to-torch",
                                          "interop-torch-to-jax"]
    assert skipped == []
    with pytest.raises(ValueError, match=r"unknown implementations or kinds \['nope'\]"):
        select(["nope"], {"torch": "gpu"})


def test_every_kind_has_a_name_of_its_own_and_host_rows_run_at_decode_sizes_only():
    assert len(BY_NAME) == len(IMPLEMENTATIONS)
    tasks = plan([SHAPES["draft"]], [16, DECODE_TOKENS, 4096], [BY_NAME["triton"], BY_NAME["triton-host"]])
    assert [(t, i.name) for _, t, i in tasks] == [(16, "triton"), (16, "triton-host"), (DECODE_TOKENS, "triton"),
                                                  (DECODE_TOKENS, "triton-host"), (4096, "triton")]


def test_a_jit_holds_about_a_millisecond_of_calls_estimated_from_their_bytes():
    # 3e12 bytes/s and a 1.5 us floor per call; 1 ms of them, between 8 and the cap.
    assert calls_per_jit(30_000_000, most=512) == 100  # 10 us a call
    assert calls_per_jit(29_000_000, most=512) == 104  # 9.67 us: 103.4 calls, rounded up
    assert calls_per_jit(3_000_000, most=1024) == 667  # 1 us is below the floor: 1.5 us
    assert calls_per_jit(3_000_000, most=512) == 512
    assert calls_per_jit(0, most=512) == 512
    assert calls_per_jit(3_000_000_000, most=512) == 8  # 1 ms a call: the fewest
    assert calls_per_jit(3_000_000_000, most=2) == 2  # unless the cap is lower
    # The draft shape in bf16, as the runner's docstring gives it.
    draft = SHAPES["draft"]
    assert [calls_per_jit(draft.op_bytes(tokens, "bfloat16"), most=512) for tokens in
            (1, 64, 256, 1024, 4096, 16384)] == [512, 512, 287, 72, 18, 8]


def test_shapes_are_the_three_of_the_issue():
    assert {name: (s.n_layers, s.config.num_kv_heads, s.config.head_dim, s.config.rotary_dim)
            for name, s in SHAPES.items()} == {"draft": (5, 8, 128, 128), "hd256": (5, 2, 256, 256),
                                               "rotary64": (8, 4, 128, 64)}
    # read kv once, write K and V: 2 * tokens * layers * 2*kv_size * 2 bytes in bf16
    assert SHAPES["draft"].op_bytes(16, "bfloat16") == 2 * 16 * 5 * 2048 * 2


# --- the machinery, on small inputs (jax on the CPU here, on the GPU there) ---------------


@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_baselines_compute_the_reference(rope_style, dtype):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    from interop.bench.baselines import jnp_reference_math, torch_reference_math
    from interop.exchange import to_torch

    config = FusedKVConfig(num_kv_heads=3, head_dim=96, rotary_dim=64, rope_style=rope_style)
    inputs = random_inputs(config, n_layers=1, total_ctx=7, dtype=dtype, max_position=64, seed=5)
    static = dict(num_kv_heads=3, head_dim=96, rotary_dim=64, rope_style=rope_style)
    k_expected, v_expected = fused_kv_norm_rope_reference(*inputs.arrays(), **static)
    torch_k, torch_v = torch_reference_math(*(to_torch(a) for a in inputs.arrays()), config=config)
    jnp_k, jnp_v = jax.jit(functools.partial(jnp_reference_math, config=config))(*inputs.arrays())
    for k, v in ((torch_k, torch_v), (jnp_k, jnp_v)):
        assert_close(k, k_expected)
        assert_bit_exact(v, v_expected)
    assert torch_k.dtype == getattr(torch, dtype)


def test_the_chain_runs_every_call_in_order_on_its_input_set():
    jax = pytest.importorskip("jax")
    from interop.bench.timers import chained_calls, in_jit_seconds

    size = 1 << 20  # enough work per call that timing noise cannot swamp it
    sets = [(jax.numpy.full((size,), float(10 ** i)),) for i in range(3)]

    def step(fixed, varying, outputs):  # each call adds its set to what the call before wrote
        return outputs + varying[0] * fixed

    run = chained_calls(step, 5, len(sets))
    total, _ = run(2.0, sets, jax.numpy.zeros(size), jax.numpy.zeros(5))
    # calls 0..4 read sets 0, 1, 2, 0, 1: 2 * (1 + 10 + 100 + 1 + 10)
    assert np.unique(np.asarray(total)).tolist() == [244.0]
    seconds, _ = in_jit_seconds(run, 2.0, sets, total, calls_per_jit=5, batch_seconds=0.01, repeats=3)
    assert 0 < seconds < 0.1


def test_a_chain_of_steps_that_allocate_their_outputs_keeps_every_call():
    # XLA dropped all but the last call of such a chain, and merged calls on one input set,
    # before every call read its inputs plus a zero it cannot know and returned its outputs.
    jax = pytest.importorskip("jax")
    from interop.bench.timers import chained_calls

    def step(fixed, varying, outputs):
        return jax.numpy.sin(varying[0]) * fixed

    calls = 5
    sets = [(jax.numpy.full((1000,), float(i + 1)),) for i in range(2)]
    run = chained_calls(step, calls, len(sets), fresh_outputs=True)
    zeros = jax.numpy.zeros(calls)
    if jax.default_backend() == "cpu":  # the GPU compiler names its kernels otherwise
        compiled = run.lower(2.0, sets, jax.numpy.zeros(1000), zeros).compile().as_text()
        entry = compiled[compiled.index("ENTRY"):]
        assert entry.count("fusion(") >= calls
    last, earlier = run(2.0, sets, jax.numpy.zeros(1000), zeros)
    values = [float(np.asarray(out)[0]) for out in (*earlier, last)]
    assert values == pytest.approx([2 * np.sin(1.0 + call % 2) for call in range(calls)])


def test_an_opaque_step_gets_its_inputs_unshifted_and_keeps_every_call():
    # A custom call (here a host callback standing in for the Mosaic GPU kernel) cannot take
    # the zero in: the chain must not add a pass over its inputs, yet run every call.
    jax = pytest.importorskip("jax")
    from interop.bench.timers import chained_calls

    seen = []

    def host_sin(x):
        seen.append(float(x[0]))
        return np.sin(x)

    def step(fixed, varying, outputs):
        return jax.pure_callback(host_sin, jax.ShapeDtypeStruct(varying[0].shape, varying[0].dtype), varying[0])

    calls = 5
    sets = [(jax.numpy.full((100,), float(i + 1)),) for i in range(2)]
    arguments = (2.0, sets, jax.numpy.zeros(100), jax.numpy.zeros(calls))
    opaque = chained_calls(step, calls, len(sets), fresh_outputs=True, opaque_step=True)
    shifted = chained_calls(step, calls, len(sets), fresh_outputs=True)

    def adds(run):
        return sum(equation.primitive.name == "add" for equation in run.trace(*arguments).jaxpr.eqns)

    assert (adds(opaque), adds(shifted)) == (0, calls)
    last, earlier = opaque(*arguments)
    assert sorted(seen) == [1.0, 1.0, 1.0, 2.0, 2.0]  # in any order: nothing orders them on the CPU
    assert [float(np.asarray(out)[0]) for out in (*earlier, last)] == pytest.approx(
        [np.sin(1.0 + call % 2) for call in range(calls)])


def _callback_steps(workload, *, launches_per_call):
    """The jnp baseline behind a host callback launched ``launches_per_call`` times a call,
    named as the kernel the jit must launch once per call."""
    import jax

    from interop.bench.baselines import jnp_reference_math

    config = workload.shape.config
    prepared = BY_NAME["jnp-jit"].prepare(workload)

    def host_math(*arrays):
        return tuple(np.asarray(a) for a in jnp_reference_math(*arrays, config=config))

    def step(fixed, varying, outputs):
        shapes = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outputs)
        results = [jax.pure_callback(host_math, shapes, varying[0], *fixed, varying[1])
                   for _ in range(launches_per_call)]
        return results[-1] if launches_per_call == 1 else jax.tree.map(lambda a, b: a + 0 * b, *results[-2:])

    return dataclasses.replace(prepared, step=step, kernel_target=_host_callback_target())


def _host_callback_target() -> str:
    """The custom call a ``jax.pure_callback`` compiles to on this machine's platform
    (XLA names one per platform)."""
    import jax

    compiled = jax.jit(lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct((), np.float32), x))
    text = compiled.lower(np.float32(1)).compile().as_text()
    return re.search(r'custom_call_target="(\w*python\w*callback)"', text).group(1)


def test_a_kernel_the_jit_does_not_launch_once_per_call_fails_and_is_not_timed():
    pytest.importorskip("jax")
    implementations = [
        Implementation("launched-once", "jax", "kernel", functools.partial(_callback_steps, launches_per_call=1)),
        Implementation("launched-twice", "jax", "kernel", functools.partial(_callback_steps, launches_per_call=2))]
    once, twice = run(plan([TINY], [3], implementations), dtype="bfloat16", framework="jax", effort=ONCE)
    assert once.check == "ok" and once.seconds is not None
    assert twice.check == (f"FAIL: the jit launches {_host_callback_target()} 16 times for 8 calls "
                           "(XLA merged or dropped calls)")
    assert twice.seconds is None


@pytest.mark.parametrize("looped", [False, True], ids=["one layer a program", "every layer a program"])
def test_the_floor_rows_copy_k_and_v_bit_for_bit_and_are_timed(looped, monkeypatch):
    pytest.importorskip("jax")
    from fusedkv_jax import kernel as pallas_kernel

    shape = TINY
    if looped:  # interpret mode never loops over layers by default; a GPU at long contexts does
        monkeypatch.setattr(pallas_kernel, "loops_over_layers", lambda *args, **kwargs: True)
        # More layers than are in flight at once, so that later layers' loads are issued in the loop.
        shape = dataclasses.replace(TINY, n_layers=pallas_kernel.LAYERS_IN_FLIGHT + 1)
    floors = [BY_NAME["pallas-floor"], BY_NAME["pallas-floor-cos-sin"]]
    for measurement in run(plan([shape], [5], floors), dtype="bfloat16", framework="jax", effort=ONCE):
        assert measurement.kind == "floor" and not measurement.does_op
        assert measurement.check == "ok" and measurement.seconds is not None


def test_the_floor_check_fails_outputs_that_are_not_k_and_v():
    jnp = pytest.importorskip("jax.numpy")
    from interop.bench.floors import copy_verdict

    config = TINY.config
    kv = jnp.asarray(random_inputs(config, n_layers=2, total_ctx=5, max_position=64).kv)
    halves = kv.reshape(5, 2, 2, config.num_kv_heads, config.head_dim).transpose(2, 1, 0, 3, 4)
    static = dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    assert copy_verdict((halves[0], halves[1]), kv, **static) == "ok"
    assert copy_verdict((halves[1], halves[0]), kv, **static).startswith("FAIL: ")
    assert copy_verdict((halves[0], halves[1].at[1, 4, 0, 3].add(1)), kv, **static) == \
        "FAIL: 1 elements differ from kv"


def test_the_mosaic_row_checks_and_times_the_kernel_where_mosaic_takes_the_shape():
    pytest.importorskip("jax")
    from interop.bench.runner import measure
    from interop.bench.workload import Workload

    # On a GPU, more calls than input sets: XLA would merge calls on one set if it could,
    # which the launch count (the custom call's, compiled only there) would show. Here
    # interpreted, a call takes about 0.3 s.
    calls = 16 if ON_GPU else 2
    workload = Workload(MOSAIC_TINY, 64, "bfloat16", framework="jax", set_count=2)
    measurement = measure(BY_NAME["pallas-mosaic"], workload, dataclasses.replace(ONCE, max_calls_per_jit=calls),
                          shape=MOSAIC_TINY, total_ctx=64, dtype="bfloat16")
    assert measurement.check == "ok" and not measurement.error
    assert measurement.seconds is not None and measurement.method.startswith(f"in-jit, {calls} calls/jit")
    assert measurement.input_sets == 2


@pytest.mark.parametrize("shape, tokens, dtype, reason", [
    (TINY, 64, "bfloat16", "no Mosaic GPU kernel for bfloat16 neox, head_dim 32, rotary 16"),
    (MOSAIC_TINY, 64, "float32", "no Mosaic GPU kernel for float32 neox, head_dim 32, rotary 32"),
    pytest.param(MOSAIC_TINY, 8, "bfloat16", "Mosaic GPU's interpreter takes multiples of 64 tokens",
                 marks=pytest.mark.skipif(ON_GPU, reason="the interpreter's rule")),
    pytest.param(MOSAIC_TINY, 12, "bfloat16", "Mosaic GPU takes at most 8 tokens or a multiple of 8",
                 marks=pytest.mark.skipif(not ON_GPU, reason="the compiled kernel's rule")),
])
def test_the_mosaic_row_is_not_applicable_where_mosaic_has_no_kernel(shape, tokens, dtype, reason):
    pytest.importorskip("jax")
    errors = []
    (measurement,) = run(plan([shape], [tokens], [BY_NAME["pallas-mosaic"]]), dtype=dtype, framework="jax",
                         effort=ONCE, on_error=lambda failed, trace: errors.append(trace))
    assert measurement.check == f"n/a: {reason}"
    assert measurement.seconds is None and measurement.ok and not errors


def _broken_steps(workload):
    """The jnp baseline with K's first head off by one: a kernel bug the check must catch."""
    from interop.bench.baselines import jnp_reference_math

    config = workload.shape.config
    prepared = BY_NAME["jnp-jit"].prepare(workload)

    def step(fixed, varying, outputs):
        k, v = jnp_reference_math(varying[0], *fixed, varying[1], config=config)
        return k.at[:, :, 0].add(1), v

    return Steps(step, prepared.fixed, prepared.varying, prepared.new_outputs, prepared.bytes_moved, prepared.check)


def _unwritten_calls(workload):
    """An eager call that writes nothing into the outputs it is given."""
    prepared = BY_NAME["pallas-host"].prepare(workload)
    from interop.bench.check import op_verdict
    from interop.bench.registry import _nan_pair

    outputs = _nan_pair(workload, "jax")
    return Calls(lambda i: outputs, prepared.sets, prepared.bytes_moved,
                 lambda: op_verdict(*outputs, *workload.op_args(0, "jax"), static=workload.shape.static()))


def test_a_failing_implementation_is_marked_and_never_timed():
    pytest.importorskip("jax")
    implementations = [BY_NAME["jnp-jit"], Implementation("off-by-one", "jax", "kernel", _broken_steps),
                       Implementation("writes-nothing", "jax", "host", _unwritten_calls, clock="host")]
    measurements = run(plan([TINY], [3], implementations), dtype="bfloat16", framework="jax", effort=ONCE)
    by_name = {m.implementation: m for m in measurements}
    assert by_name["jnp-jit"].check == "ok" and by_name["jnp-jit"].seconds is not None
    # 8 calls (the cap here) of 1.5 us (the floor: 3 tokens move 3 KB) each
    assert by_name["jnp-jit"].method.startswith("in-jit, 8 calls/jit (~0.012 ms est.)")
    assert by_name["off-by-one"].check.startswith("FAIL: k:") and by_name["off-by-one"].seconds is None
    assert by_name["writes-nothing"].check == f"FAIL: {2 * 2 * 3 * 2 * 32} elements unwritten (NaN)"
    assert by_name["writes-nothing"].seconds is None


def test_a_raising_implementation_is_recorded_and_the_run_goes_on():
    pytest.importorskip("jax")

    def raises(workload):
        raise RuntimeError("no kernel for this shape")

    errors = []
    implementations = [Implementation("raises", "jax", "kernel", raises), BY_NAME["xla-copy"]]
    measurements = run(plan([TINY], [3], implementations), dtype="bfloat16", framework="jax", effort=ONCE,
                       on_error=lambda failed, trace: errors.append((failed.implementation, trace)))
    assert measurements[0].error == "RuntimeError: no kernel for this shape" and measurements[0].seconds is None
    assert measurements[1].check == "ok" and measurements[1].seconds is not None
    assert errors[0][0] == "raises" and "no kernel for this shape" in errors[0][1]


# torch.compile's CPU compilation alone takes about 30 s; on the GPU it is checked with the
# rest. pallas-mosaic takes no TINY shape (its own tests above).
CHECKED_HERE = [i for i in IMPLEMENTATIONS
                if (ON_GPU or "torch-compile" not in i.name) and i.name != "pallas-mosaic"]


@pytest.mark.parametrize("implementation", CHECKED_HERE, ids=[i.name for i in CHECKED_HERE])
def test_every_implementation_passes_its_check_on_small_inputs(implementation):
    pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    from interop.bench.timers import chained_calls
    from interop.bench.workload import Workload

    workload = Workload(TINY, 5, "bfloat16", framework="torch", torch_device="cuda" if ON_GPU else "cpu",
                        set_count=3)
    prepared = implementation.prepare(workload)
    if isinstance(prepared, Steps):
        run_chain = chained_calls(prepared.step, 4, len(prepared.varying), fresh_outputs=prepared.fresh_outputs)
        outputs, _ = run_chain(prepared.fixed, prepared.varying, prepared.new_outputs(), jax.numpy.zeros(4))
        assert prepared.check(outputs, 3 % len(prepared.varying)) == "ok"
    else:
        assert prepared.check() == "ok"
    assert prepared.bytes_moved >= TINY.op_bytes(5, "bfloat16") or implementation.kind == "materializer"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="times kernels on a GPU")
def test_on_a_gpu_the_command_times_the_kernels_and_writes_its_files(tmp_path, capsys):
    args = _parser().parse_args(["--tokens", "16", "--only", "kernel", "--quick", "--out", str(tmp_path)])
    assert run_bench_command(args) == 0
    table = capsys.readouterr().out
    assert re.search(r"^triton\s+kernel\s+16\s+\d+\.\d\d\s+\d+\s+\d+%", table, re.MULTILINE)
    assert {path.name for path in tmp_path.iterdir()} >= {"bench.csv", "bench.json", "bandwidth-draft-bfloat16.png",
                                                          "latency-draft-bfloat16.png"}
