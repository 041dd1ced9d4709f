"""The package layers, read from the source: who may import whom.

``infra`` is the base; ``producers`` (rollout side), ``scoring_workers`` and ``shaper``
(trainer side) build on it and never on each other; ``prm_pipeline`` wires them into
commands. Demo and test support lives in ``prm_pipeline.demo``: no production module
imports it, except the command layer (``prm_pipeline/*.py``) lazily, inside the
function of a demo command, so ``prm-pipeline worker`` never loads it.
"""

from __future__ import annotations

import ast
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
    old = ["prm_pipeline/fake_judge.py", "prm_pipeline/demo.py", "prm_pipeline/model_server.py",
           "prm_pipeline/report.py", "prm_pipeline/processes.py", "producers/tiny_model.py",
           "producers/rollout_proxy.py", "producers/synthetic.py", "shaper/policy_update.py"]
    assert [p for p in old if (ROOT / p).exists()] == []
