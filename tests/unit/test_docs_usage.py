"""Docs that restate CLI choices list every one of them (a new mode cannot go missing)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from prm_pipeline.cli import add_trainer_parser

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _choices(option: str) -> list[str]:
    sub = argparse.ArgumentParser().add_subparsers()
    add_trainer_parser(sub)
    parser = sub.choices["trainer"]
    action = next(a for a in parser._actions if option in a.option_strings)
    return [str(c) for c in action.choices]


def test_trainer_usage_line_lists_every_combined_mode_and_shaping_mode() -> None:
    text = (DOCS / "trainer.md").read_text()
    usage = text[text.index("`prm-pipeline trainer [") :]
    usage = usage[: usage.index("` overrides them")]
    for option in ("--combined-mode", "--mode"):
        assert f"{option} {'|'.join(_choices(option))}]" in usage, (option, _choices(option))


def test_every_yaml_block_in_the_docs_is_yaml() -> None:
    """A YAML example holds YAML only (prose inside one reads as a broken config)."""
    import re

    import yaml

    broken = []
    for path in sorted(DOCS.rglob("*.md")):
        for n, block in enumerate(re.findall(r"```ya?ml\n(.*?)```", path.read_text(), flags=re.S)):
            try:
                yaml.safe_load(block)
            except yaml.YAMLError as exc:
                broken.append(f"{path.name} block {n}: {str(exc).splitlines()[0]}")
    assert broken == []


ROOT = DOCS.parent


def _bash_blocks() -> list[tuple[str, str]]:
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [(p.name, block) for p in pages for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", p.read_text(), re.S)]


def test_every_published_file_in_the_docs_exists() -> None:
    """A `prm-pipeline publish FILE` a reader copies names a file of the repository (or one
    the same snippet writes first)."""
    missing = []
    for page, block in _bash_blocks():
        written = set(re.findall(r">\s*(\S+\.jsonl)", block))
        for line in block.splitlines():
            command = line.split("#", 1)[0]
            if "prm-pipeline" not in command or " publish " not in f"{command} ":
                continue
            for name in re.findall(r"(\S+\.jsonl)\b", command):
                if name not in written and not (ROOT / name).is_file():
                    missing.append(f"{page}: {line.strip()}")
    assert missing == []


def test_the_trainers_dedupe_key_is_stated_with_the_experiment() -> None:
    """Group ids are scoped by experiment: the dedupe key is (experiment_id, group_id,
    verdict_version) wherever the docs and code comments state it."""
    sources = [
        ROOT / "README.md",
        *DOCS.rglob("*.md"),
        *(
            p
            for pkg in ("infra", "scoring_workers", "shaper", "prm_pipeline", "producers")
            for p in (ROOT / pkg).rglob("*.py")
        ),
    ]
    stale = re.compile(r"dedupe[^.;]{0,40}?\(`{0,2}group_id, verdict_version\)", re.S)
    found = [f"{p.relative_to(ROOT)}: {m.group(0)!r}" for p in sources for m in stale.finditer(p.read_text())]
    assert found == []


def test_readme_says_when_a_killed_worker_leaves_its_consumer_group() -> None:
    """README's note under the status example names the setting that drops a dead member,
    with the value the defaults and config/demo.yaml give it."""
    import yaml

    from infra.config import KafkaConfig

    text = " ".join((ROOT / "README.md").read_text().split())
    note = text[text.index("(The group still lists 2 members.") :]
    note = note[: note.index("in Redis.)")]
    seconds = KafkaConfig().session_timeout_ms / 1000
    demo = yaml.safe_load((ROOT / "config" / "demo.yaml").read_text())["kafka"]["session_timeout_ms"] / 1000
    assert seconds == demo
    assert (
        f"`kafka.session_timeout_ms` after its last heartbeat ({seconds:g} s by default and in `config/demo.yaml`"
        in note
    ), note
    assert "stays a member until its session times out" not in text  # the old, unqualified claim


def test_architecture_states_what_a_redis_failover_leaves_of_the_decision() -> None:
    """A group is decided once only while Redis keeps its writes: the page says what a failover
    leaves (a second verdict with the same dedupe key) and names the test that builds that state."""
    text = " ".join((DOCS / "architecture.md").read_text().split())
    assert "it is decided exactly once" not in text
    assert "A Redis failover can decide a group twice; the trainer still trains on it once." in text
    assert "`tests/integration/test_ledger_failover.py`" in text
    assert (ROOT / "tests" / "integration" / "test_ledger_failover.py").is_file()
