"""The test run's last lines say what its skipped tests need, so that a CPU machine's
skips read as what they are: the tests of a GPU and of several devices."""

import pathlib
import subprocess
import sys

from conftest import ON_GPU

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")

SKIPPING_TESTS = '''
import pytest

@pytest.mark.skipif(True, reason="needs 4 jax devices: run elsewhere with host devices")
@pytest.mark.parametrize("n", [1, 2])
def test_on_a_mesh(n):
    pass

@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_compiled():
    pass

def test_told_to_skip():
    pytest.skip("pinned on another machine")

def test_runs():
    pass
'''


def test_the_summary_counts_the_skips_by_what_they_need(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "test_skipping.py").write_text(SKIPPING_TESTS)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary, last = result.stdout.rstrip("\n").splitlines()[-2:]
    gpu = "need a GPU" if not ON_GPU else "needs a CUDA device"
    assert summary == (f"4 skipped: 2 need several devices, 1 {gpu}, 1 pinned on another machine "
                       "(pytest -rs lists each)")
    assert last.startswith("1 passed, 4 skipped in ")
