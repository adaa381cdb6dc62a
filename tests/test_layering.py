"""Layering (issue 20): the engine (models, algorithms, backends, rollouts, rewards, the planner, and the worker a rank
runs) knows nothing of orchestration. Its modules never import Prefect or submitit, so a worker process and the
single-process trainer load without them, and the controller's choice of orchestration stays in `orchestration`
and the worker groups of `runtime`."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE_ROOMS = ("core", "algorithms", "backends", "rollout", "reward", "placement")
ENGINE = sorted(p for room in ENGINE_ROOMS for p in (ROOT / room).glob("*.py"))
ENGINE += [ROOT / "runtime" / "workers.py", ROOT / "runtime" / "dispatch.py"]  # what a rank runs, and its protocols
ORCHESTRATION = ("prefect", "submitit")


def _imported(path: Path) -> set[str]:
    """The top-level package of every module `path` imports, at any depth of the file (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_layering_check_sees_function_level_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from prefect import flow\n    import submitit.core\n")
    assert set(ORCHESTRATION) <= _imported(probe)


@pytest.mark.parametrize("path", ENGINE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_engine_code_never_imports_prefect_or_submitit(path):
    assert ENGINE, "no engine modules found"
    assert not _imported(path) & set(ORCHESTRATION), f"{path} imports {_imported(path) & set(ORCHESTRATION)}"
