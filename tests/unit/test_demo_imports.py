"""The demo extra stays optional: workers, the shaper and the CLI never import it."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("transformers", "tokenizers", "matplotlib")


def test_workers_shaper_and_cli_do_not_import_the_demo_extra() -> None:
    code = (
        "import sys\n"
        "import scoring_workers.worker, scoring_workers.scorers, shaper, shaper.trainer, producers.publisher\n"
        "import prm_pipeline.cli as cli\n"
        "cli.build_parser()\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
