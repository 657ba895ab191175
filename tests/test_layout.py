"""The package's layout: folders by product, dependencies pointing one way, no import circle; the
product (`mrlx_plugin`) apart from its lab (`mrlx_lab`: demos, benchmarks, test fakes), which may
import the product and is never imported by it, and neither of them importing the repository's
`examples` or `tests`.

Read from the source with `ast` (function-level imports included, and `importlib.import_module`
or `__import__` of a literal name), so a lazy import that would tie the core to a server, to the
CPU stand-in or to the lab fails here too.
"""

from __future__ import annotations

import ast
import configparser
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]

# What each area may import (besides itself). The plugin core sits at the bottom; the
# coordinator service shares only the wire protocol (the frame and the checks of a queued item),
# its request signing (and network plumbing) with the plugin.
ALLOWED = {
    "core": set(),
    # running episodes: the layer above the core, given its hooks resolved (it loads no plugin)
    "episodes": {"core"},
    "systems": {"core", "episodes"},
    # agents as code: a system kind whose episode is user code behind OpenAI-style endpoints
    "agents": {"core", "episodes"},
    "rewards": {"core"},
    "link": {"core"},
    "coordinator": {"link.wire", "link.item_checks", "link.auth", "core.netutil"},
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
    },
}
AREAS = ("core", "episodes", "systems", "agents", "rewards", "link", "coordinator", "local", "cli")
PRODUCT = (*AREAS, "root")
# The lab (`mrlx_lab`) may import all of the product; inside it, the examples and the stub engine
# stand on the product alone, the demos run the examples, the benchmarks may run the rest of the
# lab, and the lab's commands (entry points of `mrlx`) start the demos, benchmarks and stub engine.
LAB = {
    "lab": set(),
    "lab.procstat": set(),
    "lab.examples": set(),
    "lab.stub_engine": set(),
    "lab.demos": {"lab.examples", "lab.procstat"},
    "lab.bench": {"lab.examples", "lab.procstat", "lab.stub_engine", "lab.demos"},
    "lab.commands": {"lab.demos", "lab.bench", "lab.stub_engine"},
}
ALLOWED |= {area: {*PRODUCT, *deps} for area, deps in LAB.items()}
# What no module of either package imports: the repository's examples and tests (neither is
# installed; pytest puts tests/ on the path, so its modules and folders are names too), the lab
# from the product. (tests/hosts holds stand-ins of slime and Miles, imported by their own names.)
TESTS = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"tests"}
TESTS |= {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith("__")}
NEVER = {"mrlx_plugin": {"examples", "tests", "mrlx_lab", *TESTS}, "mrlx_lab": {"examples", "tests", *TESTS}}


def _modules(packages: tuple[str, ...] = ("mrlx_plugin", "mrlx_lab")) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
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


def _imported(name: str, path: Path, known: dict[str, Path], run_time_only: bool = False) -> set[str]:
    """Every module name `path` imports (relative imports resolved; a name imported from a package
    counts as its module when it is one), and every literal name it hands to
    `importlib.import_module` or `__import__`."""
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
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.add(node.args[0].value)
    return out


def _imports(name: str, path: Path, known: dict[str, Path], run_time_only: bool = False) -> set[str]:
    return {m for m in _imported(name, path, known, run_time_only) if m in known and m != name}


def _area(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "mrlx_lab":
        return f"lab.{parts[1]}" if len(parts) > 1 and f"lab.{parts[1]}" in LAB else "lab"
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


def test_the_wheel_carries_the_product_and_its_lab_and_nothing_else():
    """The install carries `mrlx_plugin` and its lab `mrlx_lab` and nothing beside them (no top-level
    `tests`, `examples`); the benchmarks, the demos and the examples the demos and benchmarks run
    are in the lab, so `mrlx bench` and `mrlx demo --tools` need no checkout; the lab adds its
    commands to `mrlx` through entry points, which the CLI finds without naming the lab."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    include = [s.strip() for s in cfg["options.packages.find"]["include"].split(",")]
    packages = setuptools.find_packages(where=str(ROOT), include=include)
    assert "mrlx_plugin.core" in packages and "mrlx_plugin.link" in packages
    assert {"mrlx_lab.bench", "mrlx_lab.demos", "mrlx_lab.stub_engine"} <= set(packages)
    assert {"mrlx_lab.examples.tool_lookup", "mrlx_lab.examples.research_pair"} <= set(packages)
    assert not [p for p in packages if p.split(".")[0] not in ("mrlx_plugin", "mrlx_lab")], packages
    # the example YAML ships beside its hooks
    assert "examples/*/*.yaml" in cfg["options.package_data"]["mrlx_lab"]
    commands = dict(
        line.split("=", 1) for line in cfg["options.entry_points"]["mrlx_plugin.commands"].split("\n") if line
    )
    assert {name.strip() for name in commands} == {"demo", "bench", "stub-engine"}
    assert all(target.strip().startswith("mrlx_lab.commands:") for target in commands.values())


def test_the_product_never_imports_the_lab_the_examples_or_the_tests():
    """Not at the top of a module, not inside a function, not by a literal `import_module` name:
    the product stands alone in a wheel, and the lab needs no checkout either."""
    known = _modules()
    wrong = []
    for name, path in sorted(known.items()):
        never = NEVER[name.split(".")[0]]
        for imported in _imported(name, path, known):
            if imported.split(".")[0] in never:
                wrong.append(f"{name} imports {imported}")
    assert not wrong, (
        "imports of what is not installed with it, or of the lab from the product:\n" + "\n".join(wrong)
    )


def test_the_import_check_sees_lazy_and_dynamic_imports_of_the_lab_examples_and_tests(tmp_path):
    module = tmp_path / "lazy.py"
    module.write_text(
        "import importlib\n"
        "def later():\n"
        "    from mrlx_lab.demos import kit\n"
        "    import examples.multi_agent.prompts\n"
        "    importlib.import_module('tests._twojobs')\n"
        "    return __import__('_twojobs')\n"
    )
    found = _imported("mrlx_plugin.local.lazy", module, _modules())
    assert {"mrlx_lab.demos.kit", "examples.multi_agent.prompts", "tests._twojobs", "_twojobs"} <= found
    assert all(f.split(".")[0] in NEVER["mrlx_plugin"] for f in found - {"importlib"})
    assert "mrlx_lab" not in NEVER["mrlx_lab"] and "examples" in NEVER["mrlx_lab"]


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
