"""The package layers, read from the source: who may import whom.

``infra`` is the base; ``producers`` (rollout side), ``scoring_workers`` and ``shaper``
(trainer side) build on it and never on each other; ``prm_pipeline`` wires them into
commands. Demo and test support lives in ``prm_pipeline.demo``: no production module
imports it, except the command layer (``prm_pipeline/*.py``) lazily, inside the
function of a demo command, so ``prm-pipeline worker`` never loads it.

No module imports itself through others: inside the product packages the import graph
has no circle, counting every import (late ones inside functions, ``TYPE_CHECKING``
ones and relative ones too). A circle is two modules that cannot be understood, tested
or moved apart; a late import only hides it from the interpreter.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("infra", "producers", "scoring_workers", "shaper", "prm_pipeline")
MAY_IMPORT = {
    "infra": set(),
    "producers": {"infra"},
    "scoring_workers": {"infra"},
    "shaper": {"infra"},
    "prm_pipeline": set(PRODUCT),
    "wiring": {"infra", "producers"},  # WIRING below: never the command layer above it
}
# Trainer integrations (verl, OpenRLHF, slime, TRL, AReaL, verifiers), the RewardClient and
# the text-reward helpers under them are both a producer and a verdict reader: they wire
# the rollout side to the trainer side, but never import the command layer.
WIRING = (Path("shaper", "integrations"), Path("shaper", "reward_client.py"), Path("shaper", "text_rewards.py"))
DEMO = "prm_pipeline.demo"


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(module, at module level)`` for every absolute import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    out: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.module, id(node) in top)]
            out += [(f"{node.module}.{a.name}", id(node) in top) for a in node.names]
    return out


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolved(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (``from .batch import x`` in
    ``shaper/filters.py``: ``shaper.batch``)."""
    if node.level == 0:
        return node.module or ""
    package = _module(path).split(".")
    package = package if path.name == "__init__.py" else package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _import_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports, by any import statement anywhere in it.
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``."""
    files = [p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module(p) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = _resolved(path, node)
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in modules else base)
        graph[_module(path)] = {m for m in edges if m in modules and m != _module(path)}
    return graph


def _product_files() -> list[Path]:
    files = [p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")]
    return [p for p in files if not p.is_relative_to(ROOT / "prm_pipeline" / "demo")]


def test_production_packages_import_only_lower_layers() -> None:
    wrong = []
    for path in _product_files():
        pkg = path.relative_to(ROOT).parts[0]
        layer = "wiring" if any(path.relative_to(ROOT).is_relative_to(w) for w in WIRING) else pkg
        for module, _ in _imports(path):
            target = module.split(".", 1)[0]
            if target in PRODUCT and target != pkg and target not in MAY_IMPORT[layer]:
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_no_production_module_imports_the_demo_package() -> None:
    wrong = []
    for path in _product_files():
        rel = path.relative_to(ROOT)
        command_layer = rel.parts[0] == "prm_pipeline" and len(rel.parts) == 2
        for module, top_level in _imports(path):
            if module == DEMO or module.startswith(DEMO + "."):
                if not command_layer or top_level:
                    wrong.append(f"{rel} imports {module}" + (" at module level" if top_level else ""))
    assert not wrong, "\n".join(wrong)


def test_demo_modules_live_in_the_demo_package() -> None:
    """What moved stays moved: the old homes of the demo and test support are gone."""
    old = [
        "prm_pipeline/fake_judge.py",
        "prm_pipeline/demo.py",
        "prm_pipeline/model_server.py",
        "prm_pipeline/report.py",
        "prm_pipeline/processes.py",
        "producers/tiny_model.py",
        "producers/rollout_proxy.py",
        "producers/synthetic.py",
        "shaper/policy_update.py",
    ]
    assert [p for p in old if (ROOT / p).exists()] == []


def test_the_import_graph_has_no_circle() -> None:
    """Break a circle by moving what both sides need into a lower module, not by a late import."""
    try:
        TopologicalSorter(_import_graph()).prepare()
    except CycleError as exc:
        circle = " imports ".join(reversed(exc.args[1]))  # CycleError lists it importee first
        raise AssertionError(f"import circle: {circle}") from None


def test_the_circle_check_sees_late_and_relative_imports() -> None:
    graph = _import_graph()
    assert "shaper.batch" in graph["shaper.filters"]  # from .batch import ExportedGroup
    assert "infra.registry" in graph["prm_pipeline.status.command"]  # inside a function


def test_mypy_skips_no_module() -> None:
    """Every product module is type-checked: no ``[[tool.mypy.overrides]]`` may switch errors off
    (or stop following imports) for any of them."""
    import tomllib
    from pathlib import Path

    config = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    overrides = config["tool"]["mypy"].get("overrides", [])
    skipped = {m for o in overrides if o.get("ignore_errors") or o.get("follow_imports") == "skip" for m in o["module"]}
    assert not skipped, f"modules mypy does not check: {sorted(skipped)}"
