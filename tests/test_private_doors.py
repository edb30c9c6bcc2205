"""The private APIs fusedkv reads, each behind one module with a public fallback, are still
where those modules look: these fail when a supported library moves them (the fallback
would keep results right, and silently cost host time)."""

import subprocess
import sys

import pytest


def test_jaxlib_still_offers_the_dlpack_import_interop_calls():
    pytest.importorskip("jax")
    from interop import jaxlib_dlpack

    assert jaxlib_dlpack._jaxlib_import_buffer() is not None


def test_triton_still_offers_the_binder_knobs_and_compiled_launcher_the_direct_launcher_reads(tmp_path):
    pytest.importorskip("triton")
    # A compiled-mode JITFunction (the interpreter, which conftest turns on, has no binder),
    # from a file: Triton reads a kernel's source.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import triton\n"
        "from triton import knobs\n"
        "@triton.jit\n"
        "def kernel(x):\n"
        "    pass\n"
        "assert hasattr(kernel, 'device_caches'), 'JITFunction.device_caches'\n"
        "runtime = knobs.runtime\n"
        "for name in ('debug', 'launch_enter_hook', 'launch_exit_hook'):\n"
        "    getattr(runtime, name)\n"
        "import inspect\n"
        "from triton.compiler import CompiledKernel\n"
        "source = inspect.getsource(CompiledKernel)\n"
        "for part in ('def run', 'self.function', 'self.packed_metadata'):\n"
        "    assert part in source, 'CompiledKernel: ' + part\n"
    )
    result = subprocess.run([sys.executable, str(probe)], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-2000:]
