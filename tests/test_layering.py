"""Layering (issue 30): the package's top level is the design card's, and its imports run one way only,
``cli -> flows -> tasks -> slurm -> engine``, checked over every module of `hybridflow` from its AST (imports inside
functions included; an ``if TYPE_CHECKING:`` block is for annotations only and not an import at run time):

- a module imports no module of a higher layer;
- the engine (all that runs inside a rank) and the worker groups never import Prefect; the engine never submitit;
- the engine's bottom (`torch_ops`, `protocol`, `transfer`, `imports`) imports nothing of HybridFlow above it;
- the run store (`flows/store`) imports nothing of HybridFlow; the planner (`flows/placement`) no Prefect;
- no import loop between files, nor between the rooms (files and folders) of any one folder.

Every failure names the importing file, its line and the import. Each rule is also run on a planted tree, so a
checker that stopped seeing imports would fail here too."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hybridflow"
LAYERS = ("engine", "slurm", "tasks", "flows", "cli")  # bottom to top
BOTTOM = {"hybridflow.engine.torch_ops", "hybridflow.engine.protocol", "hybridflow.engine.transfer",
          "hybridflow.engine.imports"}  # fmt: skip


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every import in `path` outside ``if TYPE_CHECKING:`` blocks; for ``from a import b``
    both ``a`` and ``a.b`` (b may be a module)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def graph(package: Path) -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """The package's modules (name -> file) and, per module, the package modules it imports (name -> line)."""
    files = {module_name(p, package): p for p in sorted(package.rglob("*.py")) if "migrations" not in p.parts}
    edges: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        edges[name] = {}
        for line, target in imports(path):
            while target and target not in files:  # a name imported from a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[name].setdefault(target, line)
    return files, edges


def layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def upward_imports(files, edges) -> list[str]:
    out = []
    for name, targets in edges.items():
        for target, line in targets.items():
            if layer(name) is not None and layer(target) is not None and layer(target) > layer(name):
                out.append(f"{files[name]}:{line}: {name} ({LAYERS[layer(name)]}) imports {target} (a higher layer)")
    return out


def forbidden_libraries(files) -> list[str]:
    banned = {"engine": ("prefect", "submitit"), "slurm": ("prefect",), "placement": ("prefect", "submitit")}
    out = []
    for name, path in files.items():
        rooms = name.split(".")[1:3] or [""]
        libraries = banned.get(rooms[0], ()) + (banned["placement"] if rooms[1:] == ["placement"] else ())
        for line, target in imports(path):
            if target.split(".")[0] in libraries:
                out.append(f"{path}:{line}: {name} imports {target}")
    return out


def bottom_and_store(files, edges) -> list[str]:
    out = []
    for name, targets in edges.items():
        allowed = BOTTOM if name in BOTTOM else None
        if name.startswith("hybridflow.flows.store"):
            allowed = {t for t in files if t.startswith("hybridflow.flows.store")}
        for target, line in targets.items():
            if allowed is not None and target not in allowed and target != "hybridflow":
                out.append(f"{files[name]}:{line}: {name} imports {target}, above it")
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def loops(files, edges) -> list[str]:
    """Import loops between files, and between the rooms of each folder (a room: a file or a sub-folder)."""
    out = [f"files import each other in a loop: {c}" for c in cycles({a: set(b) for a, b in edges.items()})]
    folders = {name.rpartition(".")[0] for name in files} | {n for n in files if files[n].name == "__init__.py"}
    for folder in sorted(folders):
        depth = folder.count(".") + 1
        rooms: dict[str, set[str]] = {}
        for a, targets in edges.items():
            for b in targets:
                if a.startswith(folder + ".") and b.startswith(folder + "."):
                    ra, rb = ".".join(a.split(".")[: depth + 1]), ".".join(b.split(".")[: depth + 1])
                    if ra != rb:
                        rooms.setdefault(ra, set()).add(rb)
        out += [f"rooms of {folder} import each other in a loop: {c}" for c in cycles(rooms)]
    return out


FILES, EDGES = graph(PACKAGE)


def test_the_top_level_is_the_design_cards():
    assert sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(LAYERS)
    assert len(FILES) > 80, "the checker found too few modules"


@pytest.mark.parametrize(
    "rule", [upward_imports, bottom_and_store, loops], ids=["one-way layers", "bottom and store", "no loops"]
)
def test_imports_run_one_way(rule):
    problems = rule(FILES, EDGES)
    assert not problems, "\n".join(problems)


def test_engine_and_worker_groups_never_import_prefect():
    problems = forbidden_libraries(FILES)
    assert not problems, "\n".join(problems)


def _plant(tmp_path: Path, modules: dict[str, str]) -> Path:
    package = tmp_path / "hybridflow"
    for name, source in modules.items():
        path = package.joinpath(*name.split(".")[1:]).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in [path.parent, *path.parent.parents]:
            if folder == package.parent:
                break
            (folder / "__init__.py").touch()
        path.write_text(source)
    return package


def test_each_rule_fails_on_a_planted_tree(tmp_path):
    package = _plant(
        tmp_path,
        {
            "hybridflow.engine.metrics": "def f():\n    from hybridflow.flows.rlhf import run_flow\n",
            "hybridflow.engine.protocol": "from hybridflow.engine.metrics import f\n",
            "hybridflow.engine.backends.a": "from hybridflow.engine.config import X\n",
            "hybridflow.engine.config": "from hybridflow.engine.backends import a\nif TYPE_CHECKING:\n    import prefect\n",  # noqa: E501
            "hybridflow.slurm.rank": "import prefect.flows\n",
            "hybridflow.flows.rlhf": "run_flow = 1\n",
            "hybridflow.flows.store.run_store": "from hybridflow.engine import protocol\n",
        },
    )
    files, edges = graph(package)
    upward = upward_imports(files, edges)
    assert len(upward) == 1 and "engine/metrics.py:2: hybridflow.engine.metrics (engine) imports" in upward[0]
    assert "hybridflow.flows.rlhf (a higher layer)" in upward[0]
    below = bottom_and_store(files, edges)
    assert any("protocol imports hybridflow.engine.metrics, above it" in p for p in below)
    assert any("run_store imports hybridflow.engine.protocol, above it" in p for p in below)
    assert any("hybridflow.engine.backends.a', 'hybridflow.engine.config']" in p for p in loops(files, edges))
    assert any("rooms of hybridflow.engine import each other" in p for p in loops(files, edges))
    assert forbidden_libraries(files) == [
        f"{package / 'slurm' / 'rank.py'}:1: hybridflow.slurm.rank imports prefect.flows"
    ]
