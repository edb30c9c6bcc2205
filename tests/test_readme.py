"""README.md as a new user meets it: every Python snippet runs as written, every ``fusedkv``
command line is accepted. Without a GPU the snippets pick the CPU (kernels interpreted)."""

import pathlib
import re
import shlex

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from interop.command import cli  # noqa: E402
from interop.command.check import header  # noqa: E402

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks(info: str) -> list[tuple[int, str]]:
    """``(first line, text)`` of every fenced block whose info string is ``info`` in README.md."""
    text = README.read_text()
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1))
            for match in re.finditer(rf"^```{info}\n(.*?)^```", text, re.M | re.S)]


SNIPPETS = _blocks("python")
# Parts of a program on several devices (the sharding section): they cannot run in one
# CPU process, so they are only compiled here; tests/test_sharding.py runs the patterns.
FRAGMENTS = _blocks("python fragment")
COMMANDS = [shlex.split(line, comments=True) for _, block in _blocks("sh")
            for line in block.splitlines() if line.startswith("fusedkv ")]


def test_readme_shows_the_three_ways_in_and_both_materializers():
    imports = [re.findall(r"^from (\w+) import (\w+)", code, re.M) for _, code in SNIPPETS]
    assert [("fusedkv_torch", "fused_kv_norm_rope") in found for found in imports].count(True) == 1
    assert [("fusedkv_jax", "fused_kv_norm_rope") in found for found in imports].count(True) == 1
    assert sum("interop.fused_kv_norm_rope(" in code for _, code in SNIPPETS) == 1
    for package in ("fusedkv_torch", "fusedkv_jax"):
        assert sum((package, "FusedKVMaterializer") in found for found in imports) == 1


@pytest.mark.parametrize("line, code", SNIPPETS, ids=[f"README.md:{line}" for line, _ in SNIPPETS])
def test_python_snippet_runs_as_written(line, code):
    # Padded so that a traceback names the README's own line; a fresh namespace, so a
    # name the snippet does not define itself fails.
    exec(compile("\n" * (line - 1) + code, str(README), "exec"), {"__name__": "__readme__"})


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


def test_sample_output_has_the_tables_columns():
    (_, sample), = _blocks("text")
    assert sample.splitlines()[1] == header()
