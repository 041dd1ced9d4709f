"""``--experiment ID``: the one option that points a command at one experiment (docs/fleet.md).

Commands that produce or read one experiment's records (``publish``, ``trainer``,
``verdicts``, ``inspect``, ``audit``) fall back to ``trainer.experiment`` (env
``PRM_TRAINER_EXPERIMENT``) when it is absent, so one config file or one variable
points every tool of an experiment at the same topics. The fleet-wide commands
(``status``, ``dead-letters``) read absence as "no experiment filter".
"""

from __future__ import annotations

import argparse

from infra.config import PipelineConfig
from infra.experiments import check_experiment_id

__all__ = ["add_experiment_option", "experiment_arg", "experiment_of"]


def experiment_arg(text: str) -> str:
    """argparse ``type=`` for ``--experiment``: a well-formed experiment id, else a one-line usage error."""
    try:
        return check_experiment_id(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_experiment_option(p: argparse.ArgumentParser, help_text: str) -> None:
    """Add ``--experiment ID`` (default ``None``: see the module docstring) to ``p``."""
    p.add_argument("--experiment", type=experiment_arg, default=None, metavar="ID", help=help_text)


def experiment_of(args: argparse.Namespace, cfg: PipelineConfig) -> str:
    """The experiment a command works on: ``--experiment``, else ``trainer.experiment`` (``default``)."""
    return getattr(args, "experiment", None) or cfg.trainer.experiment
