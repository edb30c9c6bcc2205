"""README.md as a new user meets it: every Python snippet runs as written, each in a fresh
``python`` with none of the test harness's environment; the JAX parts of the sharding
section run on host devices after the snippets that make their inputs; every ``fusedkv``
command line is accepted. Without a GPU the snippets pick the CPU (kernels interpreted)."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from interop.command import cli  # noqa: E402
from interop.command.check import gradient_header, header  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _blocks(info: str) -> list[tuple[int, str]]:
    """``(first line, text)`` of every fenced block whose info string is ``info`` in README.md."""
    text = README.read_text()
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1))
            for match in re.finditer(rf"^```{info}\n(.*?)^```", text, re.M | re.S)]


SNIPPETS = _blocks("python")
# Parts of a program on several devices (the sharding section): the JAX ones run on host
# devices after the snippets that make their inputs; the torch one is only compiled.
FRAGMENTS = _blocks("python fragment")
COMMANDS = [shlex.split(line, comments=True) for _, block in _blocks("sh")
            for line in block.splitlines() if line.startswith("fusedkv ")]

# Runs each ``[line, code]`` of the JSON on stdin in one namespace, compiled as README.md's
# own lines, so that a traceback names the README's line.
_RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for line, code in json.load(sys.stdin):
    exec(compile("\\n" * (line - 1) + code, sys.argv[1], "exec"), namespace)
"""


def _run_as_a_user(blocks: list[tuple[int, str]], directory: pathlib.Path, **env: str) -> None:
    """Run README blocks in a fresh ``python`` in ``directory``, without the variables this
    harness sets (a user's shell has none of them) but ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "JAX_PLATFORMS", "XLA_FLAGS")}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    result = subprocess.run([sys.executable, "-c", _RUNNER, str(README)], input=json.dumps(blocks),
                            capture_output=True, text=True, cwd=directory, env=clean | env)
    assert result.returncode == 0, result.stderr


def _is_jax(code: str) -> bool:
    return "torch" not in code


def _section_end(heading: str) -> int:
    """The line of the next ``## `` heading after ``heading``'s."""
    lines = README.read_text().splitlines()
    start = lines.index(heading)
    return next(number for number, line in enumerate(lines[start + 1:], start + 2) if line.startswith("## "))


def _jax_fragment_runs() -> list[list[tuple[int, str]]]:
    """The JAX fragments, each after the JAX snippets that make their inputs (the op's and the
    materializer's sections; later sections make drafts of their own) and the names the
    section takes as given; one that makes no mesh of its own follows the one before."""
    given = (0, "from jax.sharding import NamedSharding, PartitionSpec as P\n"
                "from fusedkv_jax.sharding import head_major_kv, head_parallel_materializer\n"
                "k_norm_weight, eps = jnp.ones((L, D)), jnp.full((L,), 1e-6)\n")
    inputs_end = _section_end("## From hidden states to the KV cache: `FusedKVMaterializer`")
    inputs = [block for block in SNIPPETS if _is_jax(block[1]) and block[0] < inputs_end]
    runs = []
    for fragment in filter(lambda block: _is_jax(block[1]), FRAGMENTS):
        if "mesh = " in fragment[1] or not runs:
            runs.append(inputs + [given])
        runs[-1].append(fragment)
    return runs


def test_readme_shows_the_three_ways_in_and_both_materializers():
    imports = [re.findall(r"^from (\w+) import (\w+)", code, re.M) for _, code in SNIPPETS]
    assert [("fusedkv_torch", "fused_kv_norm_rope") in found for found in imports].count(True) == 1
    assert [("fusedkv_jax", "fused_kv_norm_rope") in found for found in imports].count(True) == 1
    assert sum("interop.fused_kv_norm_rope(" in code for _, code in SNIPPETS) == 1
    for package in ("fusedkv_torch", "fusedkv_jax"):
        assert sum((package, "FusedKVMaterializer") in found for found in imports) == 1


@pytest.mark.parametrize("line, code", SNIPPETS, ids=[f"README.md:{line}" for line, _ in SNIPPETS])
def test_python_snippet_runs_as_written(line, code, tmp_path):
    _run_as_a_user([(line, code)], tmp_path)


@pytest.mark.parametrize("blocks", _jax_fragment_runs(), ids=lambda blocks: f"README.md:{blocks[-1][0]}")
def test_jax_sharding_fragments_run_on_host_devices(blocks, tmp_path):
    # As on a CPU machine, whatever this one has: tests/test_sharding_gpu.py runs the GPU's way.
    _run_as_a_user(blocks, tmp_path, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")


@pytest.mark.parametrize("line, code", FRAGMENTS, ids=[f"README.md:{line}" for line, _ in FRAGMENTS])
def test_python_fragment_is_valid_python(line, code):
    compile("\n" * (line - 1) + code, str(README), "exec")


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_command_line_is_accepted(argv, capsys):
    parser, commands = cli._parsers()
    try:
        args, unknown = parser.parse_known_args(argv[1:])
    except SystemExit as exit_:  # --version
        assert exit_.code == 0 and capsys.readouterr().out.startswith("fusedkv ")
        return
    assert not unknown
    if args.command == "check":
        cli._check_options(commands["check"], args)


def test_sample_outputs_have_the_tables_columns():
    (_, forward), (_, gradients) = _blocks("text")
    assert forward.splitlines()[1] == header()
    assert gradients.splitlines()[0] == gradient_header()
