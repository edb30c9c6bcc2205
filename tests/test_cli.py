"""The ``fusedkv`` command line as a user meets it: options, --version, info, check's output."""

import dataclasses
import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import interop  # noqa: E402
from interop import dispatch  # noqa: E402
from interop.command import check as check_command  # noqa: E402
from interop.command import cli  # noqa: E402
from interop.command.backends import (gpu_framework, place_inputs, run_backend, run_backend_gradients,  # noqa: E402
                                      triton_interpreted)
from interop.command.check import CheckOptions, run_check  # noqa: E402
from interop.core.arrays import as_numpy as host  # noqa: E402
from interop.core.reference import rope_cos_sin_cache  # noqa: E402

ON_CPU = gpu_framework() is None
ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = ["--layers", "2", "--heads", "2", "--head-dim", "32", "--tokens", "5"]
ROWS = {("reference", "-"), ("torch", "reference"), ("jax", "reference"), ("torch", "jax")}


def _refusal(argv, capsys, monkeypatch) -> str:
    """``fusedkv check argv`` ends, before running anything, with the check's usage (not the
    top-level one) and one line of error; returns that line."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("the check ran")

    monkeypatch.setattr(cli, "run_check", must_not_run)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["check", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("usage: fusedkv check ")
    usage, message = err.rstrip("\n").rsplit("\n", 1)
    assert "error" not in usage
    assert message.startswith("fusedkv check: error: ")
    return message.removeprefix("fusedkv check: error: ")


@pytest.mark.parametrize("argv, option", [
    (["--tokens", "1e9"], "--tokens"),
    (["--tokens", "-16"], "--tokens"),
    (["--tokens", "0"], "--tokens"),
    (["--layers", "0"], "--layers"),
    (["--heads", "-2"], "--heads"),
    (["--head-dim", "12.5"], "--head-dim"),
    (["--rotary-dim", "0"], "--rotary-dim"),
    (["--max-position", "0"], "--max-position"),
    (["--seed", "-1"], "--seed"),
    (["--backends", "foo"], "--backends"),
    (["--backends", "torch,"], "--backends"),
    (["--dtype", "int8"], "--dtype"),
    (["--rope-style", "llama"], "--rope-style"),
    (["--tables", "0"], "--tables"),
    (["--tables", "1.5"], "--tables"),
])
def test_a_bad_value_is_an_argparse_error_naming_its_option(argv, option, capsys, monkeypatch):
    message = _refusal(argv, capsys, monkeypatch)
    assert message.startswith(f"argument {option}: ") and repr(argv[1]) in message


def test_an_odd_head_dim_without_a_rotary_dim_is_an_error_of_head_dim(capsys, monkeypatch):
    message = _refusal(["--head-dim", "7"], capsys, monkeypatch)
    assert message.startswith("argument --head-dim: got 7, expected an even number")


@pytest.mark.parametrize("argv", [["--rotary-dim", "129"], ["--rotary-dim", "63"],
                                  ["--head-dim", "64", "--rotary-dim", "128"]])
def test_rotary_dim_must_be_even_and_at_most_head_dim(argv, capsys, monkeypatch):
    message = _refusal(argv, capsys, monkeypatch)
    assert message.startswith(f"argument --rotary-dim: got {argv[-1]}, expected an even number "
                              "at most --head-dim")


@pytest.mark.parametrize("argv, start", [
    (["--tokens", "1000000000"], "argument --tokens: 1000000000 tokens x 5 layers x 8 KV heads x head_dim 128 need"),
    (["--layers", "100000000"], f"argument --layers: {16 if ON_CPU else 4096} tokens x 100000000 layers x"),
    (["--max-position", "1000000000"], "argument --max-position: a cos/sin table of 1000000000 rows "
                                       "of 128 needs"),
    (["--tokens", "16", "--head-dim", "100000"], "argument --head-dim: a cos/sin table of 32768 rows of "
                                                 "100000 needs"),
    (["--tokens", "16", "--head-dim", "100000", "--rotary-dim", "99998"], "argument --rotary-dim: a cos/sin table of 32768 "
                                                        "rows of 99998 needs"),
    (["--tokens", "16", "--max-position", "10000000", "--tables", "8"],
     "argument --max-position/--tables: 8 cos/sin tables of 10000000 rows of 128 need"),
])
def test_sizes_beyond_the_machines_memory_are_refused_naming_the_option_to_shrink(argv, start, capsys,
                                                                                monkeypatch):
    monkeypatch.setattr(cli, "_physical_memory", lambda: 16 * 2**30)
    message = _refusal(argv, capsys, monkeypatch)
    assert message.startswith(start)
    assert re.search(r" about [\d,.]+ GiB of host memory for the check; this machine has 16 GiB$", message)


def test_the_gradients_count_in_the_host_memory_of_a_check(capsys, monkeypatch):
    # 20000 tokens of the draft shape: the forward's arrays fit in 16 GiB, with the gradients' not.
    forward = CheckOptions(total_ctx=20000)
    assert sum(forward.host_bytes()) < 16 * 2**30 < sum(dataclasses.replace(forward, grad=True).host_bytes())
    monkeypatch.setattr(cli, "_physical_memory", lambda: 16 * 2**30)
    message = _refusal(["--tokens", "20000", "--grad"], capsys, monkeypatch)
    assert message.startswith("argument --tokens: 20000 tokens x 5 layers x 8 KV heads x head_dim 128 need")


@pytest.mark.skipif(not ON_CPU, reason="the interpret-mode estimate applies without a GPU")
@pytest.mark.parametrize("argv, option, unit", [
    (["--tokens", "1000000"], "--tokens", "hours"),
    (["--tokens", "1", "--layers", "50000", "--heads", "1", "--head-dim", "16"], "--layers", "minutes"),
])
def test_interpret_mode_refuses_a_check_that_would_take_too_long(argv, option, unit, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_physical_memory", lambda: 2**60)  # past the memory check
    message = _refusal(argv, capsys, monkeypatch)
    assert re.fullmatch(rf"argument {option}: \d+ tokens x \d+ layers x \d+ KV heads x head_dim \d+ in "
                        rf"interpret mode \(no GPU here\) would take about \d+ {unit}; .*", message)


@pytest.mark.skipif(not ON_CPU, reason="the interpret-mode estimate applies without a GPU")
def test_interpret_mode_announces_a_long_check_with_its_estimate(capsys, monkeypatch):
    monkeypatch.setattr(cli, "WARN_SECONDS", 0)
    assert cli.main(["check", *SMALL]) == 0
    captured = capsys.readouterr()
    assert re.fullmatch(r"fusedkv check: 5 tokens x 2 layers x 2 KV heads x head_dim 32 in "
                        r"interpret mode \(no GPU here\): expect about \d+ s\n", captured.err)
    assert captured.out.endswith("ALL PASS\n")


SIZE_FIELDS = [("total_ctx", 32), ("n_layers", 4), ("num_kv_heads", 4), ("head_dim", 64),
               ("rotary_dim", 32), ("max_position", 2048), ("tables", 2)]


@pytest.mark.parametrize("field, larger", SIZE_FIELDS, ids=[field for field, _ in SIZE_FIELDS])
def test_the_interpreted_estimate_grows_with_every_size(field, larger):
    base = CheckOptions(n_layers=2, num_kv_heads=2, head_dim=32, rotary_dim=16, total_ctx=16,
                        max_position=1024)
    assert dataclasses.replace(base, **{field: larger}).interpreted_seconds() > base.interpreted_seconds()


@pytest.mark.skipif(not ON_CPU, reason="the interpret-mode estimate applies without a GPU")
@pytest.mark.parametrize("options", [
    CheckOptions(n_layers=100, num_kv_heads=1, head_dim=16, rotary_dim=16, total_ctx=1),
    CheckOptions(total_ctx=512),
    CheckOptions(n_layers=100, num_kv_heads=1, head_dim=16, rotary_dim=16, total_ctx=1, grad=True),
    CheckOptions(total_ctx=512, grad=True),
], ids=["many-layers-of-one-token", "many-tokens", "gradients-of-many-layers", "gradients-of-many-tokens"])
def test_the_interpreted_estimate_is_within_a_factor_of_three_of_the_check(options):
    estimate = options.interpreted_seconds()  # first, as the command makes it: imports aside
    # This process's CPU time: its wall time on an idle machine, whatever a test beside it runs.
    # Its threads' time counts too, which a busy two-core machine inflates past twice the estimate.
    start = time.process_time()
    assert run_check(options).ok
    seconds = time.process_time() - start
    assert seconds / 3 < estimate < seconds * 3, (estimate, seconds)


def test_a_closed_output_ends_the_check_quietly_with_the_status_of_sigpipe():
    # As `fusedkv check | head -1`: the reader takes a line and goes away.
    check = subprocess.Popen([sys.executable, "-m", "interop", "check", *SMALL], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert check.stdout.readline().startswith("fusedkv check: ")
    check.stdout.close()
    err = check.stderr.read()
    assert check.wait() == cli.READER_GONE == 141
    assert err == ""


def test_an_unknown_option_is_answered_with_the_commands_usage(capsys, monkeypatch):
    assert _refusal(["--layers", "2", "--bogus"], capsys, monkeypatch) == "unrecognized arguments: --bogus"


def test_help_shows_each_default_once_and_no_markup(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["check", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "``" not in out and "(default: None)" not in out
    flat = " ".join(out.split())
    assert "--rope-style {neox,gptj} which dims RoPE rotates together" in flat
    for option in ("--layers", "--heads", "--head-dim", "--rotary-dim", "--rope-style", "--dtype",
                   "--tables", "--tokens", "--max-position", "--seed", "--backends"):
        help_text = flat.split(f" {option} ", 2)[-1].split(" --")[0]
        assert help_text.count("(default:") == 1, (option, help_text)


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert re.fullmatch(r"fusedkv \d+\.\d+\.\d+\S*\n", out)
    try:
        installed = importlib.metadata.version("fusedkv")
    except importlib.metadata.PackageNotFoundError:  # run from the source tree (the GPU machine)
        return
    assert out == f"fusedkv {installed}\n"


def test_info_names_versions_devices_and_how_each_backend_runs(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"fusedkv {interop.__version__} from ")
    # Distribution versions: a CUDA build's metadata may drop the local part (+cu130) of torch.__version__.
    assert all(f"{name} {importlib.metadata.version(name)}" in out for name in ("torch", "triton", "jax"))
    assert f"default backend {jax.default_backend()}" in out
    lines = {line.strip().split(":")[0]: line.strip() for line in out.splitlines()}
    if torch.cuda.is_available():
        assert f"compiled for {torch.cuda.get_device_name()}" in lines["torch"]
    else:
        assert lines["torch"] == ("torch: Triton kernel, interpreted (TRITON_INTERPRET=1) "
                                  "because torch sees no CUDA device")
    how = "compiled for " if jax.default_backend() == "gpu" else "interpret mode because jax has no GPU"
    assert lines["jax"].startswith(f"jax: Pallas kernel (Triton lowering), {how}")
    assert lines["jax with --lowering mosaic_gpu"].startswith(
        f"jax with --lowering mosaic_gpu: Pallas kernel (Mosaic GPU lowering), {how}")


def _info_with(monkeypatch, capsys, *, torch_gpu: bool, jax_backend: str, torch_cuda) -> str:
    """``fusedkv info``'s output with the frameworks' device queries answered as given."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: torch_gpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(torch_gpu))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(jax, "default_backend", lambda: jax_backend)
    assert cli.main(["info"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("torch_cuda, extra", [("13.0", "cuda13"), ("12.8", "cuda12")])
def test_info_says_when_jax_sees_no_gpu_while_torch_does(monkeypatch, capsys, torch_cuda, extra):
    out = _info_with(monkeypatch, capsys, torch_gpu=True, jax_backend="cpu", torch_cuda=torch_cuda)
    assert out.splitlines()[-1] == (f"note: jax sees no GPU while torch does: install jax[{extra}] "
                                    f"(pip install 'fusedkv[jax-{extra}]') for the compiled Pallas kernel")


@pytest.mark.parametrize("torch_gpu, jax_backend, torch_cuda", [
    (False, "cpu", None), (True, "gpu", "13.0"), (False, "gpu", None),
    (True, "cpu", None),  # a ROCm torch: no jax CUDA build to name
])
def test_info_says_nothing_of_jax_gpus_when_the_frameworks_agree_or_torch_has_no_cuda(monkeypatch, capsys, torch_gpu,
                                                                                      jax_backend, torch_cuda):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_pdl=true")  # no note of it either
    out = _info_with(monkeypatch, capsys, torch_gpu=torch_gpu, jax_backend=jax_backend, torch_cuda=torch_cuda)
    assert "jax sees no GPU" not in out
    assert out.splitlines()[-1].startswith("fusedkv check: inputs as ")


@pytest.mark.parametrize("xla_flags", [None, "--xla_force_host_platform_device_count=4"])
def test_info_names_xlas_dependent_launch_where_jax_has_a_gpu_and_xla_flags_leave_it_off(monkeypatch, capsys,
                                                                                        xla_flags):
    if xla_flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", xla_flags)
    out = _info_with(monkeypatch, capsys, torch_gpu=True, jax_backend="gpu", torch_cuda="13.0")
    assert out.splitlines()[-1] == (
        "note: XLA launches a jit's kernels one after another: compile the jit with "
        "compiler_options={'xla_gpu_enable_pdl': True} (or set XLA_FLAGS=--xla_gpu_enable_pdl=true) "
        "to let each start as the one before ends")
    out = _info_with(monkeypatch, capsys, torch_gpu=True, jax_backend="cpu", torch_cuda=None)
    assert "xla_gpu_enable_pdl" not in out


def test_run_check_hands_over_each_row_before_the_next_backend_runs():
    events = []

    def recording_runner(name, placed, config):
        events.append(("run", name))
        return run_backend(name, placed, config)

    options = CheckOptions(n_layers=2, num_kv_heads=2, head_dim=32, rotary_dim=32, total_ctx=5)
    report = run_check(options, runners={"torch": recording_runner, "jax": recording_runner},
                       on_row=lambda row: events.append(("row", row.subject, row.against)))
    assert events == [("row", "reference", "-"), ("run", "torch"), ("row", "torch", "reference"),
                      ("run", "jax"), ("row", "jax", "reference"), ("row", "torch", "jax")]
    assert [(row.subject, row.against) for row in report.rows] == [event[1:] for event in events
                                                                  if event[0] == "row"]


def test_check_prints_each_row_as_soon_as_it_is_known(capsys, monkeypatch):
    printed_before = {}

    def runner(name, placed, config):
        printed_before[name] = capsys.readouterr().out.splitlines()
        return run_backend(name, placed, config)

    monkeypatch.setattr(check_command, "run_backend", runner)
    assert cli.main(["check", *SMALL]) == 0
    title, header, reference = printed_before["torch"]
    assert title.startswith("fusedkv check: 2 layers, 2 KV heads, head_dim 32") and header.startswith("backend")
    assert reference.startswith("reference ")
    (torch_row,) = printed_before["jax"]
    assert torch_row.startswith("torch ") and " reference " in torch_row and " PASS " in torch_row
    jax_row, pair_row, last = capsys.readouterr().out.splitlines()
    assert jax_row.startswith("jax ") and pair_row.startswith("torch ") and last == "ALL PASS"


def test_the_time_columns_show_the_first_call_apart_from_the_second(capsys, monkeypatch):
    calls = []
    real_call = dispatch.fused_kv_norm_rope

    def slow_first_call(*args, backend, **kwargs):
        calls.append(backend)
        if calls.count(backend) == 1:
            time.sleep(0.5)  # stands for a compilation
        return real_call(*args, backend=backend, **kwargs)

    monkeypatch.setattr(dispatch, "fused_kv_norm_rope", slow_first_call)
    assert cli.main(["check", *SMALL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    backend_rows = [row for row in report["rows"] if row["against"] == "reference"]
    assert calls == ["torch", "torch", "jax", "jax"] and len(backend_rows) == 2
    for row in backend_rows:
        assert row["first_call_seconds"] >= 0.5 > row["second_call_seconds"] > 0, row
    assert cli.main(["check", *SMALL]) == 0
    header, torch_row = capsys.readouterr().out.splitlines()[1:4:2]
    assert header.endswith("first call (compiles)  second call")
    assert re.search(r"PASS +[\d.]+ m?s +[\d.]+ m?s$", torch_row)


def test_json_names_each_option_as_its_flag(capsys):
    parser, commands = cli._parsers()
    flags = set(vars(commands["check"].parse_args([]))) - {"json"}
    assert cli.main(["check", *SMALL, "--backends", "jax", "--json"]) == 0
    options = json.loads(capsys.readouterr().out)["options"]
    assert set(options) == flags
    assert options == {"layers": 2, "heads": 2, "head_dim": 32, "rotary_dim": 32, "rope_style": "neox",
                       "dtype": "bfloat16", "table_dtype": "float32", "tables": 1, "no_k_norm": False,
                       "v_multiplier": False, "grad": False, "tokens": 5, "max_position": 32768, "seed": 0,
                       "backends": ["jax"], "lowering": None}


def test_check_runs_a_table_in_the_model_dtype_on_every_backend(capsys):
    assert cli.main(["check", *SMALL, "--table-dtype", "bfloat16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert ", bfloat16 cos/sin table, 5 tokens" in lines[0]
    assert lines[-1] == "ALL PASS"
    assert cli.main(["check", *SMALL, "--table-dtype", "float16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["options"]["table_dtype"] == "float16"


@pytest.mark.parametrize("argv, shown, option", [
    (["--tables", "2"], ", 2 cos/sin tables (layer l: table l % 2), 5 tokens", {"tables": 2}),
    (["--tables", "2", "--table-dtype", "float16"], ", 2 float16 cos/sin tables (layer l: table l % 2),",
     {"tables": 2, "table_dtype": "float16"}),
    (["--no-k-norm"], ", bfloat16, no K-norm, 5 tokens", {"no_k_norm": True}),
    (["--v-multiplier"], ", bfloat16, v_multiplier, 5 tokens", {"v_multiplier": True}),
])
def test_check_runs_each_draft_option_on_every_backend_and_shows_it_in_the_header(argv, shown, option, capsys):
    assert cli.main(["check", *SMALL, *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert shown in lines[0] and lines[-1] == "ALL PASS"
    assert cli.main(["check", *SMALL, *argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and {(row["subject"], row["against"]) for row in report["rows"]} == ROWS
    assert {name: report["options"][name] for name in option} == option


def test_the_draft_options_reach_the_reference_and_every_backend(monkeypatch):
    seen = []

    def recording(real):
        def call(*arrays, **kwargs):
            seen.append((arrays, kwargs))
            return real(*arrays, **kwargs)
        return call

    monkeypatch.setattr(dispatch, "fused_kv_norm_rope", recording(dispatch.fused_kv_norm_rope))
    monkeypatch.setattr(check_command, "fused_kv_norm_rope_reference",
                        recording(check_command.fused_kv_norm_rope_reference))
    options = CheckOptions(n_layers=3, num_kv_heads=2, head_dim=16, rotary_dim=16, total_ctx=3,
                           max_position=64, tables=2, k_norm=False, v_multiplier=True)
    assert run_check(options).ok
    callers = [kwargs.get("backend", "reference") for _, kwargs in seen]
    assert callers == ["reference", "torch", "torch", "jax", "jax"]
    for arrays, kwargs in seen:
        _, k_norm_weight, eps, table, _ = (None if a is None else host(a) for a in arrays)
        assert k_norm_weight is None and eps is None
        assert (table == np.stack([rope_cos_sin_cache(64, 16, base) for base in (1e4, 2e4)])).all()
        assert host(kwargs["layer_rope_table"]).tolist() == [0, 1, 0]
        multiplier = host(kwargs["v_multiplier"])
        assert multiplier.dtype == np.float32 and multiplier.shape == (3,)
        assert ((0.6 <= multiplier) & (multiplier < 0.72)).all() and len(set(multiplier.tolist())) == 3


@pytest.mark.parametrize("field, shown", [("tables", "k"), ("k_norm", "k"), ("v_multiplier", "v")])
def test_a_backend_given_the_inputs_without_a_draft_option_is_found_to_disagree(field, shown):
    options = CheckOptions(n_layers=2, num_kv_heads=2, head_dim=16, rotary_dim=16, total_ctx=3,
                           max_position=64, tables=2, k_norm=False, v_multiplier=True)
    without = dataclasses.replace(options, **{field: getattr(CheckOptions(), field)})

    def ignoring_the_option(name, placed, config):
        return run_backend(name, place_inputs(check_command.check_arrays(without, 3)), config)

    report = run_check(options, runners={"torch": run_backend, "jax": ignoring_the_option})
    assert not report.ok
    failed = {(row.subject, row.against): row for row in report.rows if row.ok is False}
    assert set(failed) == {("jax", "reference"), ("torch", "jax")}
    assert f"jax {shown}" in failed[("jax", "reference")].detail


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_v_multiplier_leaves_v_bit_exact_but_where_triton_interprets_a_bf16_rounding(dtype):
    options = CheckOptions(n_layers=2, num_kv_heads=2, head_dim=16, rotary_dim=16, total_ctx=4,
                           max_position=64, dtype=dtype, v_multiplier=True)
    report = run_check(options)
    assert report.ok
    truncating = dtype == "bfloat16" and triton_interpreted()
    for row in report.rows[1:]:
        if truncating and "torch" in (row.subject, row.against):
            assert row.v_mismatches > 0 and "rounds fp32 to bf16 by truncation" in row.detail, row
        else:
            assert row.v_mismatches == 0 and row.detail == "", row


def test_check_with_its_defaults_compares_every_backend_and_pair(capsys):
    assert cli.main(["check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # one document: no streamed rows mixed in
    assert report["ok"] and report["options"]["tokens"] == (16 if ON_CPU else 4096)
    assert {(row["subject"], row["against"]) for row in report["rows"]} == ROWS
    for row in report["rows"]:
        if row["subject"] != "reference":
            assert row["ok"] is True and row["v_mismatches"] == 0 and row["k_max_ulps"] is not None, row
    assert cli.main(["check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(ROWS) + 1 and lines[-1] == "ALL PASS"
    assert [line.split()[0] for line in lines[2:-1]] == ["reference", "torch", "jax", "torch"]


# --- --grad: the gradients of every backend -------------------------------------------------


@pytest.mark.parametrize("argv, gradients", [
    ([], ["grad_kv", "grad_k_norm_weight"]),
    (["--v-multiplier", "--tables", "2", "--rope-style", "gptj", "--rotary-dim", "16"],
     ["grad_kv", "grad_k_norm_weight", "grad_v_multiplier"]),
    (["--no-k-norm", "--dtype", "float32"], ["grad_kv"]),
], ids=["plain", "multiplier-and-tables", "no-k-norm"])
def test_check_with_grad_compares_every_backends_gradients_with_the_reference_and_each_other(argv, gradients,
                                                                                            capsys):
    assert cli.main(["check", *SMALL, "--grad", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "ALL PASS"
    gradient_lines = lines[lines.index(check_command.gradient_header()) + 1:-1]
    assert [line.split()[0] for line in gradient_lines] == ["reference", "torch", "jax", "torch"]
    assert all(", ".join(gradients) in line for line in gradient_lines)
    assert cli.main(["check", *SMALL, "--grad", *argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["options"]["grad"] is True
    assert {(row["subject"], row["against"]) for row in report["gradient_rows"]} == ROWS
    assert all(row["gradients"] == gradients for row in report["gradient_rows"])


def test_check_without_grad_runs_no_gradients(capsys):
    assert cli.main(["check", *SMALL, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gradient_rows"] == []


@pytest.mark.parametrize("corruption", ["scaled weight gradient", "missing multiplier gradient"])
def test_a_backend_with_wrong_gradients_is_found_to_disagree(corruption):
    options = CheckOptions(n_layers=2, num_kv_heads=2, head_dim=16, rotary_dim=16, total_ctx=3,
                           max_position=64, v_multiplier=True, grad=True)

    def corrupted(name, placed, cotangents, config):
        run = run_backend_gradients(name, placed, cotangents, config)
        grads = dict(run.grads)
        if corruption == "scaled weight gradient":
            grads["grad_k_norm_weight"] = grads["grad_k_norm_weight"] * 1.1
        else:
            del grads["grad_v_multiplier"]
        return dataclasses.replace(run, grads=grads)

    report = run_check(options, gradient_runners={"torch": run_backend_gradients, "jax": corrupted})
    assert not report.ok and all(row.ok is not False for row in report.rows)  # the forward agrees
    failed = {(row.subject, row.against): row for row in report.gradient_rows if row.ok is False}
    assert set(failed) == {("jax", "reference"), ("torch", "jax")}
    shown = "jax grad_k_norm_weight" if corruption == "scaled weight gradient" else "no grad_v_multiplier"
    assert shown in failed[("jax", "reference")].detail


MOSAIC = ["--lowering", "mosaic_gpu", "--tokens", "64", "--heads", "2", "--head-dim", "64"]


def test_check_runs_the_jax_kernel_on_the_lowering_it_is_given_and_fails_where_that_kernel_is_wrong(
        capsys, monkeypatch):
    assert cli.main(["check", *MOSAIC, "--layers", "2", "--grad"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("jax on mosaic_gpu") and out.rstrip().endswith("ALL PASS")
    from fusedkv_jax import mosaic_kernel

    launch = mosaic_kernel.launch

    def k_one_percent_off(*args, **kwargs):
        k, v = launch(*args, **kwargs)
        return k * 1.01, v

    # Three layers: a shape no earlier call traced, so that the jit traces the corrupted launch.
    monkeypatch.setattr(mosaic_kernel, "launch", k_one_percent_off)
    assert cli.main(["check", *MOSAIC, "--layers", "3", "--backends", "jax"]) == 1
    jax_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("jax "))
    assert "FAIL" in jax_row and ("Mosaic GPU" in jax_row or not ON_CPU)


@pytest.mark.parametrize("argv, message", [
    (["--backends", "torch", "--lowering", "triton"], r"argument --lowering: got triton, expected the jax backend"),
    (["--lowering", "mosaic_gpu", "--rope-style", "gptj", "--rotary-dim", "8", "--tokens", "64"],
     r"argument --lowering: got 'mosaic_gpu' for rope_style='gptj', .*rotary_dim=8, .* expected 'triton'"),
    (["--lowering", "mosaic_gpu", "--dtype", "float32", "--tokens", "64"],
     r"argument --lowering: got 'mosaic_gpu' for rope_style='neox', .*dtype=float32, expected 'triton'"),
    (["--lowering", "mosaic_gpu", "--tokens", "12"],
     r"argument --tokens with --lowering mosaic_gpu: got 12, expected "),
])
def test_check_refuses_a_lowering_that_cannot_run_before_running_anything(argv, message, capsys, monkeypatch):
    assert re.match(message, _refusal(argv, capsys, monkeypatch))


@pytest.mark.skipif(not ON_CPU, reason="the rule of Mosaic GPU's interpreter, without a GPU")
def test_check_on_mosaic_gpu_without_a_gpu_takes_64_tokens_unless_told_and_refuses_16(capsys, monkeypatch):
    assert CheckOptions(lowering="mosaic_gpu").tokens() == 64 and CheckOptions().tokens() == 16
    assert _refusal(["--lowering", "mosaic_gpu", "--tokens", "16"], capsys, monkeypatch) == (
        "argument --tokens with --lowering mosaic_gpu: got 16, expected a multiple of 64 in interpret mode")
