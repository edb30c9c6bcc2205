"""The floors of the package run one way: core <- backends <- the tools above them.

Read from the source (module-level and deferred imports alike) and, where import order
matters, checked by importing in a fresh interpreter.
"""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = ("interop", "fusedkv_torch", "fusedkv_jax")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every project module ``path`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PROJECT}


def _sources(package: str):
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


def _floor(module: str) -> int:
    if module == "interop.core" or module.startswith("interop.core."):
        return 0
    if module.split(".")[0] in ("fusedkv_torch", "fusedkv_jax"):
        return 1
    return 2


def test_the_core_imports_nothing_above_it():
    for path in _sources("interop.core"):
        above = {name for name in _imports(path) if _floor(name) > 0}
        assert not above, f"{_module_name(path)} imports {sorted(above)}"


def test_backends_import_the_core_and_themselves_only():
    for package in ("fusedkv_torch", "fusedkv_jax"):
        for path in _sources(package):
            imported = _imports(path)
            other = {name for name in imported if _floor(name) == 2}
            other |= {name for name in imported if name.split(".")[0] not in (package, "interop")}
            assert not other, f"{_module_name(path)} imports {sorted(other)}"


def test_importing_the_core_and_the_backends_loads_no_upper_floor_and_no_framework_for_the_core():
    script = (
        "import sys\n"
        "import interop.core.spec, interop.core.reference, interop.core.materializer, interop.core.arrays\n"
        "import interop.core.checkpoint\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'triton', 'fusedkv_torch',"
        " 'fusedkv_jax', 'safetensors') or (m.startswith('interop.') and not m.startswith('interop.core')))\n"
        "assert not loaded, loaded\n"
        "import fusedkv_torch, fusedkv_jax\n"
        "upper = sorted(m for m in sys.modules if m.startswith('interop.') and not m.startswith('interop.core'))\n"
        "assert not upper, upper\n"
    )
    env = {"TRITON_INTERPRET": "1", "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_no_module_level_import_circle():
    graph = {}
    for package in PROJECT:
        for path in _sources(package):
            tree = ast.parse(path.read_text())
            names = set()
            for node in tree.body:  # module level only: a deferred import cannot close a circle at import
                if isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    # `from package import module` imports the module: its name resolves to it.
                    names.update(f"{node.module}.{alias.name}" for alias in node.names)
            graph[_module_name(path)] = {n for n in names if n.split(".")[0] in PROJECT}
    modules = set(graph)

    def resolve(name):  # "interop.core.spec" or a name imported from a package
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    state = {}

    def visit(module, trail):
        state[module] = "open"
        for target in map(resolve, graph.get(module, ())):
            if not target or target == module or module.startswith(target + "."):
                continue  # a package's own __init__ runs first by Python's rules
            assert state.get(target) != "open", f"import circle: {' -> '.join(trail + [target])}"
            if target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(modules):
        if module not in state:
            visit(module, [module])
