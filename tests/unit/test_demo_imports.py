"""The demo extra stays optional: workers, the shaper and the CLI never import it; and the CLI
builds its parser (what every command does before its first connection) and ``status`` collects
a report without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("transformers", "tokenizers", "matplotlib")


@pytest.mark.slow  # a fresh Python process
def test_workers_shaper_and_cli_do_not_import_the_demo_extra() -> None:
    code = (
        "import sys\n"
        "import prm_pipeline.cli as cli\n"
        "cli.build_parser()\n"
        "import prm_pipeline.status.collect, prm_pipeline.status.command, prm_pipeline.status.render\n"
        "print('torch' in sys.modules)\n"
        "import scoring_workers.worker, scoring_workers.scorers, shaper, shaper.trainer, producers.publisher\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # torch costs a command about 1.5 s of CPU at start (most of a status report's CPU: 1.5 of 2 s, 42-51 s
    # wall on a loaded box); the parser (every subcommand's options) and a status report need none
    assert out.split() == ["False", "[]"]
