"""Docs that restate CLI choices list every one of them (a new mode cannot go missing)."""

from __future__ import annotations

import argparse
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
    usage = text[text.index("`prm-pipeline trainer ["):]
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
