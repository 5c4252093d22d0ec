"""Which package may import which, read from the source with `ast` (nothing is imported).

Tracing is a library under the engine: `traces/` knows nothing of the engine or the dashboard,
the kernels know nothing of the engine, the engine's configuration nothing of the engine's
packages, no package's modules import each other in a cycle, and the scheduler, KV cache manager
and block pool record no spans. Models sit on the layers (forward ops, attention backends), not
beside the worker: engine/models and engine/layers import nothing from engine/worker, and
engine/layers nothing from engine/models. Every package under engine/ says in its docstring
which process runs it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folders and the packages they hold (pyproject.toml's package-dir).
PACKAGES = {
    "engine": "stepscope.engine",
    "kernels": "stepscope.kernels",
    "traces": "stepscope.traces",
    "viz": "stepscope.viz",
}
ENGINE_PACKAGES = (
    "entrypoints",
    "frontend",
    "core",
    "executor",
    "worker",
    "models",
    "layers",
    "bench",
)
TRACING = ("stepscope.traces", "opentelemetry")
UNTRACED = (
    "engine/core/scheduler.py",
    "engine/core/kv_cache_manager.py",
    "engine/core/block_pool.py",
)


def _module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, in functions too; `from a
    import b` counts as `a.b` as well as `a`, since `b` may be a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _violations(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in paths
        for line, name in imports(path)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


def _sources(folder: str) -> list[Path]:
    paths = sorted((ROOT / folder).rglob("*.py"))
    assert paths, f"no sources under {folder}/"
    return paths


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        ("traces", ("stepscope.engine", "stepscope.viz")),
        ("kernels", ("stepscope.engine",)),
        ("engine/models", ("stepscope.engine.worker",)),
        ("engine/layers", ("stepscope.engine.worker", "stepscope.engine.models")),
    ],
)
def test_lower_layer_does_not_import_upper_one(folder, forbidden):
    assert _violations(_sources(folder), forbidden) == []


# The engine's configuration is read by every process: it sits under every engine package.
ENGINE_FLOORS = tuple(f"stepscope.engine.{p}" for p in ENGINE_PACKAGES)


@pytest.mark.parametrize("path", ["engine/config.py", "engine/engine_args.py"])
def test_the_engine_config_imports_no_engine_package(path):
    assert _violations([ROOT / path], (*ENGINE_FLOORS, "stepscope.viz")) == []


def _import_cycle(paths: list[Path]) -> list[str]:
    """A cycle among the modules of `paths` (their names, the first repeated at the end), or [].
    `from package import sibling` names the package too: that edge up to a module's own package
    is not counted."""
    names = {_module_name(p): p for p in paths}
    graph = {
        name: sorted(
            {m for _, m in imports(p) if m in names and m != name and not name.startswith(m + ".")}
        )
        for name, p in names.items()
    }
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str]:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return []
        for nxt in graph[name]:
            if cycle := visit(nxt, [*path, name]):
                return cycle
        done.add(name)
        return []

    for name in graph:
        if cycle := visit(name, []):
            return cycle
    return []


@pytest.mark.parametrize("folder", ["traces/backend", "engine/entrypoints", "engine/frontend"])
def test_no_import_cycle(folder):
    assert _import_cycle(_sources(folder)) == []


def test_import_cycle_finder_sees_a_cycle(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    folder = tmp_path / "traces" / "backend"
    folder.mkdir(parents=True)
    (folder / "cli.py").write_text("def f():\n    from stepscope.traces.backend import export\n")
    (folder / "export.py").write_text("from stepscope.traces.backend.cli import open_trace\n")
    cycle = _import_cycle(sorted(folder.glob("*.py")))
    assert cycle[0] == cycle[-1] and len(cycle) == 3


def test_the_tracing_library_imports_nothing_of_the_trace_backend():
    """Every process loads traces/ to record spans; the collector, the DuckDB store and the
    queries (traces/backend/) are for the process that holds the file."""
    library = [p for p in _sources("traces") if "backend" not in p.relative_to(ROOT).parts]
    assert library and _violations(library, ("stepscope.traces.backend",)) == []


def test_the_engine_imports_the_dashboard_only_lazily_from_the_cli():
    """engine/ is below viz/; the `stepscope` command line (engine/entrypoints/cli/) starts the
    dashboard, importing it inside a function, so no engine process loads Panel."""
    cli = "engine/entrypoints/cli/"
    found = _violations(_sources("engine"), ("stepscope.viz",))
    assert [v for v in found if not v.startswith(cli)] == []
    for path in _sources(cli):
        top_level = {
            node.lineno
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.Import | ast.ImportFrom)
        }
        eager = [v for v in _violations([path], ("stepscope.viz",)) if _line(v) in top_level]
        assert eager == []


def _line(violation: str) -> int:
    return int(violation.split(":")[1].split()[0])


def test_every_cli_module_is_a_subcommand_family_the_top_parser_registers():
    """One module per subcommand family (as vLLM's entrypoints/cli/): main.py's `FAMILIES` names
    each of them, so a new family cannot be written and left out of `stepscope --help`."""
    folder = ROOT / "engine" / "entrypoints" / "cli"
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__", "main"}
    tree = ast.parse((folder / "main.py").read_text())
    families = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["FAMILIES"]
    )
    assert {e.id for e in families.elts} == modules
    for module in modules:
        body = ast.parse((folder / f"{module}.py").read_text()).body
        functions = {n.name for n in body if isinstance(n, ast.FunctionDef)}
        assert "register" in functions, f"cli/{module}.py has no register(sub)"


@pytest.mark.parametrize("path", UNTRACED)
def test_scheduling_and_kv_modules_record_no_spans(path):
    assert _violations([ROOT / path], TRACING) == []


@pytest.mark.parametrize("package", ENGINE_PACKAGES)
def test_engine_package_docstring_names_its_process(package):
    init = ROOT / "engine" / package / "__init__.py"
    assert init.is_file(), f"engine/{package}/ has no __init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert "process" in doc, f"engine/{package}/__init__.py must say which process runs it"


def test_import_reader_sees_forbidden_imports(tmp_path, monkeypatch):
    """The checks above can fail: relative, nested and `from` imports are all resolved."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "traces").mkdir()
    source = tmp_path / "traces" / "helper.py"
    source.write_text(
        "from ..engine import config\n"
        "def f():\n"
        "    import opentelemetry.trace\n"
        "from stepscope import viz\n"
    )
    assert _violations([source], ("stepscope.engine", "stepscope.viz")) == [
        "traces/helper.py:1 imports stepscope.engine",
        "traces/helper.py:1 imports stepscope.engine.config",
        "traces/helper.py:4 imports stepscope.viz",
    ]
    assert _violations([source], TRACING) == ["traces/helper.py:3 imports opentelemetry.trace"]
    (tmp_path / "engine" / "models").mkdir(parents=True)
    model = tmp_path / "engine" / "models" / "llama.py"
    model.write_text("from ..worker.attention import AttentionBackend\n")
    assert _violations([model], ("stepscope.engine.worker",)) == [
        "engine/models/llama.py:1 imports stepscope.engine.worker.attention",
        "engine/models/llama.py:1 imports stepscope.engine.worker.attention.AttentionBackend",
    ]
