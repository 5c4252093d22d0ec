"""Which package may import which, read from the source with `ast` (nothing is imported).

Tracing is a layer over the engine, not part of it: `traces/` knows nothing of the engine or the
dashboard, the kernels know nothing of the engine, and the scheduler, KV cache manager and block
pool record no spans. Models sit on the layers (forward ops, attention backends), not beside the
worker: engine/models and engine/layers import nothing from engine/worker, and engine/layers
nothing from engine/models. Every package under engine/ says in its docstring which process runs
it.
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
