"""The layout's promises, read from the source (no engine): the pure core (the tree runtimes included) and the
drafters import neither vLLM nor the engine glue; every import of vLLM goes through one module of the glue
(engine/vllm_surface.py); the glue drives drafters through their declared interface, never by probing them; the tree
path keeps no module-level state; attention is changed by a registered backend, not by patching vLLM's classes."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "vllm_adaspec"
# Where each installed package's source lives in the checkout (setup.py: kernels/ installs as vllm_adaspec.kernels).
SOURCES = {"vllm_adaspec": PKG, "vllm_adaspec.kernels": ROOT / "kernels"}
# No vLLM, no glue: the algorithms, the step contract, settings and instrumentation.
PURE = ["step.py", "compiled.py", "requests.py", "metrics.py", "observers.py", "config.py", "errors.py", "trees",
        "pools", "policies", "kernels", "runtime", "heads/__init__.py", "heads/medusa.py", "heads/c2t.py"]
DRAFTERS = ["proposers"]
TREE_PATH = ["runtime", "engine/tree_sampler.py", "engine/tree_backend.py", "engine/cpu_tree_backend.py",
             "engine/gpu_tree_backend.py", "engine/runner_hooks.py", "engine/port.py", "engine/worker.py"]
SURFACE = PKG / "engine" / "vllm_surface.py"  # the one module that imports vLLM


def _files(parts):
    for part in parts:
        p = ROOT / part if part == "kernels" else PKG / part
        yield from (sorted(p.rglob("*.py")) if p.is_dir() else [p])


def _imports(path: Path):
    """Every module a file imports, at any depth (function-local imports included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_the_pure_core_and_the_drafters_import_neither_vllm_nor_the_engine_glue():
    bad = [(str(f.relative_to(PKG)), m) for f in _files(PURE + DRAFTERS) for m in _imports(f)
           if m == "vllm" or m.startswith("vllm.") or m.startswith("vllm_adaspec.engine")]
    assert not bad, bad


def test_every_import_of_vllm_goes_through_the_surface_module():
    """engine/vllm_surface.py names, per supported vLLM release, everything the project uses of vLLM; no other module
    of the package (or its kernels) imports vLLM, so a release that moves something is one table to change."""
    files = [f for src in SOURCES.values() for f in src.rglob("*.py") if f != SURFACE]
    bad = [(str(f.relative_to(ROOT)), m) for f in files for m in _imports(f) if m == "vllm" or m.startswith("vllm.")]
    assert not bad, bad
    text = SURFACE.read_text()
    assert "import_module" in text and '"0.32"' in text


def test_the_glue_never_probes_a_drafter_for_what_it_can_do():
    for f in _files(["engine"]):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr",
                                                                                                  "getattr"):
                target = ast.unparse(node.args[0])
                assert "drafter" not in target and "proposer" not in target, (f.name, ast.unparse(node))


def test_the_tree_path_keeps_no_module_level_mutable_state():
    for f in _files(TREE_PATH):
        tree = ast.parse(f.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                value = node.value
                if isinstance(value, ast.Call) and ast.unparse(value.func) == "vllm_object":
                    continue  # a vLLM class or function bound by name (engine/vllm_surface.py), not state
                assert not isinstance(value, (ast.Dict, ast.List, ast.Set, ast.Call, ast.DictComp,
                                              ast.ListComp, ast.SetComp)), (f.name, ast.unparse(node))
            assert not isinstance(node, ast.Global)
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], f.name


def test_attention_is_a_registered_backend_not_a_patched_class():
    for f in _files(["engine"]):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                        assert "Attention" not in t.value.id, (f.name, ast.unparse(node))
    text = (PKG / "engine" / "tree_backend.py").read_text()
    assert "register_backend(AttentionBackendEnum.CPU_ATTN" in text


def _module_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, at any depth (`from a.b import c`: a.b.c where that is a module)."""
    files = {}
    for pkg, src in SOURCES.items():
        for f in src.rglob("*.py"):
            parts = (*pkg.split("."), *f.relative_to(src).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                        for a in node.names}
        graph[name] = {m for m in out if m in files and m != name}
    return graph


def test_the_kernels_live_in_the_top_level_folder_and_install_inside_the_package():
    """kernels/ at the repository's top (the design card), installed as vllm_adaspec.kernels (setup.py): nothing of the
    package imports a top-level `kernels` (the PyPI package of that name), and no kernel is left inside the package."""
    import vllm_adaspec.kernels.tree_attention as ta

    assert Path(ta.__file__).resolve() == ROOT / "kernels" / "tree_attention.py"
    assert not (PKG / "kernels").exists()
    graph_files = [f for src in SOURCES.values() for f in src.rglob("*.py")]
    bad = [(str(f), m) for f in graph_files for m in _imports(f) if m == "kernels" or m.startswith("kernels.")]
    assert not bad, bad
    assert any(n.startswith("vllm_adaspec.kernels.") for n in _module_graph())


def test_the_package_has_no_import_circle():
    """No module reaches itself through the package's imports (function-local ones included): each concept's folder
    can be read, tested and replaced from the bottom up (the settings' error helpers live in errors.py, which imports
    nothing of the package; data/ does not import training/)."""
    graph = _module_graph()
    assert "vllm_adaspec.errors" in graph and not graph["vllm_adaspec.errors"]
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, "import circle: " + " -> ".join(path[path.index(n):] + [n] if n in path
                                                                       else path + [n])
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
