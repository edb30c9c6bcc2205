"""scripts/gpu_trust.py at tiny sizes: every entry point runs and is checked, and each of its
checks (reference, memory growth, threads) fails when it should. A GPU machine runs it at full size."""

import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_trust.py"
_spec = importlib.util.spec_from_file_location("gpu_trust", _SCRIPT)
gpu_trust = importlib.util.module_from_spec(_spec)
sys.modules["gpu_trust"] = gpu_trust  # dataclasses look their module up there
_spec.loader.exec_module(gpu_trust)

MIB = gpu_trust.MIB
TINY = gpu_trust.TINY_PLAN


def _table_lines(output: str) -> dict[str, str]:
    table = output[output.index("== gpu_trust:"):]
    return {entry: line for line in table.splitlines() for entry in _row_names() if line.startswith(entry + " ")}


def _row_names():
    return [entry.name for entry in gpu_trust.ENTRY_POINTS] + [
        f"{backend}, {TINY.threads} threads at once" for backend in gpu_trust.THREAD_BACKENDS]


def test_tiny_run_calls_and_checks_every_entry_point_then_prints_the_table(capsys):
    assert gpu_trust.main(["--tiny"]) == 0
    output = capsys.readouterr().out
    lines = _table_lines(output)
    assert sorted(lines) == sorted(_row_names())
    calls = TINY.calls  # already a multiple of the token-count cycle
    for entry in gpu_trust.ENTRY_POINTS:
        assert lines[entry.name].split()[-1] == "ok"
        assert f" {calls} " in lines[entry.name]
    jax_threads = lines[f"jax, {TINY.threads} threads at once"]
    assert jax_threads.split()[-1] == "ok" and f" {TINY.threads * TINY.calls_per_thread} " in jax_threads
    torch_threads = lines[f"torch, {TINY.threads} threads at once"]
    assert torch_threads.split()[-1] == ("ok" if gpu_trust.ON_GPU else "skipped")
    assert output.rstrip().endswith("gpu_trust: all passed")


def _corrupted_v(plan, total_ctx):
    """The torch op with one V element changed after the call: the reference check must see it."""
    sized = gpu_trust._torch_op(plan, total_ctx)

    def call():
        k, v = sized.call()
        v = v.clone()
        v.view(-1)[0] += 1
        return k, v
    return gpu_trust.Sized(call, sized.check)


def test_a_wrong_last_result_fails_its_row_and_the_exit_status(monkeypatch, capsys):
    broken = gpu_trust.EntryPoint("torch with a corrupted V", ("torch",), _corrupted_v)
    monkeypatch.setattr(gpu_trust, "ENTRY_POINTS", (broken,))
    monkeypatch.setattr(gpu_trust, "THREAD_BACKENDS", ())
    assert gpu_trust.main(["--tiny"]) == 1
    output = capsys.readouterr().out
    assert "last call: AssertionError: v: 1 of" in output
    assert output.rstrip().endswith("gpu_trust: FAILED: torch with a corrupted V")


def test_an_entry_point_that_raises_fails_its_row_without_stopping_the_run():
    def raises(plan, total_ctx):
        raise RuntimeError("no such kernel")
    row = gpu_trust.run_entry_point(gpu_trust.EntryPoint("raises", ("torch",), raises), TINY)
    assert row.verdict == "FAIL" and row.problems == ["RuntimeError: no such kernel"]


def test_memory_growth_past_the_slack_fails_only_for_the_entry_points_frameworks():
    Memory = gpu_trust.Memory
    warm = Memory(torch_allocated=10 * MIB, torch_reserved=64 * MIB, jax_in_use=5 * MIB)
    within = Memory(torch_allocated=10 * MIB + MIB // 2, torch_reserved=90 * MIB, jax_in_use=5 * MIB)
    assert gpu_trust.memory_growth_problems(warm, within, ("torch", "jax")) == []
    grown = Memory(torch_allocated=12 * MIB, torch_reserved=128 * MIB, jax_in_use=7 * MIB)
    assert gpu_trust.memory_growth_problems(warm, grown, ("torch",)) == [
        "torch_allocated grew by 2.00 MiB (slack 1 MiB)", "torch_reserved grew by 64.00 MiB (slack 32 MiB)"]
    assert gpu_trust.memory_growth_problems(warm, grown, ("jax",)) == ["jax_in_use grew by 2.00 MiB (slack 1 MiB)"]
    unread = Memory(None, None, None)
    assert gpu_trust.memory_growth_problems(unread, unread, ("torch", "jax")) == []


def test_a_wrong_result_from_one_thread_fails_the_thread_row(monkeypatch):
    made = gpu_trust._thread_work

    def work_with_one_wrong_call(backend, plan, thread):
        work = made(backend, plan, thread)
        if thread == 1:
            call, check = work[1]
            work[1] = (lambda: (call()[0], call()[0]), check)  # K where V belongs
        return work
    monkeypatch.setattr(gpu_trust, "_thread_work", work_with_one_wrong_call)
    row = gpu_trust.run_threads("jax", TINY)
    assert row.verdict == "FAIL"
    assert row.problems[0].startswith("thread 1 call 1: AssertionError: v: ")
    assert row.problems[1] == f"1 of {TINY.threads * TINY.calls_per_thread} results differ from the reference"
