"""Test harness: kernels run in interpret mode on a machine without a GPU.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` is decorated, so it is
set here, before a test module imports ``fusedkv_torch``; jax is kept on the CPU
there too. On a GPU machine the same tests run on the GPU, and the interpreted twins of the
contract suite run beside them (``backends.py``).
"""

import collections
import os
import re

import pytest


def _cuda_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


ON_GPU = _cuda_present()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["JAX_PLATFORMS"] = "cpu"


@pytest.fixture(scope="class", params=["torch", "jax"])
def backend(request):
    """Each backend (``backends.py``), interpreted or compiled as the test class says
    (``interpret``: the twins); outside such a class, as this machine runs it by default.
    Skipped where this process cannot run it so."""
    pytest.importorskip(request.param)
    from backends import BACKENDS, machine_interprets

    interpret = getattr(request.cls, "interpret", None)
    if interpret is None:
        interpret = machine_interprets(request.param)
    reason = BACKENDS[request.param].unavailable(interpret)
    if reason:
        pytest.skip(reason)
    chosen = BACKENDS[request.param](interpret=interpret)
    with chosen.context():
        yield chosen


def skip_category(reason: str, on_gpu: bool) -> str:
    """What a skipped test needs, in a few words, from its skip reason; a reason of no
    known kind stands as it is."""
    if re.search(r"\bneeds \d+ \w* ?devices\b", reason):
        return "need several devices"
    if not on_gpu and re.search(r"GPU|CUDA|compiled", reason):
        return "need a GPU"
    return reason


def skip_summary(reasons: list[str], on_gpu: bool) -> str:
    """One line: how many tests were skipped, by what they need, most first."""
    counts = collections.Counter(skip_category(reason, on_gpu) for reason in reasons)
    kinds = ", ".join(f"{count} {kind}" for kind, count in counts.most_common())
    return f"{len(reasons)} skipped: {kinds} (pytest -rs lists each)"


def pytest_terminal_summary(terminalreporter):
    # A bare count of skips would not say that they are the GPU's and several devices' tests.
    reports = terminalreporter.stats.get("skipped", [])
    reasons = [report.longrepr[2].removeprefix("Skipped: ") for report in reports
               if isinstance(report.longrepr, tuple)]
    if reasons:
        terminalreporter.write_line(skip_summary(reasons, ON_GPU))
