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
    # running episodes: the layer above the core, given its hooks resolved (it loads no plugin)
    "episodes": {"core"},
    "systems": {"core", "episodes"},
    # agents as code: a system kind whose episode is user code behind OpenAI-style endpoints
    "agents": {"core", "episodes"},
    "rewards": {"core"},
    "link": {"core"},
    "coordinator": {"link.wire", "link.auth", "core.netutil"},
    "root": {"core", "episodes", "systems", "agents", "rewards", "link"},
    "local": {"core", "episodes", "systems", "agents", "rewards", "link", "root"},
    "cli": {
        "core",
        "episodes",
        "systems",
        "agents",
        "rewards",
        "link",
        "root",
        "local",
        "coordinator",
        "bench",
    },
    # the benchmarks (`mrlx bench`): they drive every other area; only the CLI imports them
    "bench": {"core", "episodes", "systems", "agents", "rewards", "link", "root", "local", "coordinator"},
}
AREAS = ("core", "episodes", "systems", "agents", "rewards", "link", "coordinator", "local", "cli", "bench")


def _modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "mrlx_plugin").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of the import nodes under `if TYPE_CHECKING:` (read by type checkers, never run)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            found.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return found


def _imports(name: str, path: Path, known: dict[str, Path], run_time_only: bool = False) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    skip = _type_only(tree) if run_time_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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
    return parts[1] if len(parts) > 1 and parts[1] in AREAS else "root"


def _graph(run_time_only: bool = False) -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known, run_time_only) for name, path in known.items()}


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
    # A type-only import (under `if TYPE_CHECKING:`) never runs: a system's module names the
    # episode it drives, the episode its system. The direction test above counts those too.
    graph = _graph(run_time_only=True)
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


def test_only_the_package_is_installed_benchmarks_included():
    """The install carries `mrlx_plugin` and nothing beside it (no top-level `tests`, `examples`);
    the benchmarks are part of it (`mrlx_plugin.bench`), so `mrlx bench` needs no checkout."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    include = [s.strip() for s in cfg["options.packages.find"]["include"].split(",")]
    packages = setuptools.find_packages(where=str(ROOT), include=include)
    assert "mrlx_plugin.core" in packages and "mrlx_plugin.link" in packages
    assert "mrlx_plugin.bench" in packages
    assert not [p for p in packages if p.split(".")[0] != "mrlx_plugin"], packages


def test_imports_inside_functions_are_held_to_the_layering(tmp_path):
    """A lazy import is an import: one inside a function of the core that reaches the root (the
    plugin manager's side) is found like one at the top of the module."""
    module = tmp_path / "lazy.py"
    module.write_text(
        "def later():\n    from mrlx_plugin.runtime import runtime_for\n    return runtime_for\n"
    )
    known = _modules()
    found = _imports("mrlx_plugin.core.lazy", module, known)
    assert found == {"mrlx_plugin.runtime"}
    assert _area("mrlx_plugin.runtime") not in ALLOWED[_area("mrlx_plugin.core.lazy")]


# What an episode and a system are given is typed: a parameter or attribute of these names
# annotated `Any` hides which layer it reaches into.
TYPED_NAMES = {"runtime", "context", "episode", "system"}


def _any_annotated(tree: ast.Module) -> list[tuple[int, str]]:
    def is_any(annotation: ast.expr | None) -> bool:
        if annotation is None:
            return False
        text = ast.unparse(annotation).strip("'\"")
        return text == "Any" or text.endswith(".Any")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if arg.arg in TYPED_NAMES and is_any(arg.annotation):
                    found.append((node.lineno, f"{node.name}({arg.arg}: Any)"))
        elif isinstance(node, ast.AnnAssign) and is_any(node.annotation):
            target = ast.unparse(node.target).split(".")[-1]
            if target in TYPED_NAMES:
                found.append((node.lineno, f"{ast.unparse(node.target)}: Any"))
    return found


def test_no_runtime_context_or_episode_is_typed_any():
    wrong = [
        f"{name}:{line}: {what}"
        for name, path in sorted(_modules().items())
        for line, what in _any_annotated(ast.parse(path.read_text()))
    ]
    assert not wrong, "typed as Any:\n" + "\n".join(wrong)


def test_the_any_check_sees_an_any_typed_runtime():
    tree = ast.parse("class E:\n    def __init__(self, runtime: Any):\n        self.runtime: Any = runtime\n")
    assert [what for _, what in _any_annotated(tree)] == ["__init__(runtime: Any)", "self.runtime: Any"]
