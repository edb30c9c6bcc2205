"""scripts/grid_on_gpus.sh with stand-ins for ``nvidia-smi`` and ``python3``: how it deals
the grid's configurations to the GPUs, what each part is given, and the one report after."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "grid_on_gpus.sh"

# Records each call (the device it sees, its arguments); a bench part writes its bench.json
# under --out, unless it runs on the device FAKE_FAILING_DEVICE names.
_FAKE_PYTHON = """#!/usr/bin/env bash
echo "${CUDA_VISIBLE_DEVICES:--} $*" >> "$FAKE_CALLS"
[ "${CUDA_VISIBLE_DEVICES:-}" = "${FAKE_FAILING_DEVICE:-none}" ] && exit 1
args=("$@")
for (( i = 0; i < ${#args[@]}; i++ )); do
    if [ "${args[i]}" = --out ] && [[ " $* " != *" --from-json "* ]]; then
        mkdir -p "${args[i+1]}" && echo '{}' > "${args[i+1]}/bench.json"
    fi
done
"""


def _run(tmp_path, gpus: int, *arguments: str, **environment: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\n" + "".join(f"echo 'GPU {i}: NVIDIA H200'\n" for i in range(gpus)))
    python = bin_dir / "python3"
    python.write_text(_FAKE_PYTHON)
    for tool in (smi, python):
        tool.chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               FAKE_CALLS=str(calls), **environment)
    result = subprocess.run(["bash", str(_SCRIPT), *arguments], env=env, capture_output=True, text=True,
                            timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    parts = sorted(line for line in lines if "--from-json" not in line)
    merges = [line for line in lines if "--from-json" in line]
    return result, parts, merges


def _configs_of(part: str) -> str:
    words = part.split()
    return words[words.index("--configs") + 1]


pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_configurations_are_dealt_in_turn_one_part_a_gpu_then_one_report_of_every_part(tmp_path):
    result, parts, merges = _run(tmp_path, 3, "0-4,9")
    assert result.returncode == 0, result.stderr
    assert [part.split()[0] for part in parts] == ["0", "1", "2"]  # each part sees its own GPU only
    assert [_configs_of(part) for part in parts] == ["0,3", "1,4", "2,9"]
    assert all("--shape grid" in part and "--only triton,pallas,torch-copy,xla-copy" in part for part in parts)
    out = tmp_path / "out" / "grid"
    [merge] = merges
    assert f"--from-json {out}/part-0/bench.json,{out}/part-1/bench.json,{out}/part-2/bench.json" in merge
    assert f"--out {out} --markdown {out}/grid.md" in merge


def test_bench_options_given_replace_the_default_rows_in_every_part(tmp_path):
    result, parts, _ = _run(tmp_path, 2, "1,2", "--only", "triton,torch-copy", "--tokens", "1,4096")
    assert result.returncode == 0, result.stderr
    assert all(part.endswith(f"--only triton,torch-copy --tokens 1,4096 --out {tmp_path}/out/grid/part-{i} "
                             f"--markdown {tmp_path}/out/grid/part-{i}/part-{i}.md")
               for i, part in enumerate(parts))


def test_no_more_parts_than_configurations_or_than_fusedkv_gpus_allows(tmp_path):
    _, parts, _ = _run(tmp_path, 8, "5,6")
    assert [_configs_of(part) for part in parts] == ["5", "6"]
    (tmp_path / "calls.txt").unlink()
    _, parts, _ = _run(tmp_path, 8, "0-5", FUSEDKV_GPUS="2")
    assert [_configs_of(part) for part in parts] == ["0,2,4", "1,3,5"]


def test_a_failed_part_fails_the_run_and_the_report_holds_the_other_parts(tmp_path):
    result, parts, merges = _run(tmp_path, 2, "0-3", FAKE_FAILING_DEVICE="1")
    assert result.returncode == 1
    assert "part 1 failed" in result.stderr
    [merge] = merges
    assert "part-0/bench.json" in merge and "part-1" not in merge


@pytest.mark.parametrize("configs", ["0-x", "3;4", "-1"])
def test_configs_not_numbers_and_ranges_are_refused_before_any_part_runs(tmp_path, configs):
    result, parts, merges = _run(tmp_path, 2, configs)
    assert result.returncode == 2
    assert "CONFIGS: expected numbers and ranges" in result.stderr
    assert parts == merges == []


def test_a_host_without_gpus_is_told_so(tmp_path):
    result, parts, _ = _run(tmp_path, 0)
    assert result.returncode == 2
    assert "nvidia-smi lists no GPU here" in result.stderr
    assert parts == []
