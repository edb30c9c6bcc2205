"""``fusedkv bench``: its tables, files and plots on fixed measurements, its refusal without a GPU,
and its machinery (the chain of calls in one jit, the check before timing, the materializers'
GEMM rows, the host floor, the sweep, alternated rounds) on small inputs."""

import argparse
import csv
import dataclasses
import functools
import json
import math
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from interop.bench import add_bench_arguments, run_bench_command
from interop.bench.registry import BY_NAME, IMPLEMENTATIONS, Calls, Implementation, Steps, select
from interop.bench.report import (
    HOST_COLUMNS,
    MATERIALIZER_COLUMNS,
    Ceiling,
    Measurement,
    annotate,
    device_ceiling,
    format_table,
    markdown_report,
    write_data,
)
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
# The smallest shape the Mosaic GPU lowering takes: head_dim and rotary_dim 32.
MOSAIC_TINY = BenchShape("mosaic-tiny", FusedKVConfig(num_kv_heads=2, head_dim=32, rotary_dim=32), 1,
                         "1 layer, 2 heads", hidden=64)


try:
    import torch
    ON_GPU = torch.cuda.is_available()
except ImportError:
    ON_GPU = False


def _measurement(implementation, kind, tokens, seconds, *, framework="torch", clock="device",
                 bytes_moved=4_000_000, check="ok", error="", baseline=False, does_op=True, gemm=""):
    return Measurement("draft", "bfloat16", implementation, framework, kind, clock, tokens, seconds,
                       bytes_moved, method="m", input_sets=2, check=check, error=error, baseline=baseline,
                       does_op=does_op, gemm=gemm)


# Round numbers, so every derived column is known without the code under test:
# 4e6 bytes in 1 us is 4000 GB/s, a torch copy of them in 0.8 us 5000 GB/s (80%), the
# fastest device baseline 4 us (4x); XLA's copy 1 us (4000 GB/s), so pallas's 2 us is 50%
# and pallas-mosaic's 1.25 us 80%. The fastest copy, torch's 5000 GB/s, is the ceiling here.
# The materializer takes 1.1 times its GEMM's 10 us; the host rows 20 and 400 us over
# Triton's own launch, 5 us.
FIXED = [
    _measurement("triton", "kernel", 16, 1e-6),
    _measurement("pallas", "kernel", 16, 2e-6, framework="jax"),
    _measurement("pallas-mosaic", "kernel", 16, 1.25e-6, framework="jax"),
    _measurement("torch-eager", "baseline", 16, 8e-6, baseline=True),
    _measurement("torch-compile", "baseline", 16, 4e-6, baseline=True),
    _measurement("torch-copy", "copy", 16, 0.8e-6, does_op=False),
    _measurement("xla-copy", "copy", 16, 1e-6, framework="jax", does_op=False),
    _measurement("torch-gemm", "materializer", 16, 10e-6, bytes_moved=20_000_000, does_op=False),
    _measurement("torch-materializer", "materializer", 16, 11e-6, bytes_moved=24_000_000, does_op=False,
                 gemm="torch-gemm"),
    _measurement("broken", "kernel", 16, None, check="FAIL: k: 3 of 10 elements outside tolerance"),
    _measurement("crashed", "kernel", 16, None, error="RuntimeError: out of memory"),
    _measurement("triton-launch", "host", 16, 5e-6, clock="host", does_op=False),
    _measurement("triton-host", "host", 16, 20e-6, clock="host"),
    _measurement("torch-eager-host", "host", 16, 400e-6, clock="host", baseline=True),
    _measurement("triton", "kernel", 4096, 40e-6, bytes_moved=160_000_000),
    _measurement("torch-copy", "copy", 4096, 32e-6, bytes_moved=160_000_000, does_op=False),
    _measurement("pallas-mosaic", "kernel", 4096, None, framework="jax",
                 check="n/a: Mosaic GPU takes at most 8 tokens or a multiple of 8"),
]
CEILING = Ceiling(5000, "torch-copy at 16 tokens (draft, bfloat16)")


def _table_rows(text):
    return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[1:] if line.strip()]


def _device_table(measurements=FIXED):
    device = [row for row in annotate(measurements, CEILING)
              if row.measurement.clock == "device" and row.measurement.kind != "materializer"]
    return {(cells[0], cells[2]): cells for cells in _table_rows(format_table(device))}


def test_table_gives_bandwidth_fractions_of_copy_and_ceiling_and_speedup_per_token_count():
    rows = _device_table()
    assert rows["triton", "16"] == ["triton", "kernel", "16", "1.00", "4000", "80%", "80%", "4.00x", "m", "ok"]
    assert rows["pallas", "16"] == ["pallas", "kernel", "16", "2.00", "2000", "50%", "40%", "2.00x", "m", "ok"]
    # A second kernel row of one framework: its own fraction of the same copy, its own speed-up.
    assert rows["pallas-mosaic", "16"] == ["pallas-mosaic", "kernel", "16", "1.25", "3200", "80%", "64%", "3.20x",
                                           "m", "ok"]
    assert rows["torch-compile", "16"][4:8] == ["1000", "20%", "20%", "1.00x"]
    assert rows["torch-eager", "16"][7] == "0.50x"
    assert rows["torch-copy", "16"][4:8] == ["5000", "100%", "100%", "-"]
    # No baseline measured at 4096 tokens: no speed-up there.
    assert rows["triton", "4096"][3:8] == ["40.00", "4000", "80%", "80%", "-"]


def test_materializer_rows_read_against_their_own_gemm_with_no_bandwidth():
    rows = [row for row in annotate(FIXED, CEILING) if row.measurement.kind == "materializer"]
    table = {cells[0]: cells for cells in _table_rows(format_table(rows, MATERIALIZER_COLUMNS))}
    assert table["torch-materializer"] == ["torch-materializer", "16", "11.00", "1.100x", "m", "ok"]
    assert table["torch-gemm"][3] == "-"
    # A compute-bound GEMM has no bandwidth to compare: none of its derived columns are set.
    assert all(row.gbps is row.of_copy is row.of_ceiling is None for row in rows)


def test_option_rows_sit_in_the_ops_table_with_bandwidth_and_fp8_rows_in_the_materializers_against_their_gemm():
    from interop.bench.report import OP_SECTION, SECTIONS

    measurements = [*FIXED, _measurement("triton-v-multiplier", "options", 16, 2e-6),
                    _measurement("torch-gemm-fp8", "options", 16, 5e-6, does_op=False),
                    _measurement("torch-materializer-fp8", "options", 16, 6e-6, does_op=False, gemm="torch-gemm-fp8")]
    rows = {row.measurement.implementation: row for row in annotate(measurements, CEILING)}
    materializers = next(section for section in SECTIONS if section.title.startswith("Materializers"))
    assert OP_SECTION.takes(rows["triton-v-multiplier"].measurement)
    assert not any(OP_SECTION.takes(rows[name].measurement) for name in ("torch-gemm-fp8", "torch-materializer-fp8"))
    assert materializers.takes(rows["torch-materializer-fp8"].measurement)
    # 4e6 bytes in 2 us against torch's copy at 5000 GB/s; the FP8 materializer over its own GEMM
    assert (rows["triton-v-multiplier"].gbps, rows["triton-v-multiplier"].of_copy) == (2000, 0.4)
    assert rows["torch-materializer-fp8"].over_gemm == pytest.approx(1.2)
    assert rows["torch-gemm-fp8"].gbps is rows["torch-materializer-fp8"].gbps is None


def test_host_rows_give_their_time_over_tritons_own_launch_and_their_speedup():
    rows = [row for row in annotate(FIXED, CEILING) if row.measurement.clock == "host"]
    table = {cells[0]: cells for cells in _table_rows(format_table(rows, HOST_COLUMNS))}
    assert table["triton-host"] == ["triton-host", "host", "16", "20.00", "20.00x", "+15.00", "m", "ok"]
    assert table["torch-eager-host"][3:6] == ["400.00", "1.00x", "+395.00"]
    assert table["triton-launch"][3:6] == ["5.00", "-", "-"]
    assert all(row.gbps is None for row in rows)  # a host row's time is not the device's


def test_the_ceiling_is_the_fastest_copy_of_the_run_not_one_sizes_dip():
    # A same-bytes copy that dips at one size (as graph-replayed copies of some sizes do)
    # lowers neither the ceiling nor the other sizes' fraction of it; a 1 GiB copy measured
    # once, or a floor row, sets it when faster, and it is named.
    dipped = [
        _measurement("triton", "kernel", 32768, 100e-6, bytes_moved=400_000_000),
        _measurement("torch-copy", "copy", 32768, 160e-6, bytes_moved=400_000_000, does_op=False),
        _measurement("torch-copy", "copy", 4096, 1e-6, bytes_moved=4_000_000, does_op=False),
        _measurement("pallas-floor", "floor", 4096, 0.9e-6, framework="jax", bytes_moved=3_960_000, does_op=False),
    ]
    assert device_ceiling(dipped) == Ceiling(pytest.approx(4400), "pallas-floor at 4096 tokens (draft, bfloat16)")
    assert device_ceiling(dipped, 5000, "a 1 GiB copy") == Ceiling(5000, "a 1 GiB copy")
    assert device_ceiling(dipped[:1]) is None
    rows = _device_table(dipped)
    assert rows["triton", "32768"][4:7] == ["4000", "160%", "80%"]  # of the dipped copy; of the ceiling


def test_a_failed_crashed_or_not_applicable_row_shows_why_and_no_time():
    rows = _device_table()
    assert rows["broken", "16"][3:8] == ["-"] * 5
    assert rows["broken", "16"][-1] == "FAIL: k: 3 of 10 elements outside tolerance"
    assert rows["crashed", "16"][-1] == "ERROR: RuntimeError: out of memory"
    assert rows["pallas-mosaic", "4096"][3:] == ["-"] * 5 + [
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
    written = write_data(annotate(FIXED, CEILING), tmp_path, meta)
    assert sorted(path.name for path in written) == ["bench.csv", "bench.json"]
    with open(tmp_path / "bench.csv", newline="") as file:
        records = list(csv.DictReader(file))
    assert len(records) == len(FIXED)
    triton = next(r for r in records if r["implementation"] == "triton" and r["tokens"] == "16")
    assert float(triton["us"]) == pytest.approx(1.0)
    assert float(triton["gbps"]) == pytest.approx(4000)
    assert float(triton["of_copy"]) == pytest.approx(0.8)
    assert float(triton["of_ceiling"]) == pytest.approx(0.8)
    assert float(triton["speedup"]) == pytest.approx(4.0)
    materializer = next(r for r in records if r["implementation"] == "torch-materializer")
    assert float(materializer["x_gemm"]) == pytest.approx(1.1) and materializer["gbps"] == ""
    host = next(r for r in records if r["implementation"] == "triton-host")
    assert float(host["over_launch_us"]) == pytest.approx(15.0)
    broken = next(r for r in records if r["implementation"] == "broken")
    assert broken["us"] == broken["gbps"] == "" and broken["check"].startswith("FAIL")
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["meta"] == meta
    assert [r["implementation"] for r in document["rows"]] == [m.implementation for m in FIXED]
    assert document["rows"][1]["of_copy"] == pytest.approx(0.5)
    assert document["rows"][2]["of_copy"] == pytest.approx(0.8)
    assert document["rows"][-1]["us"] is None and document["rows"][-1]["check"].startswith("n/a: ")


def test_the_markdown_report_gives_the_command_devices_packages_ceiling_and_every_table():
    meta = {"command": "fusedkv bench --tokens 16,4096 --markdown bench.md",
            "devices": {"torch": "Test GPU", "jax": "Test GPU"},
            "versions": {"python": "3.12.0", "torch": "2.11.0", "jax": "0.11.2"}, "ceiling": CEILING.describe()}
    text = markdown_report(annotate(FIXED, CEILING), meta, {"draft": "5 layers"})
    lines = text.splitlines()
    assert lines[:5] == ["# fusedkv bench", "", "```sh", meta["command"], "```"]
    assert "- Devices: torch: Test GPU; jax: Test GPU" in lines
    assert "- Packages: python 3.12.0, torch 2.11.0, jax 0.11.2" in lines
    assert not any(line.startswith("- XLA_FLAGS") for line in lines)  # none were set
    assert "- Device copy ceiling: 5000 GB/s, torch-copy at 16 tokens (draft, bfloat16)" in lines
    assert "## draft: 5 layers, bfloat16" in lines
    titles = [line for line in lines if line.startswith("### ")]
    assert [title.split(":")[0] for title in titles] == [
        "### Kernels, floors, copies and baselines", "### Materializers", "### Host wall time per eager call, "
        "against Triton's own launch of the compiled kernel"]
    assert "| implementation | kind | tokens | µs | GB/s | of copy | of ceiling | speed-up | method | check |" in lines
    assert "| triton | kernel | 16 | 1.00 | 4000 | 80% | 80% | 4.00x | m | ok |" in lines
    assert "| torch-materializer | 16 | 11.00 | 1.100x | m | ok |" in lines
    assert "| triton-host | host | 16 | 20.00 | 20.00x | +15.00 | m | ok |" in lines


def _png_size(path):
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_plots_give_the_kernels_the_materializers_and_the_baselines_a_chart_each(tmp_path):
    pytest.importorskip("matplotlib")
    from interop.bench.plots import baseline_series, kernel_series, latency_series, materializer_series, write_plots

    rows = annotate(FIXED, CEILING)
    written = write_plots(rows, tmp_path, CEILING)
    assert [path.name for path in written] == ["kernels-draft-bfloat16.png", "latency-draft-bfloat16.png",
                                               "materializers-draft-bfloat16.png", "baselines-draft-bfloat16.png"]
    assert all(_png_size(path) == (900, 500) for path in written)

    kernels = kernel_series(rows)  # fractions of the ceiling; no baseline, GEMM or host line
    assert list(kernels) == ["triton", "pallas", "pallas-mosaic", "torch-copy", "xla-copy"]
    assert kernels["triton"] == [(16, pytest.approx(0.8)), (4096, pytest.approx(0.8))]
    assert kernels["pallas-mosaic"] == [(16, pytest.approx(0.64))]  # nothing drawn where it is n/a
    assert latency_series(rows, max_tokens=DECODE_TOKENS)["triton"] == [(16, pytest.approx(1.0))]
    assert materializer_series(rows) == {"torch-materializer": [(16, pytest.approx(1.1))]}
    baselines = baseline_series(rows)  # the baselines' time, the kernels beside them
    assert list(baselines) == ["torch-eager", "torch-compile", "triton", "pallas"]
    assert baselines["torch-eager"] == [(16, pytest.approx(8.0))]
    assert not any("host" in name or name == "broken" for series in (kernels, baselines) for name in series)


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
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_pdl=true")  # a GPU option: recorded, no change here
    markdown = tmp_path / "tables.md"
    argv = ["--tokens", "4", "--only", "jnp-jit,jnp-jit-host,triton", "--quick", "--max-calls-per-jit", "8",
            "--out", str(tmp_path / "out"), "--markdown", str(markdown)]
    assert run_bench_command(_parser().parse_args(argv)) == 0
    out = capsys.readouterr().out
    assert "skipped (torch sees no CUDA device): triton" in out
    # Without torch no 1 GiB copy is measured: the run's fastest copy is the ceiling, and says so.
    assert "device copy ceiling: " in out and "GB/s, xla-copy at 4 tokens (draft, bfloat16)" in out
    device = out[out.index("== draft: 5 layers, 8 KV heads, head_dim 128"):]
    assert device.splitlines()[0].endswith("bfloat16: Kernels, floors, copies and baselines: device time per call ==")
    assert [cells[:3] for cells in _table_rows(device.split("\n", 1)[1].split("\n\n==")[0])] == [
        ["jnp-jit", "baseline", "4"], ["xla-copy", "copy", "4"]]
    host = out[out.index("bfloat16: Host wall time per eager call"):]
    assert [cells[:3] for cells in _table_rows(host.split("\n", 1)[1].split("\n\nwrote")[0])] == [
        ["jnp-jit-host", "host", "4"]]
    with open(tmp_path / "out" / "bench.csv", newline="") as file:
        records = list(csv.DictReader(file))
    assert [r["check"] for r in records] == ["ok", "ok", "ok"]
    assert all(re.fullmatch(r"in-jit, 8 calls/jit( of \d+ kernels)?", r["method"].split(" (")[0])
               for r in records[:2])
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert document["meta"]["max_calls_per_jit"] == 8
    assert document["meta"]["xla_flags"] == "--xla_gpu_enable_pdl=true"
    assert "- XLA_FLAGS: `--xla_gpu_enable_pdl=true`" in markdown.read_text().splitlines()
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "bench.csv", "bench.json", "kernels-draft-bfloat16.png", "latency-draft-bfloat16.png",
        "baselines-draft-bfloat16.png"}
    text = markdown.read_text()
    # The exact command, first, that makes these tables again.
    assert text.splitlines()[3] == "fusedkv bench " + " ".join(argv[:4]) + " --out " + str(tmp_path / "out") + \
        " --markdown " + str(markdown) + " --quick --max-calls-per-jit 8"
    assert document["meta"]["command"] == text.splitlines()[3]
    assert "- Devices: jax: stand-in" in text and "| jnp-jit | baseline | 4 |" in text


def test_importing_the_bench_imports_no_framework_nor_plotting_library():
    probe = ("import sys, interop.bench, interop.bench.registry, interop.bench.runner, interop.bench.plots, "
             "interop.bench.timers, interop.bench.workload, interop.bench.check, interop.bench.baselines; "
             "print(sorted(m for m in ('torch', 'jax', 'triton', 'matplotlib', 'tqdm') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_selection_adds_what_each_row_is_read_against_and_skips_frameworks_without_a_gpu():
    runnable, skipped = select(["kernel"], {"torch": "gpu"})
    assert [i.name for i in runnable] == ["triton", "torch-copy"]
    assert [i.name for i in skipped] == ["pallas", "pallas-mosaic", "pallas-pdl"]
    runnable, skipped = select(["interop"], {"torch": "gpu", "jax": "gpu"})
    assert [i.name for i in runnable] == ["interop-torch", "interop-jax", "interop-jax-to-torch",
                                          "interop-torch-to-jax", "triton-launch"]
    assert skipped == []
    # A materializer is read against its own GEMM, not against a copy.
    runnable, _ = select(["jax-materializer-cache", "torch-reference-flow"], {"torch": "gpu", "jax": "gpu"})
    assert [i.name for i in runnable] == ["torch-gemm", "torch-reference-flow", "jax-gemm", "jax-materializer-cache"]
    # Triton's own launch needs torch's GPU: where jax alone has one, host rows go without it.
    runnable, skipped = select(["jnp-jit-host"], {"jax": "gpu"})
    assert [i.name for i in runnable] == ["jnp-jit-host"] and skipped == []
    with pytest.raises(ValueError, match=r"unknown implementations or kinds \['nope'\]"):
        select(["nope"], {"torch": "gpu"})


def test_the_options_kind_runs_each_option_beside_the_plain_op_and_fp8_weights_beside_bf16_ones():
    runnable, skipped = select(["options"], {"torch": "gpu", "jax": "gpu"})
    options = [f"{kernel}-{option}" for kernel in ("triton", "pallas") for option in ("v-multiplier", "tables",
                                                                                      "no-k-norm")]
    fp8 = ["torch-gemm-fp8", "torch-materializer-fp8", "jax-gemm-fp8", "jax-materializer-fp8"]
    assert [i.name for i in runnable] == ["triton", "pallas", "pallas-mosaic", "torch-copy", "xla-copy", "torch-gemm",
                                          "torch-materializer", "jax-gemm", "jax-materializer", *options,
                                          "pallas-cache", "pallas-mosaic-cache", *fp8]
    assert skipped == []
    assert {name: BY_NAME[name].gemm for name in fp8} == {
        "torch-gemm-fp8": "", "torch-materializer-fp8": "torch-gemm-fp8", "jax-gemm-fp8": "",
        "jax-materializer-fp8": "jax-gemm-fp8"}
    # Each FP8 row alone brings its bf16 twin, and a materializer both GEMMs.
    runnable, _ = select(["jax-materializer-fp8"], {"jax": "gpu"})
    assert [i.name for i in runnable] == ["jax-gemm", "jax-materializer", "jax-gemm-fp8", "jax-materializer-fp8"]


def test_every_materializer_row_names_its_frameworks_gemm_row():
    materializers = [i for i in IMPLEMENTATIONS if i.kind == "materializer" and not i.name.endswith("-gemm")]
    assert {i.name: i.gemm for i in materializers} == {
        "torch-materializer": "torch-gemm", "torch-materializer-cache": "torch-gemm",
        "torch-reference-flow": "torch-gemm", "jax-materializer": "jax-gemm", "jax-materializer-cache": "jax-gemm"}


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
    # A call of several kernels: the floor for each (20 of 1.5 us: 30 us), unless its bytes take longer.
    assert calls_per_jit(0, most=512, kernels=20) == 34
    assert calls_per_jit(30_000_000, most=512, kernels=4) == 100
    assert calls_per_jit(30_000_000, most=512, kernels=10) == 67
    # The draft shape in bf16, as the runner's docstring gives it.
    draft = SHAPES["draft"]
    assert [calls_per_jit(draft.op_bytes(tokens, "bfloat16"), most=512) for tokens in
            (1, 64, 256, 1024, 4096, 16384)] == [512, 512, 287, 72, 18, 8]


def test_a_call_of_xla_math_counts_the_kernels_xla_compiles_it_into_and_a_custom_call_its_declared_launches():
    pytest.importorskip("jax")
    from interop.bench import runner
    from interop.bench.workload import Workload

    workload = Workload(TINY, 3, "bfloat16", framework="jax", set_count=2)
    forward = runner.kernels_per_call(BY_NAME["jnp-jit"].prepare(workload))
    training = runner.kernels_per_call(BY_NAME["jnp-jit-train"].prepare(workload))
    # Unfused math is several kernels, forward or with its backward (how many is XLA's to
    # decide: on a GPU it fuses the training step into fewer than the forward alone).
    assert forward > 1 and training > 1
    effort = dataclasses.replace(ONCE, max_calls_per_jit=512)
    steps = BY_NAME["jnp-jit-train"].prepare(workload)
    assert runner.jit_calls(steps, effort, training) == min(512, max(8, math.ceil(1e-3 / (training * 1.5e-6))))
    assert runner.kernels_per_call(dataclasses.replace(steps, kernel_target="kernel", kernel_launches=2)) == 2
    assert runner.kernels_per_call(dataclasses.replace(steps, calls_bytes=1024)) == 1
    assert runner.kernels_per_call(dataclasses.replace(steps, fresh_outputs=False)) == 1


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
    # Batches long enough that a busy host (the suite runs in parallel) cannot swamp their difference.
    seconds, _ = in_jit_seconds(run, 2.0, sets, total, calls_per_jit=5, batch_seconds=0.05, repeats=5)
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


def test_a_step_of_two_kernels_a_call_passes_where_the_jit_launches_both_once_per_call():
    pytest.importorskip("jax")

    def twice_declared(workload):
        return dataclasses.replace(_callback_steps(workload, launches_per_call=2), kernel_launches=2)

    declared, = run(plan([TINY], [3], [Implementation("declared-twice", "jax", "backward", twice_declared)]),
                    dtype="bfloat16", framework="jax", effort=ONCE)
    assert declared.check == "ok" and declared.seconds is not None


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


@pytest.mark.parametrize("config", [FusedKVConfig(16, 192, 192, "gptj"), FusedKVConfig(32, 256, 256, "neox")],
                         ids=str)
def test_the_floor_takes_the_kernels_tile_of_the_same_rope_style(config, monkeypatch):
    jax = pytest.importorskip("jax")
    from fusedkv_jax import devices
    from fusedkv_jax import kernel as pallas_kernel
    from interop.bench import floors

    monkeypatch.setattr(devices, "multiprocessors", lambda: 132)  # the tiles of an H200
    taken = []
    monkeypatch.setattr(devices, "on_cpu", lambda kv: False)  # the GPU's tile, traced only
    monkeypatch.setattr(floors.pl, "pallas_call", lambda kernel, **options: taken.append(options) or (
        lambda *args: [jax.ShapeDtypeStruct(args[3].shape, args[3].dtype)] * 2))
    kv = jax.ShapeDtypeStruct((4096, 5, 2 * config.num_kv_heads * config.head_dim), jax.numpy.bfloat16)
    dest = jax.ShapeDtypeStruct((5, 4096, config.num_kv_heads, config.head_dim), jax.numpy.bfloat16)
    # The function under its jit: traced here with shapes alone, and with no trace cached.
    floors.copy.__wrapped__(kv, None, None, dest, dest, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                            rotary_dim=config.rotary_dim, rope_style=config.rope_style, cos_sin=False)
    block_tokens, block_heads, num_warps = pallas_kernel.default_tile(
        4096, 5, config.num_kv_heads, config.head_dim, rotary_dim=config.rotary_dim, rope_style=config.rope_style)
    [options] = taken
    assert options["grid"][2] == -(-config.num_kv_heads // block_heads)
    assert options["compiler_params"].num_warps == num_warps


@pytest.mark.parametrize("name", ["pallas", "pallas-pdl", "pallas-bwd", "pallas-train", "pallas-floor",
                                  "pallas-floor-cos-sin", "pallas-v-multiplier", "pallas-tables"])
def test_a_jit_of_many_calls_of_a_pallas_row_traces_its_kernels_as_one_call_does(name, monkeypatch):
    # Each call tracing its kernel anew made a row's jit of hundreds of calls take seconds to lower.
    jax = pytest.importorskip("jax")
    from jax.experimental import pallas
    from interop.bench import timers
    from interop.bench.workload import Workload

    traced, pallas_call = [], pallas.pallas_call  # the kernels' modules call it as pl.pallas_call
    monkeypatch.setattr(pallas, "pallas_call", lambda *args, **kwargs: traced.append(1) or pallas_call(*args, **kwargs))
    prepared = BY_NAME[name].prepare(Workload(TINY, 3, "bfloat16", framework="jax", set_count=2))

    def kernels_traced(calls):
        jax.clear_caches()
        traced.clear()
        run = timers.chained_calls(prepared.step, calls, len(prepared.varying), fresh_outputs=prepared.fresh_outputs,
                                   opaque_step=prepared.kernel_target is not None,
                                   shift_inputs=prepared.shift_inputs, compiler_options=prepared.compiler_options)
        run.trace(prepared.fixed, prepared.varying, jax.eval_shape(prepared.new_outputs),
                  jax.numpy.zeros(calls, jax.numpy.float32))
        return len(traced)

    assert kernels_traced(1) >= 1
    assert kernels_traced(6) == kernels_traced(1)


ODD = BenchShape("odd", FusedKVConfig(num_kv_heads=3, head_dim=80, rotary_dim=40, rope_style="gptj"), 3,
                 "3 layers, 3 heads of 80", hidden=64)


@pytest.mark.parametrize("shape", [TINY, ODD], ids=lambda shape: shape.name)
def test_the_triton_floor_rows_copy_k_and_v_bit_for_bit(shape):
    pytest.importorskip("torch")
    from interop.bench.workload import Workload

    workload = Workload(shape, 5, "bfloat16", framework="torch", torch_device="cuda" if ON_GPU else "cpu",
                        set_count=2)
    for name in ("triton-floor", "triton-floor-cos-sin"):
        assert BY_NAME[name].kind == "floor" and not BY_NAME[name].does_op
        calls = BY_NAME[name].prepare(workload)
        assert calls.check() == "ok"
        k, v = calls.call(1)
        assert not (k.isnan().any() or v.isnan().any())  # the other set's outputs, written too


@pytest.mark.parametrize("config", [FusedKVConfig(16, 192, 48, "neox"), FusedKVConfig(32, 256, 64, "neox")], ids=str)
@pytest.mark.parametrize("total_ctx", [1, 96, 4096])
def test_the_triton_floor_launches_on_the_kernels_plan(config, total_ctx, monkeypatch):
    torch = pytest.importorskip("torch")
    from fusedkv_torch import kernel as triton_kernel
    from interop.bench import triton_floors

    monkeypatch.setattr(triton_kernel, "_multiprocessors", lambda: 132)  # the tiles of an H200
    triton_kernel._plan.cache_clear()
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **options: launched.append((grid, options))

    monkeypatch.setattr(triton_floors, "_copy_kernel", Recorder())
    kv = torch.empty((total_ctx, 5, 2 * config.num_kv_heads * config.head_dim), dtype=torch.bfloat16)
    dest = torch.empty((5, total_ctx, config.num_kv_heads, config.head_dim), dtype=torch.bfloat16)
    triton_floors.copy(kv, torch.empty((64, config.rotary_dim)), torch.zeros(total_ctx, dtype=torch.int32), dest,
                       dest, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, rotary_dim=config.rotary_dim,
                       rope_style=config.rope_style, cos_sin=True)
    block_tokens, block_heads, num_warps = triton_kernel.default_tile(
        total_ctx, config.num_kv_heads, config.head_dim, n_layers=5, itemsize=2, interpret=triton_kernel._launcher.interpreted)
    triton_kernel._plan.cache_clear()
    [(grid, options)] = launched
    assert grid == (-(-total_ctx // block_tokens) * 5 * (config.num_kv_heads // block_heads),)
    assert (options["BLOCK_T"], options["BLOCK_HEADS"], options["num_warps"]) == (block_tokens, block_heads, num_warps)


def test_the_triton_floor_refuses_arrays_it_does_not_index_as_the_kernel_reads_them():
    torch = pytest.importorskip("torch")
    from interop.bench import triton_floors

    config = TINY.config
    kv = torch.empty((4, 2, 2 * config.kv_size), dtype=torch.bfloat16)
    dest = torch.empty((2, 4, config.num_kv_heads, config.head_dim), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expected unit-stride rows of kv and cos_sin_cache and contiguous outputs"):
        triton_floors.copy(kv, torch.empty((64, 16)), torch.zeros(4, dtype=torch.int32), dest.transpose(0, 1),
                           dest, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                           rotary_dim=config.rotary_dim, rope_style="neox", cos_sin=False)


def test_the_floor_check_fails_outputs_that_are_not_k_and_v():
    jnp = pytest.importorskip("jax.numpy")
    from interop.bench.check import kv_copy_verdict as copy_verdict

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


def test_the_pdl_row_is_the_pallas_row_in_a_jit_compiled_with_xla_pdl(monkeypatch):
    jax = pytest.importorskip("jax")
    from interop.bench.runner import measure
    from interop.bench.workload import Workload

    compiled_with = []
    jit = jax.jit

    def recording_jit(function, **options):
        if function.__qualname__.startswith("chained_calls."):  # a row's jit, not the kernel's own
            compiled_with.append(options.get("compiler_options"))
        return jit(function, **options)

    monkeypatch.setattr(jax, "jit", recording_jit)
    workload = Workload(TINY, 3, "bfloat16", framework="jax", set_count=2)
    measurements = [measure(BY_NAME[name], workload, dataclasses.replace(ONCE, max_calls_per_jit=2), shape=TINY,
                            total_ctx=3, dtype="bfloat16") for name in ("pallas", "pallas-pdl")]
    assert [m.check for m in measurements] == ["ok", "ok"]
    assert all(m.seconds is not None and m.method.startswith("in-jit, 2 calls/jit") for m in measurements)
    assert compiled_with == [None, {"xla_gpu_enable_pdl": True}]


@pytest.mark.parametrize("shape, tokens, dtype, reason", [
    (TINY, 64, "bfloat16", "no Mosaic GPU kernel for bfloat16 neox, head_dim 32, rotary 16"),
    (MOSAIC_TINY, 64, "float32", "no Mosaic GPU kernel for float32 neox, head_dim 32, rotary 32"),
    pytest.param(MOSAIC_TINY, 8, "bfloat16", "Mosaic GPU's interpreter takes multiples of 64 tokens",
                 marks=pytest.mark.skipif(ON_GPU, reason="the interpreter's rule")),
    pytest.param(MOSAIC_TINY, 12, "bfloat16", "Mosaic GPU takes at most 8 tokens or a multiple of 8",
                 marks=pytest.mark.skipif(not ON_GPU, reason="the compiled kernel's rule")),
])
@pytest.mark.parametrize("name", ["pallas-mosaic", "pallas-mosaic-floor", "pallas-mosaic-floor-cos-sin",
                                  "pallas-mosaic-cache"])
def test_the_mosaic_rows_are_not_applicable_where_mosaic_has_no_kernel(shape, tokens, dtype, reason, name):
    pytest.importorskip("jax")
    errors = []
    (measurement,) = run(plan([shape], [tokens], [BY_NAME[name]]), dtype=dtype, framework="jax",
                         effort=ONCE, on_error=lambda failed, trace: errors.append(trace))
    assert measurement.check == f"n/a: {reason}"
    assert measurement.seconds is None and measurement.ok and not errors


@pytest.mark.parametrize("name", ["pallas-cache", "pallas-mosaic-cache"])
def test_the_cache_rows_write_each_token_to_its_slot_and_their_check_reads_the_slots(name):
    jax = pytest.importorskip("jax")
    from interop.bench.check import checked_rows
    from interop.bench.runner import measure
    from interop.bench.timers import chained_calls
    from interop.bench.workload import Workload

    workload = Workload(MOSAIC_TINY, 64, "bfloat16", framework="jax", set_count=2)
    measurement = measure(BY_NAME[name], workload, dataclasses.replace(ONCE, max_calls_per_jit=2),
                          shape=MOSAIC_TINY, total_ctx=64, dtype="bfloat16")
    assert measurement.check == "ok" and not measurement.error and measurement.seconds is not None
    steps = BY_NAME[name].prepare(workload)
    caches = steps.new_outputs()
    assert caches[0].shape[1] == workload.num_slots
    sampled = len(checked_rows(64)) * MOSAIC_TINY.n_layers * MOSAIC_TINY.config.kv_size
    assert steps.check(caches, 0) == f"FAIL: {2 * sampled} elements unwritten (NaN)"  # the sampled tokens' slots
    # The caches of set 1's slots, read with set 0's: each of set 0's tokens finds another token's row.
    run_chain = chained_calls(steps.step, 1, len(steps.varying))
    written, _ = run_chain(steps.fixed, steps.varying[1:], caches, jax.numpy.zeros(1))
    assert steps.check(written, 0).startswith("FAIL")


@pytest.mark.parametrize("name", ["pallas-mosaic-floor", "pallas-mosaic-floor-cos-sin"])
def test_the_mosaic_floor_rows_copy_k_and_v_bit_for_bit_into_the_outputs_they_are_given(name):
    pytest.importorskip("jax")
    from interop.bench.runner import measure
    from interop.bench.workload import Workload

    shape = dataclasses.replace(MOSAIC_TINY, n_layers=2)
    workload = Workload(shape, 128, "bfloat16", framework="jax", set_count=2)
    measurement = measure(BY_NAME[name], workload, dataclasses.replace(ONCE, max_calls_per_jit=2), shape=shape,
                          total_ctx=128, dtype="bfloat16")
    assert measurement.kind == "floor" and not measurement.does_op
    assert measurement.check == "ok" and measurement.seconds is not None


@pytest.mark.parametrize("cos_sin", [False, True])
@pytest.mark.parametrize("heads, head_dim, rotary_dim, tokens", [(8, 128, 128, 4096), (2, 256, 256, 16)])
def test_the_mosaic_floor_lowers_for_a_gpu_writing_the_outputs_it_is_given(heads, head_dim, rotary_dim, tokens,
                                                                           cos_sin):
    # Mosaic GPU builds its IR in Python: its layouts and copies are checked without a GPU.
    jax = pytest.importorskip("jax")
    from interop.bench import mosaic_floors

    output = jax.ShapeDtypeStruct((5, tokens, heads, head_dim), "bfloat16")
    args = (jax.ShapeDtypeStruct((tokens, 5, 2 * heads * head_dim), "bfloat16"),
            jax.ShapeDtypeStruct((100, rotary_dim), "float32"), jax.ShapeDtypeStruct((tokens,), "int32"), output, output)
    copy = functools.partial(mosaic_floors.copy, num_kv_heads=heads, head_dim=head_dim, rotary_dim=rotary_dim,
                             cos_sin=cos_sin, interpret=False)
    text = jax.jit(copy).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "output_operand_aliases" in text


@pytest.mark.skipif(not ON_GPU, reason="the compiled kernel's rule")
def test_the_mosaic_floor_rows_are_not_applicable_to_contexts_of_untiled_copies():
    (measurement,) = run(plan([MOSAIC_TINY], [4], [BY_NAME["pallas-mosaic-floor"]]), dtype="bfloat16",
                         framework="jax", effort=ONCE)
    assert measurement.check == "n/a: the Mosaic GPU floor copies tiles of 8 rows: a multiple of 8 tokens"


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
    from interop.bench.rows import nan_pair

    outputs = nan_pair(workload, "jax")
    return Calls(lambda i: outputs, prepared.sets, prepared.bytes_moved,
                 lambda: op_verdict(*outputs, *workload.op_args(0, "jax"), static=workload.shape.static()))


def test_a_failing_implementation_is_marked_and_never_timed():
    pytest.importorskip("jax")
    implementations = [BY_NAME["jnp-jit"], Implementation("off-by-one", "jax", "kernel", _broken_steps),
                       Implementation("writes-nothing", "jax", "host", _unwritten_calls, clock="host")]
    measurements = run(plan([TINY], [3], implementations), dtype="bfloat16", framework="jax", effort=ONCE)
    by_name = {m.implementation: m for m in measurements}
    assert by_name["jnp-jit"].check == "ok" and by_name["jnp-jit"].seconds is not None
    # 8 calls (the cap here) of 1.5 us (the floor: 3 tokens move 3 KB) for each of their kernels
    kernels = int(re.match(r"in-jit, 8 calls/jit of (\d+) kernels \(", by_name["jnp-jit"].method).group(1))
    assert f" kernels (~{8 * kernels * 1.5e-3:.2g} ms est.)" in by_name["jnp-jit"].method
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
# rest. The Mosaic GPU rows take no TINY shape (their own tests above); Triton's own launch
# needs a compiled kernel (its own test below).
CHECKED_HERE = [i for i in IMPLEMENTATIONS if (ON_GPU or i.name not in ("torch-compile", "torch-compile-host",
                                                                         "triton-launch", "triton-launch-reads"))
                and not i.name.startswith("pallas-mosaic")]


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
        run_chain = chained_calls(prepared.step, 4, len(prepared.varying), fresh_outputs=prepared.fresh_outputs,
                                  shift_inputs=prepared.shift_inputs)
        outputs, _ = run_chain(prepared.fixed, prepared.varying, prepared.new_outputs(), jax.numpy.zeros(4))
        assert prepared.check(outputs, 3 % len(prepared.varying)) == "ok"
    else:
        assert prepared.check() == "ok"
    assert prepared.bytes_moved >= TINY.op_bytes(5, "bfloat16") or implementation.kind == "materializer"


@pytest.mark.parametrize("option", ["v-multiplier", "tables", "no-k-norm"])
def test_an_option_row_gives_its_option_to_the_op_and_its_check_fails_the_plain_ops_outputs(option):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    from interop.bench import options
    from interop.bench.rows import op_calls
    from interop.bench.timers import chained_calls
    from interop.bench.workload import Workload

    workload = Workload(TINY, 5, "bfloat16", framework="torch", torch_device="cuda" if ON_GPU else "cpu",
                        set_count=3)
    plain = BY_NAME["triton"].prepare(workload)
    plain_k, plain_v = (out.clone() for out in plain.call(0))
    row = BY_NAME[f"triton-{option}"].prepare(workload)
    k, v = row.call(0)
    assert not (torch.equal(k, plain_k) and torch.equal(v, plain_v))
    ignores_option = op_calls(workload, "torch", lambda *args, **keywords: (plain_k, plain_v), given_outputs=False,
                              options=options.option_arguments(workload, "torch", option))
    assert ignores_option.check().startswith("FAIL")
    steps = BY_NAME[f"pallas-{option}"].prepare(workload)
    plain_steps = BY_NAME["pallas"].prepare(workload)
    run_chain = chained_calls(plain_steps.step, 1, len(plain_steps.varying))
    plain_outputs, _ = run_chain(plain_steps.fixed, plain_steps.varying, plain_steps.new_outputs(),
                                 jax.numpy.zeros(1))
    assert plain_steps.check(plain_outputs, 0) == "ok" and steps.check(plain_outputs, 0).startswith("FAIL")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_fp8_rows_run_the_workloads_weights_quantized_per_row(framework):
    pytest.importorskip(framework)
    from interop.bench import materializers
    from interop.core.arrays import as_numpy
    from interop.core.materializer import dequantized_weight

    bf16 = materializers.host_layers(TINY, "bfloat16")
    fp8 = materializers.host_layers(TINY, "bfloat16", fp8=True)
    materializer = (materializers.torch_materializer(TINY, "bfloat16", "cuda" if ON_GPU else "cpu", fp8=True)
                    if framework == "torch" else materializers.jax_materializer(TINY, "bfloat16", fp8=True))
    assert materializer.config.fp8_weights
    assert as_numpy(materializer.weight_scale).shape == (TINY.n_layers * 2 * TINY.config.kv_size,)
    for quantized, layer in zip(fp8, bf16):
        weight = as_numpy(layer.kv_proj_weight).astype(np.float32)
        # e4m3 keeps 3 mantissa bits: each weight within 2**-4 of itself, plus the row's smallest step
        assert np.all(np.abs(dequantized_weight(quantized) - weight)
                      <= 2.0 ** -4 * np.abs(weight) + np.abs(weight).max(axis=1, keepdims=True) * 2.0 ** -15)


TRAINING = ["triton-train", "torch-compile-train", "pallas-train", "jnp-jit-train"]


def test_the_backward_kind_holds_the_training_steps_read_against_their_frameworks_copy():
    runnable, skipped = select(["backward"], {"torch": "gpu", "jax": "gpu"})
    assert [i.name for i in runnable] == ["triton-bwd", "pallas-bwd", "pallas-mosaic-bwd", *TRAINING, "torch-copy",
                                          "xla-copy"]
    assert skipped == [] and not any(BY_NAME[name].does_op for name in TRAINING)


def test_a_training_step_moves_the_forwards_and_the_backwards_bytes():
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    from interop.bench.workload import Workload

    workload = Workload(TINY, 5, "bfloat16", framework="torch", torch_device="cuda" if ON_GPU else "cpu",
                        set_count=3)
    kv_bytes = 5 * 2 * (2 * 2 * 32) * 2  # tokens * layers * (K and V of 2 heads of 32) * bf16
    # forward: read kv, write K and V; backward: read kv, K's and V's gradients, write kv's
    assert {name: BY_NAME[name].prepare(workload).bytes_moved for name in TRAINING} == dict.fromkeys(
        TRAINING, (2 + 3) * kv_bytes)


def _detached_kv(math, detach):
    """``math`` of a ``kv`` of the same values that carries no gradient back to ``kv``."""
    def forward(kv, *rest, config):
        return math(kv * 0 + detach(kv), *rest, config=config)
    return forward


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_training_step_whose_kv_gradient_is_wrong_fails_its_check(framework):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    from interop.bench import training
    from interop.bench.baselines import jnp_reference_math, torch_reference_math
    from interop.bench.timers import chained_calls
    from interop.bench.workload import Workload

    workload = Workload(TINY, 5, "bfloat16", framework="torch", torch_device="cuda" if ON_GPU else "cpu",
                        set_count=3)
    if framework == "torch":
        forward = functools.partial(_detached_kv(torch_reference_math, torch.Tensor.detach), config=TINY.config)
        verdict = training.torch_training(workload, forward).check()
    else:
        forward = functools.partial(_detached_kv(jnp_reference_math, jax.lax.stop_gradient), config=TINY.config)
        prepared = training.jax_training(workload, forward)
        run_chain = chained_calls(prepared.step, 1, len(prepared.varying), fresh_outputs=True)
        outputs, _ = run_chain(prepared.fixed, prepared.varying, prepared.new_outputs(), jax.numpy.zeros(1))
        verdict = prepared.check(outputs, 0)
    # K and V are right; every one of kv's gradient elements is zero
    assert re.fullmatch(r"FAIL: grad_kv: \d+ elements off by more than .*", verdict), verdict


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="times kernels on a GPU")
def test_on_a_gpu_the_command_times_the_kernels_and_writes_its_files(tmp_path, capsys):
    args = _parser().parse_args(["--tokens", "16", "--only", "kernel", "--quick", "--out", str(tmp_path)])
    assert run_bench_command(args) == 0
    table = capsys.readouterr().out
    assert re.search(r"^triton\s+kernel\s+16\s+\d+\.\d\d\s+\d+\s+\d+%\s+\d+%", table, re.MULTILINE)
    assert "device copy ceiling: " in table and "a 1 GiB torch copy" in table
    assert {path.name for path in tmp_path.iterdir()} >= {"bench.csv", "bench.json", "kernels-draft-bfloat16.png",
                                                          "latency-draft-bfloat16.png"}


# --- the materializers' GEMM rows: the very call each materializer makes -------------------


def _torch_device():
    return "cuda" if ON_GPU else "cpu"


def test_the_torch_gemm_row_makes_the_gemm_call_of_each_materializer_row_on_the_same_sets(monkeypatch):
    torch = pytest.importorskip("torch")
    from interop.bench import workload as workload_module
    from interop.bench.workload import Workload

    # A cache this small gives a row moving fewer bytes more input sets: the GEMM alone would
    # rotate over other sets than its materializer, unless they share theirs.
    monkeypatch.setattr(workload_module, "l2_bytes", lambda: 8000)
    workload = Workload(TINY, 5, "bfloat16", framework="torch", torch_device=_torch_device(), set_count=4)
    calls, mm = [], torch.mm

    def recording(*args, **kwargs):
        calls.append([(t.data_ptr(), tuple(t.shape), t.stride()) for t in (*args, *kwargs.values())])
        return mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", recording)

    def gemm_calls(name):
        prepared = BY_NAME[name].prepare(workload)
        calls.clear()
        for i in range(prepared.sets):
            prepared.call(i)
        return prepared.sets, list(calls)

    sets, gemm = gemm_calls("torch-gemm")
    assert sets == 2 and len(gemm) == sets  # one GEMM a call, on the materializer's own workspace
    for name in ("torch-materializer", "torch-materializer-cache", "torch-reference-flow"):
        assert gemm_calls(name) == (sets, gemm), name


def _dot_generals(jaxpr) -> list:
    """Every ``dot_general`` of a jaxpr and of the jaxprs inside it: its parameters and operand types."""
    found = []
    for equation in jaxpr.eqns:
        if equation.primitive.name == "dot_general":
            found.append((str(sorted(equation.params.items())), [str(v.aval) for v in equation.invars]))
        for param in equation.params.values():
            for inner in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += _dot_generals(inner)
    return found


def test_the_jax_gemm_row_runs_its_materializers_projection_fed_and_sized_alike(monkeypatch):
    jax = pytest.importorskip("jax")
    from interop.bench import runner
    from interop.bench.workload import Workload

    # Estimates slow enough that a GEMM and its materializer, each sized by its own bytes,
    # would hold different numbers of calls a jit.
    monkeypatch.setattr(runner, "ESTIMATED_BYTES_PER_SECOND", 3e8)
    effort = dataclasses.replace(ONCE, max_calls_per_jit=64)
    workload = Workload(TINY, 5, "bfloat16", framework="jax", set_count=3)
    gemm = BY_NAME["jax-gemm"].prepare(workload)
    gemm_dots = _dot_generals(jax.make_jaxpr(gemm.step)(gemm.fixed, gemm.varying[0], gemm.new_outputs()).jaxpr)
    assert len(gemm_dots) == 1
    for name in ("jax-materializer", "jax-materializer-cache"):
        row = BY_NAME[name].prepare(workload)
        assert [v[0] for v in row.varying] == [v[0] for v in gemm.varying]  # the same ctx_hidden arrays
        assert row.fixed is gemm.fixed  # the same materializer, so the same weights
        assert runner.jit_calls(row, effort, runner.kernels_per_call(row)) == runner.jit_calls(
            gemm, effort, runner.kernels_per_call(gemm))
        assert row.shift_inputs is gemm.shift_inputs is True  # hidden + the chain's zero, in both
        dots = _dot_generals(jax.make_jaxpr(row.step)(row.fixed, row.varying[0], row.new_outputs()).jaxpr)
        assert dots == gemm_dots, name


# --- host rows: Triton's own launch -------------------------------------------------------


def test_the_launch_capture_records_the_compiled_kernel_its_grid_and_arguments_and_still_launches():
    from interop.bench.registry import captured_launches

    launched = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid, args, kwargs))

    class Launch:
        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, grid, stream, addresses, arguments):
            launched.append(("direct", grid, stream, addresses, arguments))

    kernel = Compiled()
    direct = Launch(kernel)

    def both():
        kernel[(4, 1, 1)](1, 2, stream=None)
        direct(8, 77, [5], (6,))

    seen = captured_launches(both, kernel_class=Compiled, launch_class=Launch)
    assert seen == [(kernel, (4, 1, 1), (1, 2), {"stream": None}), (kernel, (8, 1, 1), (5, 6), {})]
    assert launched == [((4, 1, 1), (1, 2), {"stream": None}), ("direct", 8, 77, [5], (6,))]
    kernel[(2, 1, 1)](3)
    direct(1, 0, [], ())
    assert len(seen) == 2 and len(launched) == 4  # the classes are as they were


@pytest.mark.skipif(ON_GPU, reason="interpreted, the Triton kernel has no compiled launch")
def test_tritons_own_launch_is_not_applicable_where_the_kernel_is_interpreted():
    pytest.importorskip("torch")
    from interop.bench.runner import measure
    from interop.bench.workload import Workload

    workload = Workload(TINY, 3, "bfloat16", framework="torch", torch_device="cpu", set_count=2)
    measurement = measure(BY_NAME["triton-launch"], workload, ONCE, shape=TINY, total_ctx=3, dtype="bfloat16")
    assert measurement.check == ("n/a: the Triton call launched no compiled kernel of its own (interpreted, "
                                 "or launched through kernel[grid])")
    assert measurement.ok and measurement.seconds is None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="launches the compiled kernel")
@pytest.mark.parametrize("name", ["triton-launch", "triton-launch-reads"])
def test_on_a_gpu_tritons_own_launch_writes_the_ops_outputs_and_is_timed(name):
    from interop.bench.runner import measure
    from interop.bench.workload import Workload

    workload = Workload(TINY, 3, "bfloat16", framework="torch", set_count=2)
    measurement = measure(BY_NAME[name], workload, ONCE, shape=TINY, total_ctx=3, dtype="bfloat16")
    assert measurement.check == "ok" and measurement.seconds is not None


def test_the_host_option_runs_the_eager_rows_at_decode_size_against_tritons_launch():
    from interop.bench.command import token_counts, words_to_run

    args = _parser().parse_args(["--host"])
    assert words_to_run(args) == ["host", "interop"] and token_counts(args) == [16]
    runnable, _ = select(words_to_run(args), {"torch": "gpu", "jax": "gpu"})
    assert {i.clock for i in runnable} == {"host"}
    assert [i.name for i in runnable][:7] == ["interop-torch", "interop-jax", "interop-jax-to-torch",
                                              "interop-torch-to-jax", "triton-launch", "triton-launch-reads",
                                              "triton-host"]
    assert token_counts(_parser().parse_args(["--host", "--tokens", "4,1"])) == [1, 4]
    assert words_to_run(_parser().parse_args(["--host", "--only", "triton-host"])) == ["triton-host"]
    assert words_to_run(_parser().parse_args([])) is None  # every row


# --- the sweep: tiles and forms -----------------------------------------------------------


def test_sweep_and_forms_take_tiles_and_forms_and_refuse_others(capsys):
    from interop.bench import sweep

    assert _parser().parse_args(["--sweep"]).sweep == sweep.DEFAULT_TILES
    args = _parser().parse_args(["--sweep", "d,1x8x2,1x8x2", "--forms", "pp,1p"])
    assert (args.sweep, args.forms) == (("d", "1x8x2"), ("pp", "1p"))
    for option, bad, expected in (("--sweep", "3x8x2", "expected comma-separated tiles"),
                                  ("--sweep", "1x8", "expected comma-separated tiles"),
                                  ("--forms", "2p", "expected comma-separated two-letter forms"),
                                  ("--forms", "ppp", "expected comma-separated two-letter forms")):
        with pytest.raises(SystemExit) as exit_info:
            _parser().parse_args([option, bad])
        assert exit_info.value.code == 2
        assert f"argument {option}: got {bad!r}, {expected}" in capsys.readouterr().err


def test_sweep_rows_are_named_by_kernel_form_and_tile_and_run_beside_the_default_kernels():
    from interop.bench import sweep
    from interop.bench.command import words_to_run

    rows = sweep.implementations(("d", "1x2x1"), None)
    assert [i.name for i in rows] == ["triton-d", "triton-1x2x1", "pallas-d", "pallas-1x2x1"]
    assert [i.name for i in sweep.implementations(("d",), ("pp", "1p"))] == ["pallas-pp-d", "pallas-1p-d"]
    assert {i.kind for i in rows} == {"sweep"}
    assert words_to_run(_parser().parse_args(["--sweep"])) == ["triton", "pallas"]
    runnable, _ = select(["triton", "pallas"], {"torch": "gpu", "jax": "gpu"}, extra=rows)
    assert [i.name for i in runnable] == ["triton", "pallas", "torch-copy", "xla-copy", "triton-d",
                                          "triton-1x2x1", "pallas-d", "pallas-1x2x1"]


@pytest.mark.parametrize("only, expected", [
    (None, ["triton-d", "triton-2x1x1", "pallas-d", "pallas-2x1x1"]),
    ("triton", ["triton-d", "triton-2x1x1"]),
    ("pallas,xla-copy", ["pallas-d", "pallas-2x1x1"]),
    ("triton,pallas", ["triton-d", "triton-2x1x1", "pallas-d", "pallas-2x1x1"]),
    ("torch-copy", ["triton-d", "triton-2x1x1", "pallas-d", "pallas-2x1x1"]),
])
def test_an_only_naming_one_kernel_sweeps_that_kernels_tiles_alone(only, expected):
    from interop.bench.command import sweep_rows

    argv = ["--sweep", "d,2x1x1"] + ([] if only is None else ["--only", only])
    assert [i.name for i in sweep_rows(_parser().parse_args(argv))] == expected
    forms = _parser().parse_args(["--forms", "pp", "--only", "triton"])
    assert [i.name for i in sweep_rows(forms)] == ["pallas-pp-d"]  # forms are the Pallas kernel's
    assert sweep_rows(_parser().parse_args(["--only", "triton"])) == []


def test_a_triton_tile_row_passes_its_tile_to_the_public_call_and_is_checked(monkeypatch):
    pytest.importorskip("torch")
    import fusedkv_torch
    from interop.bench import sweep
    from interop.bench.rows import NotApplicable
    from interop.bench.workload import Workload

    seen, public = [], fusedkv_torch.fused_kv_norm_rope

    def recording(*args, **kwargs):
        seen.append({k: kwargs[k] for k in ("block_tokens", "block_heads", "num_warps") if k in kwargs})
        return public(*args, **kwargs)

    monkeypatch.setattr(fusedkv_torch, "fused_kv_norm_rope", recording)
    workload = Workload(TINY, 5, "bfloat16", framework="torch", torch_device=_torch_device(), set_count=2)
    (row,) = sweep.implementations(("2x2x1",), None)[:1]
    assert row.prepare(workload).check() == "ok"
    assert seen == [dict(block_tokens=2, block_heads=2, num_warps=1)]
    (wide,) = sweep.implementations(("1x4x1",), None)[:1]
    with pytest.raises(NotApplicable, match="the Triton kernel's block_heads must divide the 2 heads"):
        wide.prepare(workload)


def test_a_form_forces_the_pallas_kernels_rules_while_it_traces_and_is_checked():
    jax = pytest.importorskip("jax")
    from fusedkv_jax import kernel
    from interop.bench import sweep
    from interop.bench.timers import chained_calls
    from interop.bench.workload import Workload

    rules = (kernel.loops_over_layers, kernel.loads_k_rows)
    with sweep.forced("10"):
        assert kernel.loops_over_layers(16, 2, 2, 32, interpret=True) is True
        assert kernel.loads_k_rows(TINY.config) is False
    assert (kernel.loops_over_layers, kernel.loads_k_rows) == rules
    workload = Workload(TINY, 5, "bfloat16", framework="jax", set_count=2)
    (row,) = sweep.implementations(("d",), ("1p",))
    prepared = row.prepare(workload)
    chain = chained_calls(prepared.step, 2, len(prepared.varying))
    outputs, _ = chain(prepared.fixed, prepared.varying, prepared.new_outputs(), jax.numpy.zeros(2))
    assert prepared.check(outputs, 1) == "ok"
    assert (kernel.loops_over_layers, kernel.loads_k_rows) == rules


# --- alternated rounds, cache slots, the recorded command -----------------------------------


def test_rounds_time_every_row_once_a_round_in_alternating_order_and_report_the_median(monkeypatch):
    pytest.importorskip("jax")
    from interop.bench import runner

    order, seconds = [], {"a": [3e-6, 1e-6, 2e-6], "b": [5e-6, 4e-6, 6e-6]}

    def timed(call, sets, **options):
        name = call(0)
        order.append(name)
        return seconds[name][order.count(name) - 1]

    monkeypatch.setattr(runner, "host_seconds_per_call", timed)

    def rows(name, verdict="ok"):
        return Implementation(name, "jax", "host", lambda workload: Calls(lambda i: name, 1, 0, lambda: verdict),
                              clock="host")

    measured = run(plan([TINY], [3], [rows("a"), rows("b"), rows("c", "FAIL: wrong")]), dtype="bfloat16",
                   framework="jax", effort=ONCE, rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"]  # the failing row is never timed
    a, b, c = measured
    assert (a.seconds, a.rounds) == (2e-6, (3e-6, 1e-6, 2e-6)) and b.seconds == 5e-6
    assert a.method == "host loop, 3 calls, median of 3 rounds (1.00-3.00 us)"
    assert c.check == "FAIL: wrong" and c.seconds is None


@pytest.mark.parametrize("rounds", [1, 2])
def test_each_row_records_the_host_time_its_check_and_timing_took(monkeypatch, rounds):
    pytest.importorskip("jax")
    import time

    from interop.bench import runner

    monkeypatch.setattr(runner, "host_seconds_per_call", lambda call, sets, **options: time.sleep(0.05) or 1e-6)

    def checked_in(seconds, verdict="ok"):
        return lambda workload: Calls(lambda i: None, 1, 0, lambda: time.sleep(seconds) or verdict)

    slow, failing = (Implementation(name, "jax", "host", prepare, clock="host") for name, prepare in
                     (("slow", checked_in(0.1)), ("failing", checked_in(0.02, "FAIL: wrong"))))
    timed, untimed = run(plan([TINY], [3], [slow, failing]), dtype="bfloat16", framework="jax", effort=ONCE,
                         rounds=rounds)
    assert 0.1 + rounds * 0.05 <= timed.wall_seconds < 1.0 + rounds * 0.05
    assert 0.02 <= untimed.wall_seconds < 0.5 and untimed.seconds is None


def test_a_bench_json_written_before_a_field_existed_reads_with_its_default(tmp_path):
    from interop.bench.report import read_data

    write_data(annotate(FIXED, CEILING), tmp_path, {"devices": {}})
    document = json.loads((tmp_path / "bench.json").read_text())
    for record in document["rows"]:
        del record["wall_seconds"]
    (tmp_path / "bench.json").write_text(json.dumps(document))
    _, rows = read_data(tmp_path / "bench.json")
    assert [(m.implementation, m.tokens) for m in rows] == [(m.implementation, m.tokens) for m in FIXED]
    assert [m.seconds for m in rows] == pytest.approx([m.seconds for m in FIXED])
    assert all(m.wall_seconds == 0.0 for m in rows)


def test_cache_slots_are_distinct_and_inside_the_cache():
    pytest.importorskip("jax")
    from interop.bench.workload import Workload

    workload = Workload(TINY, 7, "bfloat16", framework="jax", set_count=2)
    assert workload.num_slots == 14
    for index in range(2):
        slots = np.asarray(workload.slots(index, "jax"))
        assert slots.dtype == np.int32 and len(set(slots.tolist())) == 7
        assert 0 <= slots.min() and slots.max() < workload.num_slots


def test_the_recorded_command_line_parses_back_to_the_same_options():
    import shlex

    from interop.bench.command import command_line

    argv = ["--shape", "all", "--tokens", "16,4", "--host", "--sweep", "--forms", "1p", "--rounds", "3",
            "--markdown", "my tables.md", "--quick"]
    args = _parser().parse_args(argv)
    line = command_line(args)
    assert line.startswith("fusedkv bench --tokens 4,16 --shape all --host --sweep --forms 1p --rounds 3 ")
    assert vars(_parser().parse_args(shlex.split(line)[2:])) == vars(args)
    assert command_line(_parser().parse_args([])) == "fusedkv bench"


# --- the shape grid -----------------------------------------------------------------------


def _grid_axes(shape):
    """A grid configuration's value on each axis of the grid, read from its configuration."""
    config = shape.config
    return dict(head_dim=config.head_dim, num_kv_heads=config.num_kv_heads, n_layers=shape.n_layers,
                rotary={config.head_dim: "full", config.head_dim // 2: "half",
                        config.head_dim // 4: "quarter"}[config.rotary_dim],
                rope_style=config.rope_style, dtype=shape.dtype)


def test_the_grid_is_forty_distinct_configurations_drawn_alike_from_its_seed():
    from interop.bench.shapes import GRID, grid_shapes

    assert grid_shapes() == grid_shapes() == list(GRID.values())
    assert len(GRID) == 40 and len({shape.name for shape in GRID.values()}) == 40
    assert len({(shape.config, shape.n_layers, shape.dtype) for shape in GRID.values()}) == 40
    assert grid_shapes(seed=1) != grid_shapes()


def test_each_half_of_the_grid_covers_every_value_of_every_axis():
    from interop.bench.shapes import GRID

    axes = dict(head_dim={64, 80, 96, 128, 192, 256}, num_kv_heads={1, 2, 4, 8, 16, 32}, n_layers={1, 2, 3, 5, 8},
                rotary={"full", "half", "quarter"}, rope_style={"neox", "gptj"},
                dtype={"bfloat16", "float16", "float32"})
    for half in ("fit", "held-out"):
        drawn = [_grid_axes(shape) for shape in GRID.values() if shape.half == half]
        assert len(drawn) == 20
        assert {axis: {values[axis] for values in drawn} for axis in axes} == axes, half


def test_the_grid_halves_alternate_by_name_and_names_spell_the_configuration():
    from interop.bench.shapes import GRID

    tags = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
    for index, name in enumerate(sorted(GRID)):
        shape = GRID[name]
        config = shape.config
        assert shape.half == ("fit" if index % 2 == 0 else "held-out")
        assert name == (f"g{index:02d}-hd{config.head_dim}-h{config.num_kv_heads}-l{shape.n_layers}-"
                        f"r{config.rotary_dim}-{config.rope_style}-{tags[shape.dtype]}")


def test_every_grid_configuration_passes_the_contract_validation():
    from interop.bench.shapes import GRID
    from interop.core.spec import validate_call

    for shape in GRID.values():
        inputs = random_inputs(shape.config, n_layers=shape.n_layers, total_ctx=2, dtype=shape.dtype,
                               max_position=8, seed=0)
        call = validate_call(*inputs.arrays(), **shape.static())
        assert (call.n_layers, call.total_ctx, call.config) == (shape.n_layers, 2, shape.config)


def test_grid_sizes_over_eight_gib_of_kv_and_outputs_are_left_out_and_said():
    from interop.bench.command import _grid_meta, over_memory
    from interop.bench.shapes import GRID

    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}
    shapes = list(GRID.values())
    # kv read once, K and V written once: twice tokens * layers * 2 * heads * head_dim elements
    expected = [(shape.name, 32768) for shape in shapes if 2 * 32768 * shape.n_layers * 2 * shape.config.kv_size
                * itemsize[shape.dtype] > 8 * 2**30]
    assert expected and [(shape.name, tokens) for shape, tokens in over_memory(shapes, [1, 32768], "bfloat16")] \
        == expected
    assert not over_memory([SHAPES["draft"]], [1 << 20], "float32")  # the grid's limit alone
    first = next(shape for shape in shapes if shape.name == expected[0][0])
    gib = 4 * 32768 * first.n_layers * first.config.kv_size * itemsize[first.dtype] / 2**30
    assert _grid_meta(shapes, [32768], "bfloat16")["skipped"][0] == (
        f"{first.name} at 32768 tokens ({gib:.1f} GiB of kv and outputs, over 8 GiB)")


def test_the_grid_options_pick_configurations_kernels_and_token_counts():
    from interop.bench.command import bench_shapes, grid_refusal, token_counts, words_to_run
    from interop.bench.shapes import GRID

    names = list(GRID)
    args = _parser().parse_args(["--shape", "grid"])
    assert [shape.name for shape in bench_shapes(args)] == names
    assert token_counts(args) == [1, 16, 64, 256, 1024, 4096, 32768] and words_to_run(args) == ["kernel"]
    args = _parser().parse_args(["--shape", "grid", "--configs", "0-3,7", "--grid-half", "held-out"])
    assert [shape.name for shape in bench_shapes(args)] == [names[1], names[3], names[7]]
    assert grid_refusal(args) is None
    assert words_to_run(_parser().parse_args(["--shape", "grid", "--only", "triton"])) == ["triton"]
    assert grid_refusal(_parser().parse_args(["--configs", "3"])) == (
        "--configs and --grid-half pick configurations of the grid; they need --shape grid")
    assert grid_refusal(_parser().parse_args(["--shape", "grid", "--configs", "1", "--grid-half", "fit"])) == (
        "no grid configuration is both among --configs and of the fit half")


@pytest.mark.parametrize("configs", ["40", "3-1", "a", "-2", ","])
def test_configs_other_than_grid_numbers_are_refused(configs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--shape", "grid", "--configs", configs])
    assert exit_info.value.code == 2
    assert (f"argument --configs: got {configs!r}, expected comma-separated grid numbers or ranges of them from 0 "
            "to 39") in capsys.readouterr().err


def test_grid_options_without_the_grid_are_refused_before_any_gpu_is_looked_for(capsys):
    assert run_bench_command(_parser().parse_args(["--grid-half", "fit"])) == 2
    assert capsys.readouterr().err == (
        "fusedkv bench: --configs and --grid-half pick configurations of the grid; they need --shape grid\n")


def test_a_dry_run_of_the_grid_lists_each_configurations_rows_and_the_sizes_left_out(capsys):
    from interop.bench.shapes import GRID

    shapes = list(GRID.values())
    numbers = [next(i for i, shape in enumerate(shapes) if shape.op_bytes(32768, shape.dtype) <= 8 * 2**30),
               next(i for i, shape in enumerate(shapes) if shape.op_bytes(32768, shape.dtype) > 8 * 2**30)]
    small, large = (shapes[i] for i in numbers)
    argv = ["--shape", "grid", "--configs", ",".join(map(str, numbers)), "--dry-run"]
    assert run_bench_command(_parser().parse_args(argv)) == 0
    lines = capsys.readouterr().out.splitlines()
    # Six rows at each of seven sizes (the four kernels, two copies), but one size of the large one.
    assert lines[0] == ("fusedkv bench --shape grid would run 78 rows (triton, pallas, pallas-mosaic, pallas-pdl, "
                        "torch-copy, xla-copy) at tokens 1,16,64,256,1024,4096,32768:")
    assert lines[1] == (f"  {small.name} ({small.description}, {small.dtype}): 42 rows at tokens "
                        "1,16,64,256,1024,4096,32768")
    assert lines[2] == f"  {large.name} ({large.description}, {large.dtype}): 36 rows at tokens 1,16,64,256,1024,4096"
    assert lines[3].startswith(f"skipped {large.name} at 32768 tokens (") and len(lines) == 4


def test_the_recorded_command_line_of_a_grid_run_parses_back():
    import shlex

    from interop.bench.command import command_line

    args = _parser().parse_args(["--shape", "grid", "--configs", "2,0-1", "--grid-half", "fit", "--tokens", "16"])
    line = command_line(args)
    assert line == "fusedkv bench --tokens 16 --shape grid --configs 0,1,2 --grid-half fit"
    assert vars(_parser().parse_args(shlex.split(line)[2:])) == vars(args)


def _grid_rows():
    """Hand-made rows of three grid configurations, two fit and one held out, whose verdicts
    follow from the numbers: 16 tokens move 1 MB, 4096 tokens 100 MB, 32768 tokens 1 GB."""
    from interop.bench.shapes import GRID

    fit, held_out, fit_large = list(GRID)[:3]

    def row(shape, implementation, tokens, us, nbytes, *, check="ok"):
        kind = "copy" if implementation.endswith("copy") else "kernel"
        framework = "jax" if implementation.startswith("pallas") else "torch"
        return Measurement(shape, GRID[shape].dtype, implementation, framework, kind, "device", tokens,
                           None if us is None else us * 1e-6, nbytes, check=check, does_op=kind == "kernel")

    rows = []
    for shape in (fit, held_out):
        rows += [row(shape, "torch-copy", 16, 1.0, 10**6), row(shape, "torch-copy", 4096, 25.0, 10**8)]
    rows += [row(fit, "triton", 4096, 25 / 0.95, 10**8), row(fit, "pallas", 4096, 25 / 0.92, 10**8),
             row(fit, "triton", 16, 1.10, 10**6), row(fit, "pallas", 16, 1.21, 10**6),  # 1.10x, then 1.10x Triton
             row(held_out, "triton", 4096, 31.25, 10**8), row(held_out, "pallas", 4096, 25 / 0.95, 10**8),
             row(held_out, "triton", 16, 1.50, 10**6), row(held_out, "pallas", 16, 1.80, 10**6),
             row(held_out, "pallas-pdl", 16, 1.95, 10**6)]  # 1.30x Triton
    # A graph-replayed copy of 1 GB at 2500 GB/s, slower than the 100 MB copies' 4000: Triton's
    # 3000 GB/s is 120% of it but 75% of the faster copy of fewer bytes. Pallas failed its check.
    rows += [row(fit_large, "torch-copy", 32768, 400.0, 10**9), row(fit_large, "triton", 32768, 1e3 / 3, 10**9),
             row(fit_large, "pallas", 32768, None, 10**9, check="FAIL: k: 1 of 10 elements outside tolerance")]
    return rows, (fit, held_out, fit_large)


def test_the_grid_bars_are_judged_per_half_from_the_measured_rows():
    from interop.bench import grid

    rows, (fit, held_out, fit_large) = _grid_rows()
    verdicts = {(bar, what.split()[0], half): (worst, verdict)
                for bar, what, half, worst, verdict in grid.bar_lines(grid.cells(rows))}
    assert verdicts["2", "Triton", "fit"] == (f"75% at {fit_large}, 32768 tokens", "missed by 15.0 points")
    assert verdicts["2", "Triton", "held-out"] == (f"80% at {held_out}, 4096 tokens", "missed by 10.0 points")
    assert verdicts["2", "Triton", "both"] == (f"75% at {fit_large}, 32768 tokens", "missed by 15.0 points")
    # A size whose row failed its check shows no bar held, though every measured size holds.
    assert verdicts["2", "Pallas", "fit"] == (f"92% at {fit}, 4096 tokens", "not shown: 1 of 2 sizes unmeasured")
    assert verdicts["2", "Pallas", "held-out"] == (f"95% at {held_out}, 4096 tokens", "held")
    assert verdicts["2", "Pallas", "both"][1] == "not shown: 1 of 3 sizes unmeasured"
    assert verdicts["3", "Triton", "fit"] == (f"1.10x at {fit}, 16 tokens", "held")
    assert verdicts["3", "Triton", "held-out"] == (f"1.50x at {held_out}, 16 tokens", "missed by 0.35x")
    assert verdicts["3", "Triton", "both"] == (f"1.50x at {held_out}, 16 tokens", "missed by 0.35x")
    assert verdicts["3", "Pallas's", "fit"] == (f"1.10x at {fit}, 16 tokens", "held")
    assert verdicts["3", "Pallas's", "both"] == (f"1.20x at {held_out}, 16 tokens", "held")
    # Bars of a row the run did not measure say so, in each half.
    assert verdicts["2", "With", "held-out"] == ("-", "not measured")
    assert verdicts["3", "With", "fit"] == ("-", "not measured")
    assert verdicts["3", "With", "held-out"] == (f"1.30x at {held_out}, 16 tokens", "missed by 0.05x")
    assert len(verdicts) == 7 * 3


def test_bar_5_judges_mosaic_gpu_against_the_triton_lowering_at_every_size_it_serves():
    from interop.bench import grid
    from interop.bench.shapes import GRID

    fit, held_out = list(GRID)[:2]

    def row(shape, implementation, tokens, us, *, check="ok"):
        return Measurement(shape, GRID[shape].dtype, implementation, "jax", "kernel", "device", tokens,
                           None if us is None else us * 1e-6, 10**6, check=check)

    rows = [row(fit, "pallas", 16, 2.0), row(fit, "pallas-mosaic", 16, 2.08),  # 1.04x
            row(fit, "pallas", 2048, 20.0), row(fit, "pallas-mosaic", 2048, 22.0),  # 1.10x, in neither bucket
            row(held_out, "pallas", 4096, 40.0),
            row(held_out, "pallas-mosaic", 4096, None, check="n/a: Mosaic GPU has no kernel for gptj")]
    found = grid.cells(rows)
    verdicts = {half: (worst, verdict) for bar, what, half, worst, verdict in grid.bar_lines(found) if bar == "5"}
    assert verdicts == {"fit": (f"1.10x at {fit}, 2048 tokens", "missed by 0.05x"),
                        "held-out": ("-", "not measured"),  # n/a: a configuration it does not serve
                        "both": (f"1.10x at {fit}, 2048 tokens", "missed by 0.05x")}
    table = {(line[0], line[2]): line for line in grid.configuration_lines(found)}
    assert table["configuration", "tokens"][-1] == "pallas-mosaic x pallas"
    assert table[fit, "16"][-1] == "1.04x" and table[held_out, "4096"][-1] == "-"


def test_the_grid_summary_gives_the_worst_and_median_of_copy_per_bucket_and_half():
    from interop.bench import grid

    rows, (fit, held_out, fit_large) = _grid_rows()
    summary = {line[:3]: line[3:] for line in grid.summary_lines(grid.cells(rows))}
    assert summary[grid.LARGE, "fit", "triton"] == ("2 of 2", "75%", "85%", f"{fit_large}, 32768 tokens")
    assert summary[grid.LARGE, "both", "pallas"] == ("2 of 3", "92%", "94%", f"{fit}, 4096 tokens")
    # 1 MB over 1.50 us is 667 GB/s, two thirds of the 1 MB copy's 1000
    assert summary[grid.DECODE, "held-out", "triton"] == ("1 of 1", "67%", "67%", f"{held_out}, 16 tokens")
    table = {(line[0], line[2]): line for line in grid.configuration_lines(grid.cells(rows))}
    assert table["configuration", "tokens"] == (
        "configuration", "half", "tokens", "MB", "copy GB/s", "torch-copy us", "triton us", "pallas us",
        "pallas-pdl us", "triton of copy", "pallas of copy", "pallas-pdl of copy", "triton x torch-copy",
        "pallas x triton", "pallas-pdl x triton")
    assert table[fit, "16"][3:] == ("1", "1000", "1.00", "1.10", "1.21", "-", "91%", "83%", "-", "1.10x", "1.10x",
                                    "-")
    assert table[held_out, "16"][8:] == ("1.95", "67%", "56%", "51%", "1.50x", "1.20x", "1.30x")
    # Read against the faster copy of fewer bytes, marked; the failed row has no time.
    assert table[fit_large, "32768"][3:] == ("1000", "4000*", "400.00", "333.33", "-", "-", "75%", "-", "-",
                                             "0.83x", "-", "-")


def test_where_jax_alone_sees_a_device_a_grid_run_writes_the_grids_tables_and_heatmap(tmp_path, capsys,
                                                                                     monkeypatch):
    pytest.importorskip("jax")
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    from interop.bench import command
    from interop.bench.shapes import GRID

    monkeypatch.setattr(command, "gpu_frameworks", lambda: ({"jax": "stand-in"}, ["torch sees no CUDA device"]))
    shapes = list(GRID.values())
    # The smallest configuration of each half: the Pallas kernel runs interpreted here.
    numbers = [min((i for i, s in enumerate(shapes) if s.half == half), key=lambda i: shapes[i].op_bytes(2, "float32"))
               for half in ("fit", "held-out")]
    names = [shapes[i].name for i in sorted(numbers)]
    out, markdown = tmp_path / "out", tmp_path / "grid.md"
    argv = ["--shape", "grid", "--configs", ",".join(map(str, numbers)), "--tokens", "2", "--only", "pallas",
            "--max-calls-per-jit", "8", "--out", str(out), "--markdown", str(markdown)]
    assert run_bench_command(_parser().parse_args(argv)) == 0
    printed = capsys.readouterr().out
    assert "2 grid configurations, each in its own dtype, tokens 2" in printed
    assert "== The shape grid: the issue's bars ==" in printed and "== g" not in printed
    table = printed[printed.index("== The shape grid: each configuration against copy =="):]
    assert [cells[:3] for cells in _table_rows(table.split("\n", 1)[1].split("\ncopy GB/s:")[0])] == [
        [name, GRID[name].half, "2"] for name in names]
    with open(out / "bench.csv", newline="") as file:
        records = list(csv.DictReader(file))
    assert sorted((r["shape"], r["dtype"], r["implementation"]) for r in records) == sorted(
        (name, GRID[name].dtype, implementation) for name in names for implementation in ("pallas", "xla-copy"))
    assert all(r["check"] == "ok" for r in records)
    assert json.loads((out / "bench.json").read_text())["meta"]["grid"] == dict(
        seed=27, configurations=names, skipped=[])
    assert {p.name for p in out.iterdir()} == {"bench.csv", "bench.json", "grid-pallas.png"}
    text = markdown.read_text()
    assert "## The shape grid: the issue's bars" in text
    assert "## The shape grid: each configuration against copy" in text
    assert "| 2 | Pallas in jit at 90% of copy or more | both | - | not measured |" in text
    assert not any(line.startswith("## g") for line in text.splitlines())


def test_from_json_reports_the_rows_of_several_runs_as_one_grid(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows, (fit, held_out, fit_large) = _grid_rows()
    base = dict(devices={"torch": "Test GPU", "jax": "Test GPU"}, versions={"python": "3.12.0"}, dtype="bfloat16")
    parts = []
    for index, names in enumerate(((fit, fit_large), (held_out,))):
        meta = dict(base, command=f"fusedkv bench --shape grid --configs {index}", shapes=list(names),
                    copy_ceiling=[4100.0 + index, f"a 1 GiB copy, part {index}"],
                    grid=dict(seed=27, configurations=list(names), skipped=[f"{names[0]} at 65536 tokens"]))
        write_data(annotate([m for m in rows if m.shape in names]), tmp_path / f"part{index}", meta)
        parts.append(str(tmp_path / f"part{index}" / "bench.json"))
    markdown = tmp_path / "all" / "grid.md"
    args = _parser().parse_args(["--from-json", ",".join(parts), "--out", str(tmp_path / "all"),
                                 "--markdown", str(markdown)])
    assert run_bench_command(args) == 1  # the failed Pallas row, as in the run that measured it
    text = markdown.read_text()
    assert "fusedkv bench --shape grid --configs 0\nfusedkv bench --shape grid --configs 1\n" in text
    assert "- Device copy ceiling: 4101 GB/s, a 1 GiB copy, part 1" in text
    assert (f"| 2 | Triton under graph replay at 90% of copy or more | both | 75% at {fit_large}, 32768 tokens | "
            "missed by 15.0 points |") in text
    assert (f"| 3 | Triton at most 1.15x the same-bytes copy, both under graph replay | held-out | 1.50x at "
            f"{held_out}, 16 tokens | missed by 0.35x |") in text
    assert f"Skipped, over the grid's memory limit: {fit} at 65536 tokens; {held_out} at 65536 tokens" in text
    document = json.loads((tmp_path / "all" / "bench.json").read_text())
    assert document["meta"]["grid"]["configurations"] == [fit, fit_large, held_out]
    assert len(document["rows"]) == len(rows)
    assert {p.name for p in (tmp_path / "all").iterdir()} >= {"grid-triton.png", "grid-pallas.png"}
    assert "missed by 15.0 points" in capsys.readouterr().out


def test_from_json_takes_a_row_measured_again_from_the_later_part(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows, (fit, held_out, _) = _grid_rows()
    base = dict(devices={"torch": "Test GPU"}, versions={"python": "3.12.0"}, dtype="bfloat16",
                copy_ceiling=[4100.0, "a 1 GiB copy"])
    first = [m for m in rows if m.shape in (fit, held_out)]
    again = next(m for m in first if m.shape == fit and m.implementation == "triton" and m.seconds)
    remeasured = dataclasses.replace(again, seconds=again.seconds / 2, method="graph replay, again")
    paths = []
    for index, (part, names) in enumerate(((first, [fit, held_out]), ([remeasured], [fit]))):
        meta = dict(base, command=f"part {index}", shapes=names, grid=dict(seed=27, configurations=names, skipped=[]))
        write_data(annotate(part), tmp_path / f"part{index}", meta)
        paths.append(str(tmp_path / f"part{index}" / "bench.json"))
    args = _parser().parse_args(["--from-json", ",".join(paths), "--out", str(tmp_path / "all")])
    run_bench_command(args)
    assert "1 rows of earlier parts replaced by a later part's row" in capsys.readouterr().out
    merged = json.loads((tmp_path / "all" / "bench.json").read_text())["rows"]
    assert len(merged) == len(first)
    key = (again.shape, again.implementation, again.tokens)
    [row] = [r for r in merged if (r["shape"], r["implementation"], r["tokens"]) == key]
    assert row["us"] == pytest.approx(again.seconds / 2 * 1e6) and row["method"] == "graph replay, again"
    assert [(r["shape"], r["implementation"], r["tokens"]) for r in merged] == [
        (m.shape, m.implementation, m.tokens) for m in first]  # each row where it first stood


def _part(tmp_path, name, rows, positions="uniform"):
    """A bench.json of ``rows`` (shape, implementation, tokens, check) as a grid part's run wrote it."""
    from interop.bench.shapes import GRID

    measurements = [Measurement(shape, GRID[shape].dtype, implementation, "torch", "copy" if "copy" in implementation
                                else "kernel", "device", tokens, None if check != "ok" else 1e-6, 10**6, check=check)
                    for shape, implementation, tokens, check in rows]
    meta = dict(command=name, devices={"torch": "Test GPU"}, versions={}, dtype="bfloat16", positions=positions,
                shapes=sorted({row[0] for row in rows}), copy_ceiling=[None, ""])
    write_data(annotate(measurements), tmp_path / name, meta)
    return str(tmp_path / name / "bench.json")


def test_a_resumed_grid_run_skips_the_sizes_whose_every_row_passed_in_an_earlier_part(tmp_path, capsys):
    from interop.bench.shapes import GRID

    small = next(i for i, shape in enumerate(GRID.values()) if shape.op_bytes(32768, shape.dtype) <= 8 * 2**30)
    name = list(GRID)[small]
    first = _part(tmp_path, "part1", [(name, "triton", 16, "ok"), (name, "torch-copy", 16, "ok"),
                                      (name, "triton", 64, "ok"),  # its copy not measured: 64 runs again
                                      (name, "triton", 256, "FAIL: k: 1 of 10 elements outside tolerance"),
                                      (name, "torch-copy", 256, "ok")])
    second = _part(tmp_path, "part2", [(name, "triton", 1024, "ok"), (name, "torch-copy", 1024, "ok")])
    argv = ["--shape", "grid", "--configs", str(small), "--only", "triton", "--tokens", "16,64,256,1024",
            "--dry-run", "--resume", f"{first},{second}"]
    assert run_bench_command(_parser().parse_args(argv)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"resumed: 2 sizes measured already in {first}, {second}"
    assert lines[2] == f"  {name} ({GRID[name].description}, {GRID[name].dtype}): 4 rows at tokens 64,256"


def test_a_resumed_run_measures_only_the_sizes_the_earlier_part_did_not(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from interop.bench import command
    from interop.bench.shapes import GRID

    monkeypatch.setattr(command, "gpu_frameworks", lambda: ({"jax": "stand-in"}, ["torch sees no CUDA device"]))
    shapes = list(GRID.values())
    number = min(range(len(shapes)), key=lambda i: shapes[i].op_bytes(2, "float32"))  # interpreted here
    argv = ["--shape", "grid", "--configs", str(number), "--only", "pallas", "--max-calls-per-jit", "8"]
    assert run_bench_command(_parser().parse_args([*argv, "--tokens", "2", "--out", str(tmp_path / "part1")])) == 0
    resumed = ["--tokens", "2,3", "--out", str(tmp_path / "part2"), "--resume", str(tmp_path / "part1" / "bench.json")]
    assert run_bench_command(_parser().parse_args([*argv, *resumed])) == 0
    assert f"resumed: 1 sizes measured already in {tmp_path / 'part1' / 'bench.json'}" in capsys.readouterr().out
    rows = json.loads((tmp_path / "part2" / "bench.json").read_text())["rows"]
    assert sorted((row["implementation"], row["tokens"]) for row in rows) == [("pallas", 3), ("xla-copy", 3)]


def test_resume_skips_no_size_measured_in_another_dtype(tmp_path, capsys):
    rows = [Measurement("draft", "float16", implementation, "torch", kind, "device", 16, 1e-6, 10**6, check="ok")
            for implementation, kind in (("triton", "kernel"), ("torch-copy", "copy"))]
    write_data(annotate(rows), tmp_path / "part1", dict(command="part1", devices={}, versions={}, dtype="float16",
                                                       positions="uniform", shapes=["draft"], copy_ceiling=[None, ""]))
    argv = ["--only", "triton", "--tokens", "16", "--dry-run", "--resume", str(tmp_path / "part1" / "bench.json")]
    for dtype, rows_left in (("float16", 0), ("bfloat16", 2)):
        assert run_bench_command(_parser().parse_args([*argv, "--dtype", dtype])) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith(f"resumed: {1 - rows_left // 2} sizes measured already")
        assert lines[1].startswith(f"fusedkv bench would run {rows_left} rows")


def test_resume_refuses_a_part_of_other_positions_or_not_a_bench_json(tmp_path, capsys):
    from interop.bench.shapes import GRID

    part = _part(tmp_path, "part1", [(list(GRID)[0], "triton", 16, "ok")], positions="consecutive")
    (tmp_path / "other.json").write_text("{}")
    for path, message in [(part, f"--resume {part} has rows of consecutive positions, this run uniform positions"),
                          (str(tmp_path / "other.json"),
                           f"--resume {tmp_path / 'other.json'} is not a bench.json that fusedkv bench wrote")]:
        args = _parser().parse_args(["--shape", "grid", "--configs", "0", "--dry-run", "--resume", path])
        assert run_bench_command(args) == 2
        assert capsys.readouterr().err == f"fusedkv bench: {message}\n"


def test_from_json_refuses_paths_that_are_not_files(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--from-json", str(tmp_path / "none.json")])
    assert exit_info.value.code == 2
    assert f"expected comma-separated bench.json files; not a file: {tmp_path / 'none.json'}" in (
        capsys.readouterr().err)


def test_the_pallas_backward_row_launches_the_tile_that_jax_grad_takes(monkeypatch):
    jax = pytest.importorskip("jax")
    import fusedkv_jax
    from fusedkv_jax import backward
    from interop.bench.workload import Workload

    launched = []
    original = backward._pallas_backward

    def recording(*args, **kwargs):
        launched.append((kwargs["block_tokens"], kwargs["block_heads"], kwargs["num_warps"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(backward, "_pallas_backward", recording)
    workload = Workload(TINY, 5, "bfloat16", framework="jax", set_count=2)
    row = BY_NAME["pallas-bwd"].prepare(workload)
    # The launches are jitted: shapes traced before (by this test or another) are not traced again.
    jax.clear_caches()
    jax.make_jaxpr(row.step)(row.fixed, row.varying[0], row.new_outputs())
    jax.clear_caches()
    weight, eps, cos_sin = row.fixed
    kv, positions, grad_k, grad_v = row.varying[0]
    op = functools.partial(fusedkv_jax.fused_kv_norm_rope, **workload.shape.static())
    _, vjp = jax.vjp(lambda kv: op(kv, weight, eps, cos_sin, positions), kv)
    vjp((grad_k, grad_v))
    assert len(launched) == 2 and launched[0] == launched[1]


def _failing_graph_bench(monkeypatch, errors):
    """do_bench_cudagraph replaced by one that raises ``errors`` in turn, then runs the
    function it is given twice and reports 2 ms; returns the list of its attempts."""
    import triton.testing

    attempts = []

    def bench(fn, rep, return_mode):
        attempts.append(rep)
        if len(attempts) <= len(errors):
            raise errors[len(attempts) - 1]
        fn()
        fn()
        return 2.0

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", bench)
    return attempts


def test_a_graph_capture_that_fails_once_is_captured_and_timed_again(monkeypatch):
    from interop.bench.timers import graph_replay_seconds

    attempts = _failing_graph_bench(monkeypatch, [RuntimeError("operation failed due to a previous error during capture")])
    called = []
    assert graph_replay_seconds(called.append, 3, rep_ms=5) == 2.0 / 1e3
    assert attempts == [5, 5] and called == [0, 1]


def test_a_graph_capture_that_fails_twice_or_another_error_is_raised(monkeypatch):
    from interop.bench.timers import graph_replay_seconds

    capture = RuntimeError("operation not permitted when stream is capturing")
    attempts = _failing_graph_bench(monkeypatch, [capture, capture])
    with pytest.raises(RuntimeError, match="capturing"):
        graph_replay_seconds(lambda i: None, 1)
    assert len(attempts) == 2
    attempts = _failing_graph_bench(monkeypatch, [RuntimeError("CUDA error: an illegal memory access")])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        graph_replay_seconds(lambda i: None, 1)
    assert len(attempts) == 1


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_consecutive_positions_count_up_from_a_start_that_keeps_every_token_in_the_table(framework):
    pytest.importorskip(framework)
    from interop.bench.shapes import MAX_POSITION
    from interop.bench.workload import Workload

    device = dict(torch_device="cuda" if ON_GPU else "cpu") if framework == "torch" else {}
    for total_ctx in (1, 300, MAX_POSITION):
        workload = Workload(TINY, total_ctx, "bfloat16", framework=framework, set_count=2, positions="consecutive",
                            **device)
        starts = set()
        for index in range(2):
            positions = workload.op_args(index, framework)[4]
            positions = positions.cpu().numpy() if framework == "torch" else np.asarray(positions)
            assert positions.dtype == np.int32
            assert (np.diff(positions) == 1).all() and 0 <= positions[0] and positions[-1] < MAX_POSITION
            starts.add(int(positions[0]))
        assert total_ctx == MAX_POSITION or len(starts) == 2  # each set its own start


@pytest.mark.parametrize("count", [1, 7, 64, 300, 5000])
def test_sequence_positions_are_runs_of_at_most_the_longest_sequence_each_inside_the_table(count):
    from interop.bench.shapes import MAX_POSITION
    from interop.bench.workload import SEQUENCE_TOKENS, sequence_positions

    positions = sequence_positions(np.random.default_rng(count), count)
    assert positions.dtype == np.int32 and positions.shape == (count,)
    assert 0 <= positions.min() and positions.max() < MAX_POSITION
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    run_lengths = np.diff(np.concatenate([[0], breaks, [count]]))
    assert run_lengths.max() <= SEQUENCE_TOKENS
    if count >= 4 * SEQUENCE_TOKENS:  # a batch of many sequences, of lengths spread over the whole range
        assert len(run_lengths) >= count // SEQUENCE_TOKENS and run_lengths.min() < SEQUENCE_TOKENS // 2
    np.testing.assert_array_equal(positions, sequence_positions(np.random.default_rng(count), count))


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_workload_of_sequences_gives_each_set_its_own_batch_in_the_framework(framework):
    pytest.importorskip(framework)
    from interop.bench.workload import Workload

    device = dict(torch_device="cuda" if ON_GPU else "cpu") if framework == "torch" else {}
    workload = Workload(TINY, 2000, "bfloat16", framework=framework, set_count=2, positions="sequences", **device)
    sets = []
    for index in range(2):
        positions = workload.op_args(index, framework)[4]
        positions = positions.cpu().numpy() if framework == "torch" else np.asarray(positions)
        assert positions.dtype == np.int32 and (np.diff(positions) != 1).any()
        sets.append(positions)
    assert not np.array_equal(*sets)


def test_a_workload_refuses_positions_it_does_not_draw():
    pytest.importorskip("jax")
    from interop.bench.workload import Workload

    with pytest.raises(ValueError, match=r"^Invalid positions for the bench's workload: got 'sorted'"):
        Workload(TINY, 3, "bfloat16", framework="jax", set_count=2, positions="sorted")
