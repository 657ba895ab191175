"""The package's layout: folders by product, dependencies pointing one way, no import circle.

Read from the source with `ast` (function-level imports included), so a lazy import that would
tie the core to a server or to the CPU stand-in fails here too.
"""

from __future__ import annotations

import ast
import configparser
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]

# What each area may import (besides itself). The plugin core sits at the bottom; the
# coordinator service shares only the wire protocol, its request signing (and network plumbing)
# with the plugin.
ALLOWED = {
    "core": set(),
    "systems": {"core"},
    "rewards": {"core"},
    "link": {"core"},
    "coordinator": {"link.wire", "link.auth", "core.netutil"},
    "root": {"core", "systems", "rewards", "link"},
    "local": {"core", "systems", "rewards", "link", "root"},
    "cli": {"core", "systems", "rewards", "link", "root", "local", "coordinator", "benchmarks"},
    "benchmarks": {"core", "systems", "rewards", "link", "root", "local", "coordinator"},
}
AREAS = ("core", "systems", "rewards", "link", "coordinator", "local", "cli")


def _modules() -> dict[str, Path]:
    found = {}
    for base in ("mrlx_plugin", "benchmarks"):
        for path in (ROOT / base).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                source = ".".join(parts + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                out.add(full if full in known else source)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in known and m != name}


def _area(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "benchmarks":
        return "benchmarks"
    return parts[1] if len(parts) > 1 and parts[1] in AREAS else "root"


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_dependencies_point_one_way():
    wrong = []
    for module, deps in _graph().items():
        mine = _area(module)
        for dep in deps:
            theirs = _area(dep)
            if theirs == mine:
                continue
            short = dep.split(".", 1)[1] if dep.startswith("mrlx_plugin.") else dep
            if theirs not in ALLOWED[mine] and not any(
                short == a or short.startswith(a + ".") for a in ALLOWED[mine]
            ):
                wrong.append(f"{module} ({mine}) imports {dep} ({theirs})")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_every_module_says_what_it_owns():
    missing = [
        str(p.relative_to(ROOT))
        for p in _modules().values()
        if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()
    ]
    assert not missing, f"modules without a docstring: {missing}"


def test_benchmarks_are_not_installed():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    include = [s.strip() for s in cfg["options.packages.find"]["include"].split(",")]
    packages = setuptools.find_packages(where=str(ROOT), include=include)
    assert "mrlx_plugin.core" in packages and "mrlx_plugin.link" in packages
    assert not [p for p in packages if p.split(".")[0] != "mrlx_plugin"], packages
