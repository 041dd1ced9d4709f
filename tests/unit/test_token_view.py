"""``inspect --verdicts FILE --session ID`` (docs/demo.md): the session is looked for in every
group of the file, not only the first ``--max-groups``, and a session that is nowhere says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from prm_pipeline.token_view import verdict_record
from tests.unit.test_batch import accepted_group

REPO = Path(__file__).resolve().parents[2]


def _inspect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prm_pipeline.cli", "inspect", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


@pytest.mark.slow  # the CLI as a child process
def test_a_session_beyond_the_first_groups_is_found_and_a_missing_one_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "verdicts.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(verdict_record(accepted_group(f"g{i}"))) + b"\n"
                              for i in range(5)))
    found = _inspect("--verdicts", str(path), "--session", "g4-s1")  # the 5th group; --max-groups is 3
    assert found.returncode == 0, found.stderr
    assert "g4 · g4-s1 · leaf g4-s1-t0" in found.stdout
    assert "g0" not in found.stdout and "g4-s0" not in found.stdout  # only that session is shown

    missing = _inspect("--verdicts", str(path), "--session", "g9-s0")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.strip() == f"inspect: no session 'g9-s0' in {path} (5 verdict(s) read)"
