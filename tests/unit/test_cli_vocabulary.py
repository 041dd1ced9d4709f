"""One description per command, one meaning per flag name, no development code in the product.

Every command is one :class:`prm_pipeline.cli.Command`; every flag name keeps one
destination and one type in every command that takes it, the shared ones are in
:data:`prm_pipeline.flags.VOCABULARY` (and the README's flag table), old spellings are
hidden aliases that warn, and building the CLI imports neither ``tests`` nor
``prm_pipeline.demo``.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from prm_pipeline.cli import COMMANDS, build_parser, command_parser
from prm_pipeline.flags import DEPRECATED, VOCABULARY, positive_int

ROOT = Path(__file__).resolve().parents[2]
GLOBAL = {"-h", "--help", "--config", "-v", "--verbose"}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return {name: command_parser(parser, name) for name in COMMANDS}


def _visible_flags() -> dict[str, list[tuple[str, argparse.Action]]]:
    """flag -> [(command, action)] over every command's visible (not deprecated) options."""
    uses: dict[str, list[tuple[str, argparse.Action]]] = defaultdict(list)
    for name, p in _parsers().items():
        for action in p._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                if flag not in GLOBAL:
                    uses[flag].append((name, action))
    return uses


def _vocabulary_flags() -> set[str]:
    return {flag for key in VOCABULARY for flag in re.findall(r"-{1,2}[a-z][a-z-]*", key)}


def test_every_flag_name_has_one_destination_and_one_type_across_commands() -> None:
    mixed = {}
    for flag, uses in _visible_flags().items():
        kinds = {(a.dest, getattr(a.type, "__name__", None)) for _, a in uses}
        if len(kinds) > 1:
            mixed[flag] = sorted((c, a.dest, getattr(a.type, "__name__", None)) for c, a in uses)
    assert mixed == {}


def test_every_flag_shared_by_product_commands_or_naming_a_time_is_in_the_vocabulary() -> None:
    known = _vocabulary_flags()
    missing = []
    for flag, uses in _visible_flags().items():
        product = {c for c, _ in uses if not COMMANDS[c].development}
        timed = any(a.metavar == "S" for _, a in uses)
        if (len(product) > 1 or timed) and flag not in known:
            missing.append(flag)
    assert missing == []
    assert known - set(_visible_flags()) - GLOBAL == set()  # no stale entry


def test_the_readme_flag_table_is_the_vocabulary() -> None:
    text = (ROOT / "README.md").read_text()
    rows = "\n".join(f"| `{k}` | {v} |" for k, v in VOCABULARY.items())
    assert f"| flag | meaning |\n|---|---|\n{rows}\n" in text


def test_no_visible_flag_is_called_timeout_and_durations_are_seconds() -> None:
    uses = _visible_flags()
    assert "--timeout" not in uses and "--no-progress" not in uses and "--latency-ms" not in uses
    for flag, entries in uses.items():
        for command, action in entries:
            if re.search(r"timeout|wait|lookback|latency|watch|sample", flag):
                assert action.metavar == "S", (command, flag, action.metavar)


@pytest.mark.parametrize(("command", "old"), sorted(DEPRECATED))
def test_old_spellings_are_hidden_aliases_that_warn(command: str, old: str) -> None:
    p = _parsers()[command]
    new = DEPRECATED[(command, old)]
    alias = next(a for a in p._actions if old in a.option_strings)
    current = next(a for a in p._actions if new in a.option_strings)
    assert alias.help == argparse.SUPPRESS and alias.dest == current.dest
    assert old not in p.format_help()


def test_aliases_convert_to_the_new_meaning(capsys) -> None:
    parser = build_parser()
    cases = [
        (["verdicts", "--timeout", "7"], "idle_timeout", 7.0),
        (["audit", "--timeout", "4"], "scorer_timeout", 4.0),
        (["audit", "--no-progress"], "quiet", True),
        (["inspect", "--group", "g", "--timeout", "3"], "wait", 3.0),
        (["status", "--timeout", "5"], "read_timeout", 5.0),
        (["status", "--verdict-window", "90"], "verdict_lookback", 90.0),
        (["status", "--dead-letter-window", "10"], "dead_letter_lookback", 600.0),  # minutes -> seconds
        (["fake-judge", "--port", "0", "--latency-ms", "50"], "latency", 0.05),  # milliseconds -> seconds
    ]
    for argv, dest, value in cases:
        assert getattr(parser.parse_args(argv), dest) == pytest.approx(value), argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "deprecated" in err and argv[-1 if dest == "quiet" else -2] in err
    # the new spellings: no warning
    args = parser.parse_args(["status", "--dead-letter-lookback", "30", "--read-timeout", "2"])
    assert (args.dead_letter_lookback, args.read_timeout) == (30.0, 2.0)
    assert parser.parse_args(["status"]).dead_letter_lookback == 600.0
    assert capsys.readouterr().err == ""


def test_positive_int_is_defined_once() -> None:
    defined = [
        str(p.relative_to(ROOT))
        for pkg in ("prm_pipeline", "infra", "shaper", "scoring_workers", "producers")
        for p in (ROOT / pkg).rglob("*.py")
        if re.search(r"^def _?positive_int\(", p.read_text(), re.M)
    ]
    assert defined == ["prm_pipeline/flags.py"]
    with pytest.raises(argparse.ArgumentTypeError):
        positive_int("0")


def test_every_command_is_described_once_and_listed_in_help() -> None:
    text = build_parser().format_help()
    for name, command in COMMANDS.items():
        assert command.name == name and name in text and command.help
        assert set(command.needs) <= {"kafka", "redis"}
    assert COMMANDS["audit"].error_exit == 2 and COMMANDS["worker"].needs == ("kafka", "redis")


@pytest.mark.slow  # a fresh Python process
def test_building_the_cli_imports_neither_tests_nor_the_demo() -> None:
    code = (
        "import sys\nimport prm_pipeline.cli as cli\ncli.build_parser().format_help()\n"
        "import prm_pipeline.token_view, prm_pipeline.status.command, prm_pipeline.audit.cli\n"
        "print(sorted(m for m in sys.modules if m == 'tests' or m.startswith(('tests.', 'prm_pipeline.demo'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_no_product_module_imports_tests_or_the_demo_at_module_level() -> None:
    """Only the development commands reach tests/ and prm_pipeline.demo, and only when run."""
    offenders = []
    for pkg in ("prm_pipeline", "infra", "shaper", "scoring_workers", "producers"):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("prm_pipeline", "demo"):
                continue
            for node in ast.parse(path.read_text()).body:  # module level only
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                offenders += [
                    f"{rel}: {n}" for n in names if n == "tests" or n.startswith(("tests.", "prm_pipeline.demo"))
                ]
    assert offenders == []


def test_bench_outside_a_source_checkout_says_so(monkeypatch, capsys) -> None:
    import prm_pipeline.cli as cli

    monkeypatch.setattr(cli, "_source_checkout", lambda: None)
    assert cli.main(["bench", "schema"]) == 2
    err = capsys.readouterr().err
    assert "source checkout" in err and "tests/perf" in err
