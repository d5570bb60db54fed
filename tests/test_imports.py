"""The package's modules import without loops: each imports alone in a fresh interpreter, and
the graph of imports between orca_sc's modules (top-level and inside functions) is acyclic.
"""

import ast
import importlib
import multiprocessing
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "orca_sc"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(_module_name(p) for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


def _imports(path: Path) -> set[str]:
    """orca_sc modules that ``path`` imports anywhere (relative imports resolved; ``from .x
    import y`` counts as ``x.y`` when that is a module, else ``x``).
    """
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("orca_sc"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("orca_sc")}
    return found - {name}


def test_the_import_graph_has_no_cycle():
    """Edges into a package's ``__init__`` are left out where the package imports lazily
    (``orca_sc`` itself: PEP 562), since importing it runs nothing of its modules.
    """
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        graph[_module_name(path)] = {m for m in _imports(path) if m in MODULES and m != "orca_sc"}
    # a package's __init__ imports its modules: importing a module imports its package first,
    # which is not a loop between the two
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycle = stack[stack.index(dep) :] + [dep]
                pytest.fail("import loop: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def _import_alone(name: str) -> str:
    """In a forked child: forget every orca_sc module, then import ``name`` first."""
    for key in [k for k in sys.modules if k == "orca_sc" or k.startswith("orca_sc.")]:
        del sys.modules[key]
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - reported by the test
        return f"{name}: {type(e).__name__}: {e}"
    return ""


def test_every_module_imports_alone():
    """Each module imported first, with no other orca_sc module loaded (third-party packages
    stay loaded: forked children of this process, so that the check takes seconds).
    """
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        failures = [f for f in pool.map(_import_alone, MODULES) if f]
    assert not failures, failures


def test_benchmark_scripts_import_and_print_their_help():
    """Every script in benchmarks/ imports (no module it names is gone) and prints its --help,
    all in one fresh interpreter with benchmarks/ as the working folder, as a user runs them.
    """
    import subprocess

    folder = PACKAGE.parent / "benchmarks"
    scripts = sorted(p.name for p in folder.glob("*.py") if not p.name.startswith("_"))
    assert scripts, "no benchmark scripts found"
    code = (
        "import runpy, sys\n"
        "sys.path.insert(0, '.')\n"
        f"for name in {scripts!r}:\n"
        "    sys.argv = [name, '--help']\n"
        "    try:\n"
        "        runpy.run_path(name, run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (name, e.code)\n"
        "    else:\n"
        "        raise AssertionError(name + ' did not parse --help')\n"
        "    print('ok', name)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("ok ") == len(scripts)
