"""The usual mistakes at the command line, answered in one line before any connection:
a mistyped flag is named with its closest match in the usage of the command it was given
to; an unknown option before the command is named (not "invalid choice" of the word after
it); ``experiment list`` takes no argument; ``--config`` naming a folder says so; an
``--out`` that cannot be written is one line. All in-process: nothing here reaches Kafka."""

from __future__ import annotations

from pathlib import Path

import pytest

from prm_pipeline.cli import COMMANDS, build_parser, main


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(list(argv))
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_a_mistyped_flag_of_a_command_is_named_with_its_closest_match_in_that_commands_usage(capsys) -> None:
    err = _usage_error(capsys, "verdicts", "--from-begining")
    assert err.startswith("usage: prm-pipeline verdicts ")
    assert err.rstrip().endswith(
        "prm-pipeline verdicts: error: unrecognized arguments: --from-begining (did you mean --from-beginning?)"
    ), err
    err = _usage_error(capsys, "--config", "x.yaml", "dead-letters", "--redrve")
    assert "prm-pipeline dead-letters: error: unrecognized arguments: --redrve (did you mean --redrive?)" in err
    err = _usage_error(capsys, "status", "extra")  # no flag: no guess
    assert err.rstrip().endswith("prm-pipeline status: error: unrecognized arguments: extra")


def test_an_unknown_option_before_the_command_is_named_not_taken_for_the_command(capsys) -> None:
    err = _usage_error(capsys, "--conifg", "x.yaml", "status")
    assert "invalid choice" not in err
    assert err.rstrip().endswith("prm-pipeline: error: unrecognized option --conifg (did you mean --config?)"), err
    args = build_parser().parse_args(["--conf", "x.yaml", "-v", "status"])  # an abbreviation still works
    assert (args.config, args.verbose, args.command) == ("x.yaml", True, "status")


def test_experiment_list_takes_no_argument(capsys) -> None:
    err = _usage_error(capsys, "experiment", "list", "extra")
    assert "prm-pipeline experiment: error: experiment list takes no argument, got 'extra'" in err
    assert build_parser().parse_args(["experiment", "remove", "exp-a"]).target == "exp-a"
    assert build_parser().parse_args(["experiment", "list", "--json"]).target is None


def test_a_config_that_is_a_folder_says_so(tmp_path: Path, capsys) -> None:
    assert main(["--config", str(tmp_path), "verdicts"]) == 2
    assert capsys.readouterr().err == f"config error: config file {str(tmp_path)!r} is a folder, not a file\n"


def test_dead_letters_out_in_a_missing_folder_is_one_line(tmp_path: Path, capsys) -> None:
    target = tmp_path / "nodir" / "x.jsonl"
    assert main(["dead-letters", "--out", str(target)]) == 2
    assert capsys.readouterr().err == (
        f"error: dead-letters --out: cannot write {str(target)!r}: folder {str(target.parent)!r} does not exist\n"
    )


def test_dead_letters_help_points_at_the_dead_letter_page() -> None:
    assert "docs/dead-letters.md" in (COMMANDS["dead-letters"].description or "")
    assert (Path(__file__).resolve().parents[2] / "docs" / "dead-letters.md").is_file()
